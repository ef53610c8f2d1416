//! The POSIX operations against an in-memory model: random sequences of create, mkdir,
//! symlink, link, unlink, rmdir, rename (with NOREPLACE and EXCHANGE), write, truncate,
//! fallocate, punch hole, zero range, xattrs, commits and remounts. Every result and every
//! error is compared with the model, the whole tree is compared after each remount, and the
//! checker runs throughout. Seeds print; `COREFS_SEED=N` replays.

use engine::{
    EngineError, FallocateMode, Filesystem, MkfsOptions, MountOptions, RenameFlags, XattrFlags,
};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::BlockDevice;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Node {
    File {
        data: Vec<u8>,
        nlink: u32,
    },
    Dir {
        entries: BTreeMap<Vec<u8>, u64>,
        parent: u64,
    },
    Symlink {
        target: Vec<u8>,
        nlink: u32,
    },
}

#[derive(Debug, Clone, Default)]
struct Model {
    nodes: BTreeMap<u64, Node>,
    xattrs: BTreeMap<u64, BTreeMap<Vec<u8>, Vec<u8>>>,
}

const ROOT: u64 = 256;
const NAMES: [&str; 6] = [
    "a",
    "b",
    "c",
    "dir",
    "file.txt",
    "a-much-longer-name-to-fill-leaves-quickly",
];

impl Model {
    fn dirs(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(_, n)| matches!(n, Node::Dir { .. }))
            .map(|(i, _)| *i)
            .collect()
    }
    fn entries(&self, dir: u64) -> &BTreeMap<Vec<u8>, u64> {
        match &self.nodes[&dir] {
            Node::Dir { entries, .. } => entries,
            _ => panic!("not a dir"),
        }
    }
    fn entries_mut(&mut self, dir: u64) -> &mut BTreeMap<Vec<u8>, u64> {
        match self.nodes.get_mut(&dir).unwrap() {
            Node::Dir { entries, .. } => entries,
            _ => panic!("not a dir"),
        }
    }
    fn files(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(_, n)| matches!(n, Node::File { .. }))
            .map(|(i, _)| *i)
            .collect()
    }
    fn is_dir(&self, ino: u64) -> bool {
        matches!(self.nodes[&ino], Node::Dir { .. })
    }
    fn is_ancestor(&self, ancestor: u64, mut ino: u64) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            if ino == ROOT {
                return false;
            }
            ino = match &self.nodes[&ino] {
                Node::Dir { parent, .. } => *parent,
                _ => return false,
            };
        }
    }
    /// Drops one name's link to `ino`.
    fn drop_link(&mut self, ino: u64) {
        let gone = match self.nodes.get_mut(&ino).unwrap() {
            Node::File { nlink, .. } | Node::Symlink { nlink, .. } => {
                *nlink -= 1;
                *nlink == 0
            }
            Node::Dir { .. } => true,
        };
        if gone {
            self.nodes.remove(&ino);
            self.xattrs.remove(&ino);
        }
    }
    fn add_link(&mut self, ino: u64) {
        if let Node::File { nlink, .. } | Node::Symlink { nlink, .. } =
            self.nodes.get_mut(&ino).unwrap()
        {
            *nlink += 1;
        }
    }
    fn set_parent(&mut self, ino: u64, new_parent: u64) {
        if let Node::Dir { parent, .. } = self.nodes.get_mut(&ino).unwrap() {
            *parent = new_parent;
        }
    }
}

fn errno(r: Result<impl Sized, EngineError>) -> Result<(), i32> {
    r.map(drop).map_err(|e| e.errno())
}

const ENOENT: i32 = 2;
const EEXIST: i32 = 17;
const ENOTEMPTY: i32 = 39;
const ENOTDIR: i32 = 20;
const EISDIR: i32 = 21;
const EINVAL: i32 = 22;
const ENODATA: i32 = 61;

fn step(fs: &mut Filesystem, m: &mut Model, rng: &mut Xoshiro256PlusPlus, ctx: &str) {
    let dirs = m.dirs();
    let dir = dirs[rng.random_range(0..dirs.len())];
    let name = NAMES[rng.random_range(0..NAMES.len())].as_bytes().to_vec();
    let existing = m.entries(dir).get(&name).copied();
    match rng.random_range(0..100) {
        0..=14 => {
            let got = fs.create(dir, &name, 0o644, 0, 0);
            match existing {
                Some(_) => assert_eq!(errno(got), Err(EEXIST), "{ctx}"),
                None => {
                    let st = got.unwrap_or_else(|e| panic!("{ctx}: create: {e}"));
                    m.nodes.insert(
                        st.ino,
                        Node::File {
                            data: Vec::new(),
                            nlink: 1,
                        },
                    );
                    m.entries_mut(dir).insert(name, st.ino);
                }
            }
        }
        15..=21 => {
            let got = fs.mkdir(dir, &name, 0o755, 0, 0);
            match existing {
                Some(_) => assert_eq!(errno(got), Err(EEXIST), "{ctx}"),
                None => {
                    let st = got.unwrap_or_else(|e| panic!("{ctx}: mkdir: {e}"));
                    m.nodes.insert(
                        st.ino,
                        Node::Dir {
                            entries: BTreeMap::new(),
                            parent: dir,
                        },
                    );
                    m.entries_mut(dir).insert(name, st.ino);
                }
            }
        }
        22..=24 => {
            let target: Vec<u8> = (0..rng.random_range(1..200))
                .map(|_| rng.random_range(b'a'..=b'z'))
                .collect();
            let got = fs.symlink(dir, &name, &target, 0, 0);
            match existing {
                Some(_) => assert_eq!(errno(got), Err(EEXIST), "{ctx}"),
                None => {
                    let st = got.unwrap_or_else(|e| panic!("{ctx}: symlink: {e}"));
                    m.nodes.insert(st.ino, Node::Symlink { target, nlink: 1 });
                    m.entries_mut(dir).insert(name, st.ino);
                }
            }
        }
        25..=29 => {
            let files = m.files();
            if files.is_empty() {
                return;
            }
            let file = files[rng.random_range(0..files.len())];
            let got = fs.link(file, dir, &name);
            match existing {
                Some(_) => assert_eq!(errno(got), Err(EEXIST), "{ctx}"),
                None => {
                    got.unwrap_or_else(|e| panic!("{ctx}: link: {e}"));
                    m.add_link(file);
                    m.entries_mut(dir).insert(name, file);
                }
            }
        }
        30..=36 => {
            let got = fs.unlink(dir, &name);
            match existing {
                None => assert_eq!(errno(got), Err(ENOENT), "{ctx}"),
                Some(ino) if m.is_dir(ino) => assert_eq!(errno(got), Err(EISDIR), "{ctx}"),
                Some(ino) => {
                    got.unwrap_or_else(|e| panic!("{ctx}: unlink: {e}"));
                    m.entries_mut(dir).remove(&name);
                    m.drop_link(ino);
                }
            }
        }
        37..=40 => {
            let got = fs.rmdir(dir, &name);
            match existing {
                None => assert_eq!(errno(got), Err(ENOENT), "{ctx}"),
                Some(ino) if !m.is_dir(ino) => assert_eq!(errno(got), Err(ENOTDIR), "{ctx}"),
                Some(ino) if !m.entries(ino).is_empty() => {
                    assert_eq!(errno(got), Err(ENOTEMPTY), "{ctx}")
                }
                Some(ino) => {
                    got.unwrap_or_else(|e| panic!("{ctx}: rmdir: {e}"));
                    m.entries_mut(dir).remove(&name);
                    m.drop_link(ino);
                }
            }
        }
        41..=52 => {
            let dst_dir = dirs[rng.random_range(0..dirs.len())];
            let dst_name = NAMES[rng.random_range(0..NAMES.len())].as_bytes().to_vec();
            let flags = match rng.random_range(0..6) {
                0 => RenameFlags {
                    noreplace: true,
                    exchange: false,
                },
                1 => RenameFlags {
                    noreplace: false,
                    exchange: true,
                },
                _ => RenameFlags::default(),
            };
            let got = errno(fs.rename(dir, &name, dst_dir, &dst_name, flags));
            let want = model_rename(m, dir, &name, dst_dir, &dst_name, flags);
            assert_eq!(
                got,
                want,
                "{ctx}: rename {dir}/{:?} -> {dst_dir}/{:?} {flags:?}",
                String::from_utf8_lossy(&name),
                String::from_utf8_lossy(&dst_name)
            );
        }
        53..=70 => {
            let files = m.files();
            if files.is_empty() {
                return;
            }
            let file = files[rng.random_range(0..files.len())];
            let offset = if rng.random_bool(0.5) {
                rng.random_range(0..40_000u64)
            } else {
                rng.random_range(0..10u64) * 4096
            };
            let len = if rng.random_bool(0.3) {
                4096 * rng.random_range(1..4)
            } else {
                rng.random_range(1..9000)
            };
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            assert_eq!(
                fs.write(file, offset, &bytes)
                    .unwrap_or_else(|e| panic!("{ctx}: write: {e}")),
                len
            );
            if let Node::File { data, .. } = m.nodes.get_mut(&file).unwrap() {
                let end = offset as usize + len;
                if data.len() < end {
                    data.resize(end, 0);
                }
                data[offset as usize..end].copy_from_slice(&bytes);
            }
        }
        71..=76 => {
            let files = m.files();
            if files.is_empty() {
                return;
            }
            let file = files[rng.random_range(0..files.len())];
            let Node::File { data, .. } = &m.nodes[&file] else {
                unreachable!()
            };
            let offset = rng.random_range(0..data.len() as u64 + 100);
            let len = rng.random_range(0..20_000);
            let got = fs
                .read(file, offset, len)
                .unwrap_or_else(|e| panic!("{ctx}: read: {e}"));
            let start = (offset as usize).min(data.len());
            let end = (start + len).min(data.len());
            assert!(
                got == data[start..end],
                "{ctx}: read {file} at {offset}+{len} differs"
            );
        }
        77..=80 => {
            let files = m.files();
            if files.is_empty() {
                return;
            }
            let file = files[rng.random_range(0..files.len())];
            let size = rng.random_range(0..50_000u64);
            fs.truncate(file, size)
                .unwrap_or_else(|e| panic!("{ctx}: truncate: {e}"));
            if let Node::File { data, .. } = m.nodes.get_mut(&file).unwrap() {
                data.resize(size as usize, 0);
            }
        }
        81..=85 => {
            let files = m.files();
            if files.is_empty() {
                return;
            }
            let file = files[rng.random_range(0..files.len())];
            let offset = rng.random_range(0..40_000u64);
            let len = rng.random_range(1..20_000u64);
            let mode = match rng.random_range(0..4) {
                0 => FallocateMode {
                    keep_size: true,
                    ..Default::default()
                },
                1 => FallocateMode::default(),
                2 => FallocateMode {
                    keep_size: true,
                    punch_hole: true,
                    ..Default::default()
                },
                _ => FallocateMode {
                    zero_range: true,
                    keep_size: rng.random_bool(0.5),
                    ..Default::default()
                },
            };
            fs.fallocate(file, mode, offset, len)
                .unwrap_or_else(|e| panic!("{ctx}: fallocate {mode:?}: {e}"));
            if let Node::File { data, .. } = m.nodes.get_mut(&file).unwrap() {
                let end = (offset + len) as usize;
                if mode.punch_hole || mode.zero_range {
                    let zero_end = end.min(data.len());
                    if (offset as usize) < zero_end {
                        data[offset as usize..zero_end].fill(0);
                    }
                }
                if !mode.keep_size && data.len() < end {
                    data.resize(end, 0);
                }
            }
        }
        86..=91 => {
            let inos: Vec<u64> = m.nodes.keys().copied().collect();
            let ino = inos[rng.random_range(0..inos.len())];
            let xname = format!("user.{}", NAMES[rng.random_range(0..3)]).into_bytes();
            let attrs = m.xattrs.entry(ino).or_default();
            match rng.random_range(0..4) {
                0 => {
                    let got = errno(fs.removexattr(ino, &xname));
                    let want = if attrs.remove(&xname).is_some() {
                        Ok(())
                    } else {
                        Err(ENODATA)
                    };
                    assert_eq!(got, want, "{ctx}: removexattr");
                }
                1 => {
                    let want = attrs.get(&xname).cloned().ok_or(ENODATA);
                    assert_eq!(
                        fs.getxattr(ino, &xname).map_err(|e| e.errno()),
                        want,
                        "{ctx}: getxattr"
                    );
                }
                _ => {
                    let value: Vec<u8> = (0..rng.random_range(0..300))
                        .map(|_| rng.random())
                        .collect();
                    let flags = if rng.random_bool(0.2) {
                        XattrFlags::Create
                    } else {
                        XattrFlags::Any
                    };
                    let got = errno(fs.setxattr(ino, &xname, &value, flags));
                    if flags == XattrFlags::Create && attrs.contains_key(&xname) {
                        assert_eq!(got, Err(EEXIST), "{ctx}: setxattr create");
                    } else {
                        assert_eq!(got, Ok(()), "{ctx}: setxattr");
                        attrs.insert(xname, value);
                    }
                }
            }
        }
        92..=97 => {
            fs.commit().unwrap_or_else(|e| panic!("{ctx}: commit: {e}"));
        }
        _ => {
            let got = fs
                .readdir(dir, 0, 1000)
                .unwrap_or_else(|e| panic!("{ctx}: readdir: {e}"));
            let names: BTreeMap<Vec<u8>, u64> = got.into_iter().map(|e| (e.name, e.ino)).collect();
            assert_eq!(&names, m.entries(dir), "{ctx}: readdir {dir}");
        }
    }
}

fn model_rename(
    m: &mut Model,
    sd: u64,
    sn: &[u8],
    dd: u64,
    dn: &[u8],
    flags: RenameFlags,
) -> Result<(), i32> {
    if flags.noreplace && flags.exchange {
        return Err(EINVAL);
    }
    let src = *m.entries(sd).get(sn).ok_or(ENOENT)?;
    let dst = m.entries(dd).get(dn).copied();
    if sd == dd && sn == dn {
        return if flags.noreplace { Err(EEXIST) } else { Ok(()) };
    }
    // Linux's order (do_renameat2): the target's presence, then loops, then types.
    if flags.exchange && dst.is_none() {
        return Err(ENOENT);
    }
    if flags.noreplace && dst.is_some() {
        return Err(EEXIST);
    }
    if m.is_dir(src) && m.is_ancestor(src, dd) {
        return Err(EINVAL);
    }
    if let Some(dst) = dst {
        // A target directory above the source holds it: not empty.
        if !flags.exchange && dst != src && m.is_dir(dst) && m.is_ancestor(dst, sd) {
            return Err(ENOTEMPTY);
        }
    }
    if flags.exchange {
        let dst = dst.ok_or(ENOENT)?;
        if m.is_dir(dst) && m.is_ancestor(dst, sd) {
            return Err(EINVAL);
        }
        m.entries_mut(sd).insert(sn.to_vec(), dst);
        m.entries_mut(dd).insert(dn.to_vec(), src);
        m.set_parent(src, dd);
        m.set_parent(dst, sd);
        return Ok(());
    }
    if let Some(dst) = dst {
        if flags.noreplace {
            return Err(EEXIST);
        }
        if dst == src {
            return Ok(());
        }
        match (m.is_dir(src), m.is_dir(dst)) {
            (true, false) => return Err(ENOTDIR),
            (false, true) => return Err(EISDIR),
            (true, true) if !m.entries(dst).is_empty() => return Err(ENOTEMPTY),
            _ => {}
        }
        m.entries_mut(dd).remove(dn);
        m.drop_link(dst);
    }
    m.entries_mut(sd).remove(sn);
    m.entries_mut(dd).insert(dn.to_vec(), src);
    m.set_parent(src, dd);
    Ok(())
}

fn compare_all(fs: &mut Filesystem, m: &Model, ctx: &str) {
    for (&ino, node) in &m.nodes {
        let st = fs
            .stat(ino)
            .unwrap_or_else(|e| panic!("{ctx}: stat {ino}: {e}"));
        match node {
            Node::File { data, nlink } => {
                assert_eq!(
                    (st.size, st.nlink),
                    (data.len() as u64, *nlink),
                    "{ctx}: file {ino}"
                );
                assert!(
                    fs.read(ino, 0, data.len() + 10).unwrap() == *data,
                    "{ctx}: content of {ino}"
                );
            }
            Node::Symlink { target, nlink } => {
                assert_eq!(st.nlink, *nlink);
                assert_eq!(&fs.readlink(ino).unwrap(), target, "{ctx}: symlink {ino}");
            }
            Node::Dir { entries, .. } => {
                let got: BTreeMap<Vec<u8>, u64> = fs
                    .readdir(ino, 0, 100_000)
                    .unwrap()
                    .into_iter()
                    .map(|e| (e.name, e.ino))
                    .collect();
                assert_eq!(&got, entries, "{ctx}: directory {ino}");
                let subdirs = entries.values().filter(|c| m.is_dir(**c)).count() as u32;
                assert_eq!(st.nlink, 2 + subdirs, "{ctx}: nlink of directory {ino}");
            }
        }
        let mut names = fs.listxattr(ino).unwrap();
        names.sort();
        let want: Vec<Vec<u8>> = m
            .xattrs
            .get(&ino)
            .map(|x| x.keys().cloned().collect())
            .unwrap_or_default();
        assert_eq!(names, want, "{ctx}: xattrs of {ino}");
    }
    let report = fs.check().unwrap_or_else(|e| panic!("{ctx}: check: {e}"));
    assert_eq!(report.inodes, m.nodes.len() as u64, "{ctx}: inode count");
}

fn seed() -> u64 {
    nvme::wrap::seed_from_env()
}

/// A new filesystem on a memory device, mounted.
fn fresh(bytes: u64, shards: u32) -> Filesystem {
    let dev = Box::new(MemDevice::new(config(bytes)).unwrap());
    let dev = Filesystem::mkfs(
        dev,
        &MkfsOptions {
            shards,
            label: String::new(),
            ..Default::default()
        },
    )
    .unwrap();
    Filesystem::mount(dev, MountOptions::default()).unwrap()
}

fn config(bytes: u64) -> MemConfig {
    MemConfig {
        capacity_bytes: bytes,
        lba_size_bytes: 4096,
        queue_depth: 64,
        buf_bytes: 1 << 20,
        buf_count: 32,
    }
}

/// Runs the model check on `dev` for `rounds` remounts of `steps` operations each, with a
/// name hash of `hash_bits` bits (few bits: most names share a chain of items).
fn model_check(dev: Box<dyn BlockDevice>, rounds: u32, steps: u32, hash_bits: u8) {
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut dev = Filesystem::mkfs_with_name_hash_bits(
        dev,
        &MkfsOptions {
            shards: 4,
            label: String::new(),
            ..Default::default()
        },
        hash_bits,
    )
    .unwrap();
    let mut m = Model::default();
    m.nodes.insert(
        ROOT,
        Node::Dir {
            entries: BTreeMap::new(),
            parent: ROOT,
        },
    );
    for round in 0..rounds {
        let options = MountOptions {
            cache_nodes: 16,
            ..Default::default()
        };
        let mut fs = Filesystem::mount(dev, options).unwrap();
        compare_all(&mut fs, &m, &format!("seed {seed} round {round} mounted"));
        for i in 0..steps {
            step(
                &mut fs,
                &mut m,
                &mut rng,
                &format!("seed {seed} round {round} step {i}"),
            );
        }
        compare_all(
            &mut fs,
            &m,
            &format!("seed {seed} round {round} before unmount"),
        );
        assert_eq!(
            fs.reservation_overrun_blocks(),
            0,
            "seed {seed} round {round}: an operation allocated past its reservation"
        );
        // The model's answers came through the decoded inodes and name chains too (coherent
        // with the trees through every change above, or the comparisons would have failed).
        let decoded = fs.decoded_stats();
        assert!(
            decoded.inode_hits > 0 && decoded.chain_hits > 0,
            "seed {seed} round {round}: lookups never used the decoded cache: {decoded:?}"
        );
        dev = fs.unmount().unwrap();
    }
}

#[test]
fn random_operations_match_the_model_across_remounts() {
    model_check(
        Box::new(MemDevice::new(config(64 << 20)).unwrap()),
        6,
        2000,
        32,
    );
}

/// The same with a 1-bit name hash: every name of a directory, and every xattr of an inode,
/// shares one of two chains of items, which grow, shrink and leave gaps.
#[test]
fn random_operations_match_the_model_when_every_name_collides() {
    model_check(
        Box::new(MemDevice::new(config(64 << 20)).unwrap()),
        4,
        2000,
        1,
    );
}

#[test]
fn random_operations_match_the_model_on_the_file_backend() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = format!(
        "file:{},size=64MiB,hugepages=off",
        dir.path().join("fs.img").display()
    );
    model_check(
        nvme::open_device(&spec, &Default::default()).unwrap(),
        3,
        1000,
        32,
    );
}

#[test]
fn errors_for_bad_names_and_types() {
    let mut fs = fresh(16 << 20, 2);
    let root = fs.root();
    assert_eq!(
        errno(fs.create(root, &[b'x'; 256], 0o644, 0, 0)),
        Err(36),
        "ENAMETOOLONG"
    );
    assert!(fs.create(root, &[b'x'; 255], 0o644, 0, 0).is_ok());
    for bad in [&b""[..], b".", b"..", b"a/b"] {
        assert_eq!(
            errno(fs.create(root, bad, 0o644, 0, 0)),
            Err(EINVAL),
            "{bad:?}"
        );
    }
    let file = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    assert_eq!(errno(fs.create(file, b"g", 0o644, 0, 0)), Err(ENOTDIR));
    assert_eq!(errno(fs.readdir(file, 0, 10)), Err(ENOTDIR));
    let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    assert_eq!(errno(fs.write(dir, 0, b"x")), Err(EISDIR));
    assert_eq!(
        errno(fs.link(dir, root, b"d2")),
        Err(libc::EPERM),
        "no hard links to directories (link(2): EPERM)"
    );
    let link = fs.symlink(root, b"l", b"f", 0, 0).unwrap().ino;
    let keep = FallocateMode {
        keep_size: true,
        ..Default::default()
    };
    assert_eq!(
        errno(fs.fallocate(link, keep, 0, 4096)),
        Err(EINVAL),
        "fallocate of a symlink"
    );
    assert_eq!(
        errno(fs.fallocate(dir, keep, 0, 4096)),
        Err(EISDIR),
        "fallocate of a directory"
    );
    assert_eq!(errno(fs.truncate(link, 0)), Err(EINVAL));
    // fallocate(2)'s errors: a zero length, a range past the largest file, a hole punch
    // that would change the size.
    assert_eq!(errno(fs.fallocate(file, keep, 0, 0)), Err(EINVAL), "len 0");
    for (offset, len) in [(engine::file::MAX_FILE_BYTES, 1), (1, u64::MAX)] {
        assert_eq!(
            errno(fs.fallocate(file, keep, offset, len)),
            Err(libc::EFBIG),
            "fallocate at {offset} + {len}"
        );
    }
    let punch = FallocateMode {
        punch_hole: true,
        ..Default::default()
    };
    assert_eq!(
        errno(fs.fallocate(file, punch, 0, 4096)),
        Err(libc::EOPNOTSUPP),
        "a punch without KEEP_SIZE"
    );
    // A namespace's prefix alone names no attribute (EINVAL, as Linux's filesystems).
    for prefix in [&b"user."[..], b"trusted.", b"security.", b"system."] {
        assert_eq!(
            errno(fs.setxattr(file, prefix, b"1", XattrFlags::Any)),
            Err(EINVAL),
            "setxattr {prefix:?}"
        );
        assert_eq!(errno(fs.getxattr(file, prefix)), Err(EINVAL));
        assert_eq!(errno(fs.removexattr(file, prefix)), Err(EINVAL));
    }
    assert!(fs.listxattr(file).unwrap().is_empty(), "nothing was stored");
    assert_eq!(errno(fs.lookup(root, b"missing")), Err(ENOENT));
    assert_eq!(
        errno(fs.rename(root, b"d", dir, b"inside", RenameFlags::default())),
        Err(EINVAL)
    );
    assert_eq!(errno(fs.getxattr(file, b"user.none")), Err(ENODATA));
    assert_eq!(
        errno(fs.setxattr(file, b"user.a", b"1", XattrFlags::Replace)),
        Err(ENODATA)
    );
    // Readdir cookies resume after the last entry returned, also across removals.
    for i in 0..50 {
        fs.create(dir, format!("n{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    let first = fs.readdir(dir, 0, 20).unwrap();
    fs.unlink(dir, b"n25").unwrap();
    let rest = fs.readdir(dir, first.last().unwrap().cookie, 100).unwrap();
    assert_eq!(first.len() + rest.len(), 49);
    assert_eq!(rest[0].name, b"n20");
    fs.check().unwrap();
}

#[test]
fn truncate_down_then_up_reads_zeroes_and_holes_read_zeroes() {
    let mut fs = fresh(16 << 20, 1);
    let f = fs.create(fs.root(), b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &[7u8; 10_000]).unwrap();
    fs.truncate(f, 5000).unwrap();
    fs.truncate(f, 20_000).unwrap();
    let data = fs.read(f, 0, 20_000).unwrap();
    assert!(data[..5000].iter().all(|&b| b == 7));
    assert!(
        data[5000..].iter().all(|&b| b == 0),
        "the gap after truncate down/up must read zeroes"
    );
    fs.write(f, 1 << 20, b"end").unwrap();
    assert!(
        fs.read(f, 20_000, 100_000).unwrap().iter().all(|&b| b == 0),
        "a hole reads zeroes"
    );
    assert_eq!(fs.stat(f).unwrap().size, (1 << 20) + 3);
    fs.fallocate(
        f,
        FallocateMode {
            keep_size: true,
            ..Default::default()
        },
        2 << 20,
        1 << 20,
    )
    .unwrap();
    let st = fs.stat(f).unwrap();
    assert_eq!(st.size, (1 << 20) + 3, "KEEP_SIZE keeps the size");
    assert!(
        st.blocks_512 >= 2048 * 8 / 8 * 8 / 8,
        "preallocated blocks are counted"
    );
    fs.commit().unwrap();
    fs.check().unwrap();
}

#[test]
fn data_corruption_is_detected_on_read() {
    let mut fs = fresh(16 << 20, 1);
    let f = fs.create(fs.root(), b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &[0x5a; 8192]).unwrap();
    fs.commit().unwrap();
    let mut dev = fs.unmount().unwrap();
    let mut image = vec![0u8; 16 << 20];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    // Find the data block (0x5a-filled) and flip one bit in it.
    let block = image
        .chunks(4096)
        .position(|b| b.iter().all(|&x| x == 0x5a))
        .unwrap();
    image[block * 4096 + 100] ^= 1;
    let mut fs = Filesystem::mount(
        Box::new(MemDevice::from_image(&image, config(16 << 20)).unwrap()),
        MountOptions::default(),
    )
    .unwrap();
    let err = fs.read(f, 0, 8192).unwrap_err();
    assert!(
        matches!(&err, EngineError::Corrupt { what: "data block", block: b, .. } if *b as usize == block),
        "{err}"
    );
    assert!(err.to_string().contains("checksum"), "{err}");
}

#[test]
fn enospc_during_creates_and_writes_leaves_a_consistent_filesystem() {
    let mut fs = fresh(2 << 20, 2);
    let root = fs.root();
    let mut created = 0u32;
    let err = loop {
        match fs.create(root, format!("file-{created:05}").as_bytes(), 0o644, 0, 0) {
            Ok(st) => {
                created += 1;
                if let Err(e) = fs.write(st.ino, 0, &[1u8; 6000]) {
                    break e;
                }
            }
            Err(e) => break e,
        }
    };
    assert_eq!(err.errno(), 28, "{err}");
    fs.check()
        .unwrap_or_else(|e| panic!("after ENOSPC at {created} files: {e}"));
    fs.commit().unwrap();
    // Deleting frees space; creating works again.
    for i in 0..created / 2 {
        fs.unlink(root, format!("file-{i:05}").as_bytes())
            .unwrap_or_else(|e| {
                panic!(
                    "unlink {i} of {created}: {e} {:?} {:?}",
                    fs.space_report(),
                    fs.space_pool().stats()
                )
            });
    }
    fs.commit().unwrap();
    let st = fs.create(root, b"after", 0o644, 0, 0).unwrap();
    fs.write(st.ino, 0, &[2u8; 6000]).unwrap();
    fs.commit().unwrap();
    fs.check().unwrap();
}

#[test]
fn read_many_returns_what_read_returns_and_fails_a_corrupt_request_alone() {
    let mut fs = fresh(32 << 20, 2);
    let root = fs.root();
    let mut files = Vec::new();
    for i in 0..6u8 {
        let ino = fs
            .create(root, format!("f{i}").as_bytes(), 0o644, 0, 0)
            .unwrap()
            .ino;
        // Several extents, a hole in the middle, and a tail that is not block-aligned.
        let data: Vec<u8> = (0..40_000u32).map(|b| (b as u8) ^ i).collect();
        fs.write(ino, 0, &data[..20_000]).unwrap();
        fs.write(ino, 30_000, &data[30_000..]).unwrap();
        files.push(ino);
    }
    fs.commit().unwrap();
    let mut dev = fs.unmount().unwrap();
    let mut image = vec![0u8; 32 << 20];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    let remount = |image: &[u8]| {
        Filesystem::mount(
            Box::new(MemDevice::from_image(image, config(32 << 20)).unwrap()),
            MountOptions::default(),
        )
        .unwrap()
    };
    // Requests across files and offsets, beyond the end, of length 0, of a directory.
    let mut requests = Vec::new();
    for (i, &ino) in files.iter().enumerate() {
        requests.push((ino, (i as u64) * 3_001, 9_000 + i * 1_000));
        requests.push((ino, 19_000, 12_000)); // data, hole, data
    }
    requests.push((files[0], 50_000, 4096)); // past the end: empty
    requests.push((files[1], 0, 0));
    requests.push((root, 0, 4096)); // a directory: EISDIR
    requests.push((999_999, 0, 4096)); // no such inode
                                       // Cold cache: every data block comes from the device through read_many.
    let mut fs = remount(&image);
    let many = fs.read_many(&requests);
    let mut fs_one = remount(&image);
    assert_eq!(many.len(), requests.len());
    for (r, got) in requests.iter().zip(&many) {
        let want = fs_one.read(r.0, r.1, r.2);
        match (got, &want) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{r:?}"),
            (Err(a), Err(b)) => assert_eq!(a.errno(), b.errno(), "{r:?}: {a} vs {b}"),
            _ => panic!("{r:?}: read_many {got:?} but read {want:?}"),
        }
    }
    assert!(many[many.len() - 2].is_err() && many[many.len() - 1].is_err());
    // A flipped bit in one file's first block fails that file's requests alone.
    let mut fs = remount(&image);
    let first_block: Vec<u8> = (0..4096u32).map(|b| (b as u8) ^ 3).collect();
    let at = image
        .chunks(4096)
        .position(|b| b == first_block.as_slice())
        .expect("file 3's first block");
    let mut bad = image.clone();
    bad[at * 4096 + 7] ^= 0x10;
    drop(fs);
    fs = remount(&bad);
    let results = fs.read_many(&requests[..12]);
    for (i, result) in results.iter().enumerate() {
        let (ino, offset, _) = requests[i];
        if ino == files[3] && offset < 4096 {
            let err = result.as_ref().unwrap_err();
            assert!(
                matches!(err, EngineError::Corrupt { what: "data block", block, .. } if *block as usize == at),
                "{err}"
            );
        } else {
            assert!(result.is_ok(), "request {i} {:?}: {result:?}", requests[i]);
        }
    }
}

/// Positions and lengths from outside are bounded as Linux bounds read(2) and write(2):
/// `offset + len` past the largest signed 64-bit position is EINVAL (a huge length used to
/// overflow the read path's `offset + len` and panic), and one call moves at most
/// MAX_RW_BYTES, shortening a longer request instead of sizing a buffer by it.
#[test]
fn reads_and_writes_of_any_position_and_length_are_bounded_as_linux_bounds_them() {
    use engine::file::{rw_len, MAX_RW_BYTES};
    let mut fs = fresh(16 << 20, 1);
    let f = fs.create(fs.root(), b"f", 0o644, 0, 0).unwrap().ino;
    let data: Vec<u8> = (0..10_000u32).map(|b| b as u8).collect();
    fs.write(f, 0, &data).unwrap();
    let einval = |r: Result<Vec<u8>, EngineError>| r.map(drop).map_err(|e| e.errno());
    let end = i64::MAX as u64;
    assert_eq!(einval(fs.read(f, 1, usize::MAX)), Err(libc::EINVAL));
    assert_eq!(einval(fs.read(f, 0, usize::MAX)), Err(libc::EINVAL));
    assert_eq!(einval(fs.read(f, end, 1)), Err(libc::EINVAL));
    assert_eq!(einval(fs.read(f, u64::MAX, 0)), Err(libc::EINVAL));
    assert_eq!(
        fs.read(f, end, 0).unwrap(),
        b"",
        "the last position, nothing asked"
    );
    assert_eq!(
        fs.read(f, end - 5, 5).unwrap(),
        b"",
        "past the end of the file"
    );
    assert_eq!(fs.read(f, 9_990, 1 << 40).unwrap(), &data[9_990..]);
    // One bad request of a batch fails alone.
    let many = fs.read_many(&[(f, 1, usize::MAX), (f, 100, 10)]);
    assert_eq!(
        many[0].as_ref().map_err(|e| e.errno()).err(),
        Some(libc::EINVAL)
    );
    assert_eq!(many[1].as_ref().unwrap(), &data[100..110]);
    // Writes: a position past i64::MAX is EINVAL; past the largest file, EFBIG.
    for offset in [end, u64::MAX - 1, end + 1] {
        let e = fs.write(f, offset, b"xy").unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "write at {offset}: {e}");
    }
    let e = fs
        .write(f, engine::file::MAX_FILE_BYTES, b"xy")
        .unwrap_err();
    assert!(matches!(e, EngineError::TooBig(_)), "{e}");
    // A read longer than MAX_RW_BYTES returns MAX_RW_BYTES of a larger (sparse) file.
    fs.truncate(f, 3 << 30).unwrap();
    let long = fs.read(f, 0, 4 << 30).unwrap();
    assert_eq!(long.len(), MAX_RW_BYTES);
    assert_eq!(&long[..10_000], &data[..]);
    assert_eq!(long[MAX_RW_BYTES - 1], 0);
    drop(long);
    assert_eq!(rw_len(0, MAX_RW_BYTES + 1), Ok(MAX_RW_BYTES));
    assert_eq!(rw_len(end - 10, 10), Ok(10));
    assert!(rw_len(end - 10, 11).is_err());
    fs.commit().unwrap();
    fs.check().unwrap();
}

#[test]
fn index_items_of_a_large_directory_go_in_bounded_batches_and_list_in_order() {
    let mut fs = fresh(64 << 20, 1);
    let root = fs.root();
    let dir = fs.mkdir(root, b"big", 0o755, 0, 0).unwrap().ino;
    let count = engine::delayed::DIR_BATCH_MAX * 2 + 100;
    for i in 0..count {
        fs.create(dir, format!("n{i:06}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    // Two full batches went into the tree before any commit; the rest waits.
    let stats = fs.delayed_stats();
    assert_eq!(stats.batches, 2, "{stats:?}");
    assert_eq!(stats.max_batch, engine::delayed::DIR_BATCH_MAX as u64);
    let list = |fs: &mut Filesystem| {
        let mut names = Vec::new();
        let mut cookie = 0;
        loop {
            let entries = fs.readdir(dir, cookie, 1000).unwrap();
            let Some(last) = entries.last() else { break };
            cookie = last.cookie;
            names.extend(entries.into_iter().map(|e| e.name));
        }
        names
    };
    let want: Vec<Vec<u8>> = (0..count)
        .map(|i| format!("n{i:06}").into_bytes())
        .collect();
    assert_eq!(
        list(&mut fs),
        want,
        "creation order, tree and pending merged"
    );
    fs.check().unwrap();
    fs.commit().unwrap();
    assert_eq!(list(&mut fs), want);
    let dev = fs.unmount().unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    assert_eq!(list(&mut fs), want);
    fs.check().unwrap();
}

/// Silent device faults — bit rot on reads, lost writes, misdirected writes — under a seeded
/// workload: every read returns the data written or an error naming the damage; never wrong
/// data. Mount may refuse a damaged image (with the block named); the checker then names it.
#[test]
fn silent_faults_are_detected_never_returned_as_data() {
    use nvme::wrap::{FaultConfig, FaultDevice};
    let seed = seed();
    eprintln!("seed {seed}");
    let mut detected = 0u32;
    let mut clean = 0u32;
    for round in 0..16u64 {
        let s = seed.wrapping_add(round);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(s);
        let base = {
            let fs = fresh(16 << 20, 2);
            let mut dev = fs.unmount().unwrap();
            let mut image = vec![0u8; 16 << 20];
            nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
            image
        };
        let (misdirected, lost, rot) = match round % 3 {
            0 => (0.05, 0.0, 0.0),
            1 => (0.0, 0.05, 0.0),
            _ => (0.0, 0.0, 0.03),
        };
        let faulty = FaultDevice::new(
            MemDevice::from_image(&base, config(16 << 20)).unwrap(),
            FaultConfig {
                seed: s,
                misdirected_write: misdirected,
                lost_write: lost,
                ..Default::default()
            },
        );
        // Writes go through the faulty device; the model holds what was written.
        let mut model: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut fs = Filesystem::mount(Box::new(faulty), MountOptions::default()).unwrap();
        let root = fs.root();
        for f in 0..24 {
            let name = format!("f{f}").into_bytes();
            let Ok(st) = fs.create(root, &name, 0o644, 0, 0) else {
                break;
            };
            let len = rng.random_range(1..40_000usize);
            let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if fs.write(st.ino, 0, &data).is_err() {
                break;
            }
            model.push((name, data));
            if f % 6 == 5 && fs.commit().is_err() {
                break;
            }
        }
        let _ = fs.commit();
        let mut dev = fs.into_device();
        let mut image = vec![0u8; 16 << 20];
        nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
        // Reads through a device that may rot what it returns.
        let reader = FaultDevice::new(
            MemDevice::from_image(&image, config(16 << 20)).unwrap(),
            FaultConfig {
                seed: s ^ 0xdead,
                read_bitrot: rot,
                ..Default::default()
            },
        );
        let mut fs = match Filesystem::mount(Box::new(reader), MountOptions::default()) {
            Ok(fs) => fs,
            Err(e) => {
                assert!(
                    matches!(e, EngineError::Corrupt { .. }),
                    "seed {s}: mount failed without naming corruption: {e}"
                );
                detected += 1;
                continue;
            }
        };
        let mut saw_error = false;
        for (name, data) in &model {
            let st = match fs.lookup(root, name) {
                Ok(st) => st,
                Err(EngineError::NotFound) => continue, // its commit may not have landed
                Err(e) => {
                    assert!(
                        matches!(e, EngineError::Corrupt { .. } | EngineError::Device(_)),
                        "seed {s}: {e}"
                    );
                    saw_error = true;
                    continue;
                }
            };
            match fs.read(st.ino, 0, data.len()) {
                Ok(got) => assert!(
                    got == *data || got.len() < data.len() && data.starts_with(&got),
                    "seed {s}: {} returned wrong data",
                    String::from_utf8_lossy(name)
                ),
                Err(e) => {
                    assert!(
                        matches!(e, EngineError::Corrupt { .. } | EngineError::Device(_)),
                        "seed {s}: {e}"
                    );
                    let text = e.to_string();
                    assert!(text.contains("block") || text.contains("inode"), "{text}");
                    saw_error = true;
                }
            }
        }
        if saw_error || fs.check().is_err() {
            detected += 1;
        } else {
            clean += 1;
        }
    }
    eprintln!("{detected} rounds with damage detected, {clean} rounds undamaged where read");
    assert!(
        detected > 0,
        "seed {seed}: no fault was ever detected (is injection working?)"
    );
}

/// Names that share a hash never refuse a create: with a 2-bit name hash every long name of a
/// directory falls into one of four chains (a chain per hash, not one item, so no EFBIG as
/// one full item gave before), and xattrs likewise. Every name is found, listed, removed and
/// survives a remount; the checker passes.
#[test]
fn a_directory_holds_any_set_of_names_however_many_share_a_hash() {
    let dev = Box::new(MemDevice::new(config(64 << 20)).unwrap());
    let dev = Filesystem::mkfs_with_name_hash_bits(
        dev,
        &MkfsOptions {
            shards: 2,
            label: String::new(),
            ..Default::default()
        },
        2,
    )
    .unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    let name = |i: u32| format!("{i:06}-{}", "n".repeat(240)).into_bytes();
    // 1,500 names of 247 bytes: 375 per chain, about 54 items each.
    for i in 0..1500 {
        fs.create(dir, &name(i), 0o644, 0, 0)
            .unwrap_or_else(|e| panic!("create {i}: {e}"));
    }
    fs.create(dir, b"victim.lock", 0o644, 0, 0).unwrap();
    let file = fs.lookup(dir, b"victim.lock").unwrap().ino;
    for i in 0..40u32 {
        let value = vec![i as u8; 700];
        fs.setxattr(
            file,
            format!("user.{i:03}").as_bytes(),
            &value,
            XattrFlags::Create,
        )
        .unwrap_or_else(|e| panic!("setxattr {i}: {e}"));
    }
    fs.check().unwrap();
    fs.commit().unwrap();
    // Every other name goes, emptying links in the middle of the chains.
    for i in (0..1500).step_by(2) {
        fs.unlink(dir, &name(i)).unwrap();
    }
    for i in (0..40u32).step_by(3) {
        fs.removexattr(file, format!("user.{i:03}").as_bytes())
            .unwrap();
    }
    let mut fs = Filesystem::mount(fs.unmount().unwrap(), MountOptions::default()).unwrap();
    fs.check().unwrap();
    for i in 0..1500 {
        assert_eq!(fs.lookup(dir, &name(i)).is_ok(), i % 2 == 1, "name {i}");
    }
    let mut listed = 0;
    let mut cookie = 0;
    loop {
        let entries = fs.readdir(dir, cookie, 100).unwrap();
        let Some(last) = entries.last() else { break };
        cookie = last.cookie;
        listed += entries.len();
    }
    assert_eq!(listed, 751);
    for i in 0..40u32 {
        let got = fs.getxattr(file, format!("user.{i:03}").as_bytes());
        if i % 3 == 0 {
            assert_eq!(got, Err(EngineError::NoData));
        } else {
            assert_eq!(got.unwrap(), vec![i as u8; 700]);
        }
    }
    assert_eq!(fs.listxattr(file).unwrap().len(), 26);
    // Names of one file in one directory past its back-reference item's room (nine of
    // these) go to extended back-references.
    for links in 0..300u32 {
        fs.link(
            file,
            dir,
            format!("link-{links:04}-{}", "l".repeat(200)).as_bytes(),
        )
        .unwrap_or_else(|e| panic!("link {links}: {e}"));
    }
    assert_eq!(fs.stat(file).unwrap().nlink, 301);
    fs.check().unwrap();
}

/// fallocate's times, as ext4 keeps them: a punch or a zeroed range changes the data, and a
/// preallocation that grows the file its size, so both move mtime; a preallocation inside
/// the size or with KEEP_SIZE changes ctime alone.
#[test]
fn fallocate_moves_mtime_when_data_or_size_change_and_ctime_always() {
    use engine::format::items::Timespec;
    let mut fs = fresh(16 << 20, 1);
    let root = fs.root();
    let file = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(file, 0, &[7u8; 8192]).unwrap();
    let old = Timespec { sec: 1000, nsec: 5 };
    let cases = [
        (
            "keep-size preallocation",
            FallocateMode {
                keep_size: true,
                ..Default::default()
            },
            8192,
            4096,
            false,
        ),
        (
            "preallocation inside the size",
            FallocateMode::default(),
            0,
            4096,
            false,
        ),
        (
            "preallocation growing the file",
            FallocateMode::default(),
            8192,
            4096,
            true,
        ),
        (
            "punch hole",
            FallocateMode {
                punch_hole: true,
                keep_size: true,
                ..Default::default()
            },
            0,
            4096,
            true,
        ),
        (
            "zero range",
            FallocateMode {
                zero_range: true,
                ..Default::default()
            },
            100,
            200,
            true,
        ),
    ];
    for (what, mode, offset, len, moves) in cases {
        let before = fs
            .setattr(
                file,
                engine::SetAttr {
                    mtime: Some(old),
                    ..Default::default()
                },
            )
            .unwrap();
        fs.fallocate(file, mode, offset, len).unwrap();
        let after = fs.stat(file).unwrap();
        assert_eq!(after.mtime != old, moves, "{what}: mtime {:?}", after.mtime);
        assert!(
            (after.ctime.sec, after.ctime.nsec) >= (before.ctime.sec, before.ctime.nsec),
            "{what}: ctime went back"
        );
    }
}
