//! Path resolution for the C ABI: every call that takes a path reads it here.
//!
//! # Rules (Linux's, except that symbolic links are never followed)
//! - A path is bytes up to its NUL: any byte but `/` and NUL may be in a name, UTF-8 or not.
//!   Relative and absolute paths both start at the root; repeated slashes count as one.
//! - An empty path is ENOENT (as for open(2)); a path of 4096 bytes or more (PATH_MAX with
//!   its NUL) or a component over 255 bytes is ENAMETOOLONG, before anything is looked up.
//! - `.` is the directory it appears in and `..` that directory's parent (the root's is the
//!   root). The parent is the directory the walk came through: with no link followed, the
//!   directories walked are the real ancestors, so no lookup of `..` is needed.
//! - Every component before the last must be a directory (ENOTDIR): `file/x`, `file/.` and
//!   `file/..` are ENOTDIR, as is a symbolic link in the middle of a path.
//! - A path ending in `/` names a directory: resolving `file/` is ENOTDIR. The calls that
//!   name an entry ([`Entry`]) apply the rule their system call applies (mkdir and rmdir
//!   accept `d/`, unlink of `file/` is ENOTDIR, ...), since the entry may not exist yet.
//!
//! # Invariants
//! - A path of plain names (no `.` or `..`) is resolved by one request ([`Namespace::walk`],
//!   the reactor's walk; the calls that act on what a path names send the walk and the act
//!   as one request: [`plain`]); any other walks one lookup per component. Both give the
//!   same answer for the paths they both accept.

use crate::error::Error;
use engine::inode::ROOT_INO;
use engine::Stat;

/// PATH_MAX: the longest path, with its NUL.
pub(crate) const PATH_MAX_BYTES: usize = 4096;
/// NAME_MAX: the longest name.
pub(crate) const NAME_MAX_BYTES: usize = 255;

/// One component of a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part<'a> {
    Name(&'a [u8]),
    Dot,
    DotDot,
}

/// A path split into components.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parsed<'a> {
    pub parts: Vec<Part<'a>>,
    /// The path ends in `/` (after at least one component): it names a directory.
    pub trailing_slash: bool,
}

/// Renders a path for a message (lossily: messages are text).
pub(crate) fn show(path: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(path))
}

/// Splits `path` into components, checking its length and its names' lengths.
pub(crate) fn parse(path: &[u8]) -> Result<Parsed<'_>, Error> {
    if path.is_empty() {
        return Err(Error::new(
            libc::ENOENT,
            "empty path (the root is \"/\")".into(),
        ));
    }
    if path.len() >= PATH_MAX_BYTES {
        return Err(Error::new(
            libc::ENAMETOOLONG,
            format!(
                "path of {} bytes (at most {})",
                path.len(),
                PATH_MAX_BYTES - 1
            ),
        ));
    }
    let mut parts = Vec::new();
    for part in path.split(|&b| b == b'/').filter(|p| !p.is_empty()) {
        if part.len() > NAME_MAX_BYTES {
            return Err(Error::new(
                libc::ENAMETOOLONG,
                format!(
                    "name of {} bytes in {} (at most {NAME_MAX_BYTES})",
                    part.len(),
                    show(path)
                ),
            ));
        }
        parts.push(match part {
            b"." => Part::Dot,
            b".." => Part::DotDot,
            name => Part::Name(name),
        });
    }
    let trailing_slash = !parts.is_empty() && path.ends_with(b"/");
    Ok(Parsed {
        parts,
        trailing_slash,
    })
}

/// What a path's last component names, for the calls that add, remove or rename an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Last<'a> {
    /// The path has no component: `/`.
    Root,
    Dot,
    DotDot,
    Name(&'a [u8]),
}

/// An entry named by a path: its directory and last component.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry<'a> {
    /// The directory holding the entry (for `Root`, `Dot` and `DotDot`: the directory the walk
    /// reached, which the entry is not in).
    pub dir: u64,
    pub last: Last<'a>,
    pub trailing_slash: bool,
}

impl<'a> Entry<'a> {
    /// The name, or the error its system call gives for `/`, `.` and `..` (mkdir: EEXIST,
    /// unlink: EISDIR, rename: EBUSY, ...), which `special` picks.
    pub fn name(&self, special: impl FnOnce(Last<'a>) -> Error) -> Result<&'a [u8], Error> {
        match self.last {
            Last::Name(name) => Ok(name),
            other => Err(special(other)),
        }
    }
}

/// What resolution asks of the filesystem.
pub(crate) trait Namespace {
    /// `name` in directory `dir` (ENOENT if absent, ENOTDIR if `dir` is not a directory).
    fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Stat, Error>;
    fn stat(&mut self, ino: u64) -> Result<Stat, Error>;
    /// What a path of plain names from the root names, in one request.
    fn walk(&mut self, names: &[&[u8]]) -> Result<Stat, Error>;
}

fn not_dir(path: &[u8]) -> Error {
    Error::new(
        libc::ENOTDIR,
        format!("{}: a component is not a directory", show(path)),
    )
}

/// The names of `parts`, when every one is a plain name (no `.` or `..`): a path the
/// reactor can walk in the request that acts on it.
pub(crate) fn plain<'a>(parts: &[Part<'a>]) -> Option<Vec<&'a [u8]>> {
    parts
        .iter()
        .map(|part| match part {
            Part::Name(name) => Some(*name),
            Part::Dot | Part::DotDot => None,
        })
        .collect()
}

/// The directories and the last name of `parts` when every one is a plain name and there is
/// a last one (the root alone has none): an entry the reactor can walk to in the request
/// that acts on it.
pub(crate) fn plain_entry<'a>(parts: &[Part<'a>]) -> Option<(Vec<&'a [u8]>, &'a [u8])> {
    let mut names = plain(parts)?;
    let last = names.pop()?;
    Some((names, last))
}

/// The directory `parts` (every one a directory step) lead to from the root.
fn walk(ns: &mut impl Namespace, path: &[u8], parts: &[Part<'_>]) -> Result<u64, Error> {
    if parts.is_empty() {
        return Ok(ROOT_INO);
    }
    if let Some(names) = plain(parts) {
        let stat = ns.walk(&names)?;
        if !stat.is_dir() {
            return Err(not_dir(path));
        }
        return Ok(stat.ino);
    }
    // The directories walked through, the root first: `..` steps back to the one before.
    let mut walked = vec![ROOT_INO];
    for part in parts {
        match part {
            Part::Dot => {}
            Part::DotDot => {
                if walked.len() > 1 {
                    walked.pop();
                }
            }
            Part::Name(name) => {
                let dir = *walked.last().expect("the root stays");
                let stat = ns.lookup(dir, name)?;
                if !stat.is_dir() {
                    return Err(not_dir(path));
                }
                walked.push(stat.ino);
            }
        }
    }
    Ok(*walked.last().expect("the root stays"))
}

/// Resolves `path` to what it names; a trailing slash requires a directory.
pub(crate) fn lookup(ns: &mut impl Namespace, path: &[u8]) -> Result<Stat, Error> {
    let parsed = parse(path)?;
    let parts = &parsed.parts;
    let stat = match parts.last() {
        None => ns.stat(ROOT_INO)?,
        Some(Part::Name(name)) => match plain(parts) {
            Some(names) => ns.walk(&names)?,
            None => {
                let dir = walk(ns, path, &parts[..parts.len() - 1])?;
                ns.lookup(dir, name)?
            }
        },
        Some(Part::Dot | Part::DotDot) => {
            let dir = walk(ns, path, parts)?;
            ns.stat(dir)?
        }
    };
    if parsed.trailing_slash && !stat.is_dir() {
        return Err(Error::new(
            libc::ENOTDIR,
            format!("{} is not a directory", show(path)),
        ));
    }
    Ok(stat)
}

/// Resolves the directory of the entry `path` names, and its last component.
pub(crate) fn entry<'p>(ns: &mut impl Namespace, path: &'p [u8]) -> Result<Entry<'p>, Error> {
    let parsed = parse(path)?;
    let parts = &parsed.parts;
    let (last, before) = match parts.last() {
        None => (Last::Root, &parts[..0]),
        Some(Part::Name(name)) => (Last::Name(name), &parts[..parts.len() - 1]),
        Some(Part::Dot) => (Last::Dot, &parts[..]),
        Some(Part::DotDot) => (Last::DotDot, &parts[..]),
    };
    Ok(Entry {
        dir: walk(ns, path, before)?,
        last,
        trailing_slash: parsed.trailing_slash,
    })
}

impl Error {
    /// The same error, its message saying which path it is about.
    pub fn about(self, path: &[u8]) -> Error {
        Error {
            message: format!("{}: {}", show(path), self.message),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn parse_splits_components_and_bounds_lengths() {
        let p = parse(b"/a//./b/../c/").unwrap();
        assert_eq!(
            p.parts,
            vec![
                Part::Name(b"a"),
                Part::Dot,
                Part::Name(b"b"),
                Part::DotDot,
                Part::Name(b"c")
            ]
        );
        assert!(p.trailing_slash);
        assert!(!parse(b"/").unwrap().trailing_slash);
        assert!(parse(b"/").unwrap().parts.is_empty());
        assert_eq!(parse(b"").unwrap_err().errno, libc::ENOENT);
        assert_eq!(parse(&[b'n'; 256]).unwrap_err().errno, libc::ENAMETOOLONG);
        assert!(parse(&[b'n'; 255]).is_ok());
        let mut long = Vec::new();
        while long.len() < PATH_MAX_BYTES - 1 {
            long.extend_from_slice(b"d/");
        }
        long.truncate(PATH_MAX_BYTES - 1);
        assert!(parse(&long).is_ok());
        long.push(b'x');
        assert_eq!(parse(&long).unwrap_err().errno, libc::ENAMETOOLONG);
        assert_eq!(
            parse(b"a/\xff\xfe").unwrap().parts[1],
            Part::Name(b"\xff\xfe")
        );
    }

    /// A tree of names; counts the requests each way of resolving makes.
    #[derive(Default)]
    struct Model {
        names: HashMap<(u64, Vec<u8>), Stat>,
        stats: HashMap<u64, Stat>,
        lookups: usize,
        resolves: usize,
    }

    fn stat(ino: u64, is_dir: bool) -> Stat {
        let now = engine::format::items::Timespec::default();
        Stat {
            ino,
            mode: if is_dir { 0o040755 } else { 0o100644 },
            nlink: 1,
            uid: 0,
            gid: 0,
            size: 0,
            blocks_512: 0,
            rdev: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
        }
    }

    impl Model {
        fn add(&mut self, dir: u64, name: &str, ino: u64, is_dir: bool) {
            let stat = stat(ino, is_dir);
            self.names.insert((dir, name.as_bytes().to_vec()), stat);
            self.stats.insert(ino, stat);
        }
    }

    impl Model {
        fn find(&self, dir: u64, name: &[u8]) -> Result<Stat, Error> {
            if !self.stats[&dir].is_dir() {
                return Err(Error::new(libc::ENOTDIR, String::new()));
            }
            self.names
                .get(&(dir, name.to_vec()))
                .copied()
                .ok_or_else(|| Error::new(libc::ENOENT, String::new()))
        }
    }

    impl Namespace for Model {
        fn lookup(&mut self, dir: u64, name: &[u8]) -> Result<Stat, Error> {
            self.lookups += 1;
            self.find(dir, name)
        }
        fn stat(&mut self, ino: u64) -> Result<Stat, Error> {
            Ok(self.stats[&ino])
        }
        fn walk(&mut self, names: &[&[u8]]) -> Result<Stat, Error> {
            self.resolves += 1;
            let mut stat = self.stats[&ROOT_INO];
            for name in names {
                stat = self.find(stat.ino, name)?;
            }
            Ok(stat)
        }
    }

    fn model() -> Model {
        let mut m = Model::default();
        m.stats.insert(ROOT_INO, stat(ROOT_INO, true));
        m.add(ROOT_INO, "a", 10, true);
        m.add(10, "b", 11, true);
        m.add(11, "f", 12, false);
        m.add(ROOT_INO, "f", 13, false);
        m
    }

    #[test]
    fn dots_resolve_through_the_directories_walked() {
        let mut m = model();
        let ino = |m: &mut Model, p: &str| lookup(m, p.as_bytes()).map(|s| s.ino);
        assert_eq!(ino(&mut m, "/").unwrap(), ROOT_INO);
        assert_eq!(ino(&mut m, "..").unwrap(), ROOT_INO);
        assert_eq!(ino(&mut m, "/../../a").unwrap(), 10);
        assert_eq!(ino(&mut m, "a/./b/f").unwrap(), 12);
        assert_eq!(ino(&mut m, "a/b/../b/./f").unwrap(), 12);
        assert_eq!(ino(&mut m, "a/b/..").unwrap(), 10);
        assert_eq!(ino(&mut m, "a/b/../..").unwrap(), ROOT_INO);
        assert_eq!(ino(&mut m, "a/b/").unwrap(), 11);
        assert_eq!(ino(&mut m, "f/").unwrap_err().errno, libc::ENOTDIR);
        assert_eq!(ino(&mut m, "f/.").unwrap_err().errno, libc::ENOTDIR);
        assert_eq!(ino(&mut m, "f/..").unwrap_err().errno, libc::ENOTDIR);
        assert_eq!(ino(&mut m, "a/b/f/").unwrap_err().errno, libc::ENOTDIR);
        assert_eq!(ino(&mut m, "a/x/..").unwrap_err().errno, libc::ENOENT);
    }

    #[test]
    fn plain_paths_take_one_request() {
        let mut m = model();
        assert_eq!(lookup(&mut m, b"a/b/f").unwrap().ino, 12);
        assert_eq!((m.resolves, m.lookups), (1, 0));
        let e = entry(&mut m, b"/a/b/new").unwrap();
        assert_eq!((e.dir, e.last), (11, Last::Name(b"new")));
        assert_eq!((m.resolves, m.lookups), (2, 0));
        // At the root, no request at all.
        let e = entry(&mut m, b"new/").unwrap();
        assert_eq!(
            (e.dir, e.last, e.trailing_slash),
            (ROOT_INO, Last::Name(b"new"), true)
        );
        assert_eq!((m.resolves, m.lookups), (2, 0));
    }

    #[test]
    fn entries_name_their_last_component() {
        let mut m = model();
        let e = entry(&mut m, b"a/b/..").unwrap();
        assert_eq!((e.dir, e.last), (10, Last::DotDot));
        let e = entry(&mut m, b"/").unwrap();
        assert_eq!((e.dir, e.last), (ROOT_INO, Last::Root));
        let e = entry(&mut m, b"a/../a/b/.").unwrap();
        assert_eq!((e.dir, e.last), (11, Last::Dot));
        assert_eq!(
            entry(&mut m, b"f/x").unwrap_err().errno,
            libc::ENOTDIR,
            "a file as a directory"
        );
    }
}
