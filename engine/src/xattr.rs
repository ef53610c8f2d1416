//! Extended attributes: `(ino, XattrItem, chain_offset(hash(name), link))` items, the chain
//! of the inode's attributes whose names share the keyed hash ([`crate::bucket`]). Names up to
//! 255 bytes; a value must fit one item with its name ([`MAX_XATTR_VALUE_BYTES`]). Setting or
//! removing one is all or nothing ([`Filesystem::run_op`]).

use crate::bucket::{Chain, CHAIN_LINKS_PER_CHANGE_MAX};
use crate::error::{EngineError, Result};
use crate::format::items::{decode_xattrs, Timespec, Xattr};
use crate::format::node::MAX_ITEM_BYTES;
use crate::format::{ItemKind, Key};
use crate::fs::{Filesystem, Needs};
use crate::space::MetaNeed;

/// Largest xattr value corefs stores (one tree item holds the name, the value and any names
/// sharing the hash).
pub const MAX_XATTR_VALUE_BYTES: usize = MAX_ITEM_BYTES - 256 - 4;

/// setxattr(2) flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum XattrFlags {
    #[default]
    Any,
    /// XATTR_CREATE: fail if it exists.
    Create,
    /// XATTR_REPLACE: fail if it does not.
    Replace,
}

impl Filesystem {
    fn xattr_chain(&mut self, ino: u64, name: &[u8]) -> Result<Chain<Xattr>> {
        self.load_inode(ino)?;
        let hash = self.name_hash(name);
        self.read_chain(ino, ItemKind::XattrItem, hash)
    }

    /// Writes back a changed chain and the inode's ctime: reserved first, so it is all or
    /// nothing.
    fn put_xattr_chain(&mut self, ino: u64, chain: &Chain<Xattr>, need: MetaNeed) -> Result<()> {
        let shard = self.shard_of(ino);
        let mut needs = Needs::default();
        needs.meta(
            shard,
            (CHAIN_LINKS_PER_CHANGE_MAX + 1) * self.tree_op_blocks(shard),
        );
        self.reserve(&needs, need)?;
        self.write_chain(chain)?;
        let mut item = self.load_inode(ino)?;
        item.ctime = Timespec::now();
        self.store_inode(ino, &item)
    }

    fn check_xattr_name(name: &[u8]) -> Result<()> {
        if name.len() > 255 {
            return Err(EngineError::NameTooLong);
        }
        if name.is_empty() || name.contains(&0) {
            return Err(EngineError::Invalid("empty or NUL in xattr name".into()));
        }
        Ok(())
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
                return Err(EngineError::TooBig(format!(
                    "xattr values are limited to {MAX_XATTR_VALUE_BYTES} bytes"
                )));
            }
            let mut chain = fs.xattr_chain(ino, name)?;
            match (chain.get(name).is_some(), flags) {
                (true, XattrFlags::Create) => return Err(EngineError::Exists),
                (false, XattrFlags::Replace) => return Err(EngineError::NoData),
                _ => {}
            }
            // A new value may not fit where the old one was: it takes the first link with
            // room, like a new attribute.
            chain.remove(name);
            chain.insert(Xattr {
                name: name.to_vec(),
                value: value.to_vec(),
            });
            fs.put_xattr_chain(ino, &chain, MetaNeed::Grow)
        })
    }

    pub fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        Self::check_xattr_name(name)?;
        self.xattr_chain(ino, name)?
            .get(name)
            .map(|x| x.value.clone())
            .ok_or(EngineError::NoData)
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
            let mut chain = fs.xattr_chain(ino, name)?;
            chain.remove(name).ok_or(EngineError::NoData)?;
            fs.put_xattr_chain(ino, &chain, MetaNeed::Shrink)
        })
    }
}
