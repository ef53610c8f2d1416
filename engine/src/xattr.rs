//! Extended attributes: `(ino, XattrItem, hash(name))` items, each a bucket of the inode's
//! attributes whose names share the hash. Names up to 255 bytes; a value must fit one item
//! with its bucket ([`MAX_XATTR_VALUE_BYTES`]).

use crate::error::{EngineError, Result};
use crate::format::items::{decode_xattrs, encode_xattrs, name_hash, Timespec, Xattr};
use crate::format::node::MAX_ITEM_BYTES;
use crate::format::{ItemKind, Key};
use crate::fs::Filesystem;

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
    fn xattr_bucket(&mut self, ino: u64, hash: u64) -> Result<Vec<Xattr>> {
        self.load_inode(ino)?;
        let shard = self.shard_of(ino);
        let key = Key::new(ino, ItemKind::XattrItem, hash);
        match self.with_tree(shard, false, |tree, io| tree.get(io, &key))? {
            Some(bytes) => {
                decode_xattrs(&bytes).map_err(|why| EngineError::corrupt("xattr item", ino, why))
            }
            None => Ok(Vec::new()),
        }
    }

    fn put_xattr_bucket(&mut self, ino: u64, hash: u64, bucket: &[Xattr]) -> Result<()> {
        let shard = self.shard_of(ino);
        let key = Key::new(ino, ItemKind::XattrItem, hash);
        self.put_bucket(shard, key, encode_xattrs(bucket), "xattr value")?;
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
        self.check_writable()?;
        Self::check_xattr_name(name)?;
        if value.len() > MAX_XATTR_VALUE_BYTES {
            return Err(EngineError::TooBig(format!(
                "xattr values are limited to {MAX_XATTR_VALUE_BYTES} bytes"
            )));
        }
        let hash = name_hash(name);
        let mut bucket = self.xattr_bucket(ino, hash)?;
        match (bucket.iter().position(|x| x.name == name), flags) {
            (Some(_), XattrFlags::Create) => return Err(EngineError::Exists),
            (None, XattrFlags::Replace) => return Err(EngineError::NoData),
            (Some(at), _) => bucket[at].value = value.to_vec(),
            (None, _) => bucket.push(Xattr {
                name: name.to_vec(),
                value: value.to_vec(),
            }),
        }
        self.put_xattr_bucket(ino, hash, &bucket)
    }

    pub fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        Self::check_xattr_name(name)?;
        let bucket = self.xattr_bucket(ino, name_hash(name))?;
        bucket
            .into_iter()
            .find(|x| x.name == name)
            .map(|x| x.value)
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
            for x in
                decode_xattrs(&bytes).map_err(|why| EngineError::corrupt("xattr item", ino, why))?
            {
                names.push(x.name);
            }
        }
        Ok(names)
    }

    pub fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<()> {
        self.check_writable()?;
        Self::check_xattr_name(name)?;
        let hash = name_hash(name);
        let mut bucket = self.xattr_bucket(ino, hash)?;
        let at = bucket
            .iter()
            .position(|x| x.name == name)
            .ok_or(EngineError::NoData)?;
        bucket.remove(at);
        self.put_xattr_bucket(ino, hash, &bucket)
    }
}
