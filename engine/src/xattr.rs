//! Extended attributes: `(ino, XattrItem, chain_offset(hash(name), link))` items, the chain
//! of the inode's attributes whose names share the keyed hash ([`crate::bucket`]). Names up to
//! 255 bytes, values up to 64 KiB (Linux's limit; E2BIG beyond): a value up to
//! [`XATTR_INLINE_MAX_BYTES`] sits in its link, a larger one in pieces of its own,
//! `(ino, XattrValue, hash << 32 | slot << 16 | piece)`. Setting or removing one is all or
//! nothing ([`Filesystem::run_op`]).
//!
//! # Invariants
//! - An entry with its value in pieces owns slot `slot` of its hash: no other entry of the
//!   chain uses it, and pieces 0..n of it exist, holding exactly its length.

use crate::bucket::{Chain, CHAIN_LINKS_PER_CHANGE_MAX};
use crate::error::{EngineError, Result};
use crate::format::items::{
    decode_xattrs, xattr_piece_offset, Timespec, Xattr, XattrValue, MAX_XATTR_VALUE_BYTES,
    XATTR_INLINE_MAX_BYTES, XATTR_PIECE_BYTES,
};
use crate::format::{ItemKind, Key};
use crate::fs::{Filesystem, Needs};
use crate::space::MetaNeed;

/// setxattr(2) flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum XattrFlags {
    #[default]
    Any,
    /// XATTR_CREATE: fail if it exists.
    Create,
    /// XATTR_REPLACE: fail if it does not.
    Replace,
}

fn piece_key(ino: u64, hash: u32, slot: u16, piece: usize) -> Key {
    Key::new(
        ino,
        ItemKind::XattrValue,
        xattr_piece_offset(hash, slot, piece as u16),
    )
}

/// The namespaces of Linux's extended attributes, each with its dot.
const XATTR_NAMESPACES: [&[u8]; 4] = [b"user.", b"trusted.", b"security.", b"system."];

fn pieces_of(len: usize) -> usize {
    len.div_ceil(XATTR_PIECE_BYTES)
}

impl Filesystem {
    fn xattr_chain(&mut self, ino: u64, name: &[u8]) -> Result<Chain<Xattr>> {
        self.load_inode(ino)?;
        let hash = self.name_hash(name);
        self.read_chain(ino, ItemKind::XattrItem, hash)
    }

    fn check_xattr_name(name: &[u8]) -> Result<()> {
        if name.len() > 255 {
            return Err(EngineError::NameTooLong);
        }
        if name.is_empty() || name.contains(&0) {
            return Err(EngineError::Invalid("empty or NUL in xattr name".into()));
        }
        // Linux's rule (fs/xattr.c, xattr_resolve_name): a namespace's prefix alone names
        // no attribute.
        if XATTR_NAMESPACES.contains(&name) {
            return Err(EngineError::Invalid(format!(
                "xattr name {:?} has an empty suffix",
                String::from_utf8_lossy(name)
            )));
        }
        Ok(())
    }

    /// Reserves what rewriting a chain link or two, `pieces` value pieces and the inode may
    /// allocate, as changes of kind `need`.
    fn reserve_xattr_change(&mut self, ino: u64, pieces: usize, need: MetaNeed) -> Result<()> {
        let shard = self.shard_of(ino);
        let mut needs = Needs::default();
        let ops = CHAIN_LINKS_PER_CHANGE_MAX + pieces as u64 + 1;
        needs.meta(shard, ops * self.tree_op_blocks(shard));
        self.reserve(&needs, need)
    }

    /// Writes back a changed chain and the inode's ctime (the caller reserved the room).
    fn put_xattr_chain(&mut self, ino: u64, chain: &Chain<Xattr>) -> Result<()> {
        self.write_chain(chain)?;
        let mut item = self.load_inode(ino)?;
        item.ctime = Timespec::now();
        self.store_inode(ino, &item)
    }

    /// Removes pieces `from..count` of slot `slot` of hash `hash`.
    fn remove_pieces(
        &mut self,
        ino: u64,
        hash: u32,
        slot: u16,
        from: usize,
        count: usize,
    ) -> Result<()> {
        let shard = self.shard_of(ino);
        self.with_tree(shard, true, |tree, io| {
            for piece in from..count {
                tree.remove(io, &piece_key(ino, hash, slot, piece))?;
            }
            Ok(())
        })
    }

    pub fn setxattr(
        &mut self,
        ino: u64,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
    ) -> Result<()> {
        self.run_op(|fs| {
            Self::check_xattr_name(name)?;
            if value.len() > MAX_XATTR_VALUE_BYTES {
                return Err(EngineError::XattrTooLarge(value.len()));
            }
            let hash = fs.name_hash(name);
            let mut chain = fs.xattr_chain(ino, name)?;
            let old = chain.remove(name);
            match (&old, flags) {
                (Some(_), XattrFlags::Create) => return Err(EngineError::Exists),
                (None, XattrFlags::Replace) => return Err(EngineError::NoData),
                _ => {}
            }
            let old_pieces = match &old {
                Some(Xattr {
                    value: XattrValue::Pieces { slot, len },
                    ..
                }) => Some((*slot, pieces_of(*len as usize))),
                _ => None,
            };
            let new_pieces = if value.len() > XATTR_INLINE_MAX_BYTES {
                pieces_of(value.len())
            } else {
                0
            };
            // A large value keeps the slot it had, or takes the lowest one its chain leaves.
            let slot = match old_pieces {
                Some((slot, _)) => slot,
                None => chain.lowest_free_slot()?,
            };
            let entry_value = if new_pieces > 0 {
                XattrValue::Pieces {
                    slot,
                    len: value.len() as u32,
                }
            } else {
                XattrValue::Inline(value.to_vec())
            };
            // A new value may not fit where the old one was: it takes the first link with
            // room, like a new attribute.
            chain.insert(Xattr {
                name: name.to_vec(),
                value: entry_value,
            });
            let old_count = old_pieces.map_or(0, |(_, n)| n);
            fs.reserve_xattr_change(ino, old_count.max(new_pieces), MetaNeed::Grow)?;
            if new_pieces > 0 {
                let shard = fs.shard_of(ino);
                fs.with_tree(shard, true, |tree, io| {
                    for (piece, bytes) in value.chunks(XATTR_PIECE_BYTES).enumerate() {
                        tree.insert(io, piece_key(ino, hash, slot, piece), bytes.to_vec())?;
                    }
                    Ok(())
                })?;
            }
            if let Some((old_slot, count)) = old_pieces {
                fs.remove_pieces(ino, hash, old_slot, new_pieces, count)?;
            }
            fs.put_xattr_chain(ino, &chain)
        })
    }

    pub fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        Self::check_xattr_name(name)?;
        let hash = self.name_hash(name);
        let value = self
            .xattr_chain(ino, name)?
            .get(name)
            .map(|x| x.value.clone())
            .ok_or(EngineError::NoData)?;
        match value {
            XattrValue::Inline(bytes) => Ok(bytes),
            XattrValue::Pieces { slot, len } => {
                let shard = self.shard_of(ino);
                let pieces = self.with_tree(shard, false, |tree, io| {
                    tree.range(
                        io,
                        piece_key(ino, hash, slot, 0),
                        piece_key(ino, hash, slot, pieces_of(len as usize)),
                    )
                })?;
                let mut out = Vec::with_capacity(len as usize);
                for (i, (key, bytes)) in pieces.iter().enumerate() {
                    if key.offset != xattr_piece_offset(hash, slot, i as u16) {
                        return Err(EngineError::corrupt_inode(
                            "xattr value",
                            ino,
                            format!("piece {i} missing"),
                        ));
                    }
                    out.extend_from_slice(bytes);
                }
                if out.len() != len as usize {
                    return Err(EngineError::corrupt_inode(
                        "xattr value",
                        ino,
                        format!("pieces hold {} bytes, the entry says {len}", out.len()),
                    ));
                }
                Ok(out)
            }
        }
    }

    /// Every attribute name of `ino`, in hash order.
    pub fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>> {
        self.load_inode(ino)?;
        let shard = self.shard_of(ino);
        let items = self.with_tree(shard, false, |tree, io| {
            tree.range(
                io,
                Key::new(ino, ItemKind::XattrItem, 0),
                Key::new(ino, ItemKind::XattrItem, u64::MAX),
            )
        })?;
        let mut names = Vec::new();
        for (_, bytes) in items {
            for x in decode_xattrs(&bytes)
                .map_err(|why| EngineError::corrupt_inode("xattr item", ino, why))?
            {
                names.push(x.name);
            }
        }
        Ok(names)
    }

    pub fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<()> {
        self.run_op(|fs| {
            Self::check_xattr_name(name)?;
            let hash = fs.name_hash(name);
            let mut chain = fs.xattr_chain(ino, name)?;
            let old = chain.remove(name).ok_or(EngineError::NoData)?;
            let pieces = match old.value {
                XattrValue::Pieces { slot, len } => Some((slot, pieces_of(len as usize))),
                XattrValue::Inline(_) => None,
            };
            fs.reserve_xattr_change(ino, pieces.map_or(0, |(_, n)| n), MetaNeed::Shrink)?;
            if let Some((slot, count)) = pieces {
                fs.remove_pieces(ino, hash, slot, 0, count)?;
            }
            fs.put_xattr_chain(ino, &chain)
        })
    }
}
