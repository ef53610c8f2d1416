//! What a filesystem holds, as the crash checker compares it: every path with its entry
//! (data, mode, link count, names, symlink target, xattrs), read from a live filesystem
//! through [`Live`]. A snapshot is taken of the live filesystem when a persistence operation
//! starts and when it is acknowledged (what it promises), and of each crash state after its
//! mount; the checker compares them path by path.
//!
//! Invariant: a snapshot reads only through the filesystem's public calls, so it sees what
//! a user would; inode numbers are kept for files because they survive a crash and identify
//! one file's names across it.

use crate::live::Live;
use engine::EngineError;
use std::collections::BTreeMap;

/// What a path held when it was persisted (or when the crash state is inspected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File {
        /// Inode numbers survive a crash, so they identify a file's names across it.
        ino: u64,
        data: Vec<u8>,
        mode: u32,
        nlink: u32,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Dir {
        names: Vec<Vec<u8>>,
        mode: u32,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    },
    Symlink {
        target: Vec<u8>,
    },
}

pub type Tree = BTreeMap<String, Entry>;

impl Entry {
    /// A one-line description for failure messages (content as length and crc32c).
    pub fn summary(&self) -> String {
        let xattr_names = |x: &[(Vec<u8>, Vec<u8>)]| -> Vec<String> {
            x.iter()
                .map(|(n, v)| format!("{}={}B", String::from_utf8_lossy(n), v.len()))
                .collect()
        };
        match self {
            Entry::File {
                data,
                mode,
                nlink,
                xattrs,
                ..
            } => format!(
                "file {} bytes crc {:#010x} mode {mode:o} nlink {nlink} xattrs {:?}",
                data.len(),
                crc32c::crc32c(data),
                xattr_names(xattrs)
            ),
            Entry::Dir {
                names,
                mode,
                xattrs,
            } => format!(
                "dir {:?} mode {mode:o} xattrs {:?}",
                names
                    .iter()
                    .map(|n| String::from_utf8_lossy(n).into_owned())
                    .collect::<Vec<_>>(),
                xattr_names(xattrs)
            ),
            Entry::Symlink { target } => format!("symlink -> {}", String::from_utf8_lossy(target)),
        }
    }
}

pub(crate) fn summarize(entry: Option<&Entry>) -> String {
    entry.map_or("absent".to_string(), Entry::summary)
}

fn entry_of<F: Live>(fs: &mut F, ino: u64) -> Result<Entry, EngineError> {
    let st = fs.stat(ino)?;
    let mut xattrs = Vec::new();
    if !st.is_symlink() {
        let mut names = fs.listxattr(ino)?;
        names.sort();
        for name in names {
            let value = fs.getxattr(ino, &name)?;
            xattrs.push((name, value));
        }
    }
    Ok(if st.is_dir() {
        let mut names: Vec<Vec<u8>> = fs.readdir(ino)?.into_iter().map(|e| e.name).collect();
        names.sort();
        Entry::Dir {
            names,
            mode: st.mode,
            xattrs,
        }
    } else if st.is_symlink() {
        Entry::Symlink {
            target: fs.readlink(ino)?,
        }
    } else {
        Entry::File {
            ino,
            data: fs.read(ino, 0, st.size as usize)?,
            mode: st.mode,
            nlink: st.nlink,
            xattrs,
        }
    })
}

/// Every path of the filesystem with its entry.
pub fn snapshot<F: Live>(fs: &mut F) -> Result<Tree, EngineError> {
    let mut tree = Tree::new();
    let mut stack = vec![(String::new(), fs.root())];
    while let Some((path, ino)) = stack.pop() {
        let entry = entry_of(fs, ino)?;
        if matches!(entry, Entry::Dir { .. }) {
            for child in fs.readdir(ino)? {
                let name = String::from_utf8_lossy(&child.name).into_owned();
                let child_path = if path.is_empty() {
                    name
                } else {
                    format!("{path}/{name}")
                };
                stack.push((child_path, child.ino));
            }
        }
        tree.insert(path, entry);
    }
    Ok(tree)
}

/// Every path naming file `ino`.
pub(crate) fn names_of(tree: &Tree, ino: u64) -> Vec<&String> {
    tree.iter()
        .filter(|(_, e)| matches!(e, Entry::File { ino: i, .. } if *i == ino))
        .map(|(p, _)| p)
        .collect()
}

pub(crate) fn data_of(entry: Option<&Entry>) -> Option<Vec<u8>> {
    match entry {
        Some(Entry::File { data, .. }) => Some(data.clone()),
        _ => None,
    }
}
