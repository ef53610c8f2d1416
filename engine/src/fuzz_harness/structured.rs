//! The structure-aware harness ([`structured_image`]): random bytes almost never get past a
//! crc32c, so this one takes a valid image, lets the fuzz bytes pick structures in it — a tree
//! node, an item's value (its kind picked first, so the space bitmap or an extent is as likely
//! as one of the many names), a superblock copy, an fsync log record — and mutate their
//! *fields* (item count, data offsets and lengths, keys, levels, child pointers, generations,
//! op tags and lengths, inode fields, extents, name lengths, bitmap bits), then re-seals them:
//! the block's own crc32c, and every pointer crc on the path from the superblock down to it, so
//! the mutation reaches the decoders and everything behind them. Then it runs what `corefs
//! dump` and `fsck` read, mounts (replaying the logs), checks, reads every file, changes every
//! inode it found, commits and remounts. Errors are the expected answer; a panic, a hang or an
//! unbounded allocation is a bug.
//!
//! The input is read as a stream of bytes that runs out into zeroes, so every input is valid
//! and a short one means "few, small mutations".

use super::config;
use crate::dir::RenameFlags;
use crate::file::FallocateMode;
use crate::format::node::{
    decode_node, HEADER_BYTES as NODE_HEADER_BYTES, INTERNAL_ENTRY_BYTES, LEAF_ITEM_HEADER_BYTES,
    MAX_ITEM_BYTES,
};
use crate::format::{
    block_crc, le_u16, le_u32, le_u64, BlockPtr, ItemKind, NodeBody, Superblock, BLOCK_BYTES,
    SUPERBLOCK_ADDRS,
};
use crate::fs::{Filesystem, MkfsOptions, MountOptions};
use crate::log::record::{decode_record, HEADER_BYTES as RECORD_HEADER_BYTES};
use nvme::backend::mem::MemDevice;
use std::sync::OnceLock;

/// Size of the structured template: room for internal nodes and several pending log records.
const STRUCTURED_IMAGE_BYTES: usize = 4 << 20;

/// One tree node of the template and where its pointer is: the superblock's shard root, or
/// entry `index` of the internal node at `parent`.
#[derive(Debug, Clone, Copy)]
struct NodeAt {
    addr: u64,
    shard: u32,
    level: u8,
    parent: Option<(u64, usize)>,
}

/// One current fsync log record of the template: its first block and block count.
#[derive(Debug, Clone, Copy)]
struct RecordAt {
    block: u64,
    blocks: u64,
    /// The end of its log half: a record re-sealed at a new size stays before it.
    area_end: u64,
}

struct Template {
    image: Vec<u8>,
    /// The superblock copy mount picks (the newest) and its decoded form.
    sb_addr: u64,
    sb: Superblock,
    nodes: Vec<NodeAt>,
    /// Every leaf item, grouped by kind: (leaf's index in `nodes`, item index).
    items_by_kind: Vec<Vec<(usize, usize)>>,
    records: Vec<RecordAt>,
}

fn block(image: &[u8], addr: u64) -> &[u8] {
    &image[addr as usize * BLOCK_BYTES..(addr as usize + 1) * BLOCK_BYTES]
}
fn block_mut(image: &mut [u8], addr: u64) -> &mut [u8] {
    &mut image[addr as usize * BLOCK_BYTES..(addr as usize + 1) * BLOCK_BYTES]
}

/// A valid image: 2 shards whose trees have internal nodes (60 files in one directory),
/// files with several extents, a preallocated range, hard links, a symlink, xattrs (one
/// large), all committed; then changes fsynced without a commit (an append carried in the
/// record, a rename, a new file, an xattr, a truncate, an unlink), so several records wait for
/// replay in both shards' logs.
fn template() -> &'static Template {
    static TEMPLATE: OnceLock<Template> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let mut cfg = config();
        cfg.capacity_bytes = STRUCTURED_IMAGE_BYTES as u64;
        let dev = MemDevice::new(cfg).expect("memory device");
        // Fixed keys: a random name-hash key would order the directory's items differently in
        // every process, and a seed would not replay the damage it printed.
        let dev = Filesystem::mkfs_keyed(
            Box::new(dev),
            &MkfsOptions {
                shards: 2,
                label: "structured".into(),
                ..Default::default()
            },
            32,
            [0x5e; 16],
            [0x4b; 16],
        )
        .expect("mkfs");
        let mut fs = Filesystem::mount(dev, MountOptions::default()).expect("mount");
        let root = fs.root();
        let dir = fs.mkdir(root, b"dir", 0o755, 0, 0).expect("mkdir").ino;
        let sub = fs.mkdir(dir, b"sub", 0o700, 1, 1).expect("mkdir").ino;
        let mut files = Vec::new();
        for i in 0..60u32 {
            let name = format!("file-{i:03}-with-a-longer-name");
            let ino = fs
                .create(dir, name.as_bytes(), 0o644, i, i)
                .expect("create")
                .ino;
            if i % 6 == 0 {
                fs.write(ino, 0, &vec![i as u8; 100 + i as usize * 50])
                    .expect("write");
            }
            if i % 10 == 3 {
                fs.setxattr(ino, b"user.tag", name.as_bytes(), crate::XattrFlags::Any)
                    .expect("setxattr");
            }
            files.push(ino);
        }
        let big = fs.create(root, b"big", 0o644, 0, 0).expect("create").ino;
        // Several extents: written in pieces with a hole between them.
        fs.write(big, 0, &[0xa5; 3 * BLOCK_BYTES]).expect("write");
        fs.write(big, 5 * BLOCK_BYTES as u64, &[0x5a; 2 * BLOCK_BYTES])
            .expect("write");
        fs.fallocate(
            big,
            FallocateMode {
                keep_size: true,
                ..Default::default()
            },
            8 * BLOCK_BYTES as u64,
            2 * BLOCK_BYTES as u64,
        )
        .expect("fallocate");
        fs.setxattr(big, b"user.large", &[7; 900], crate::XattrFlags::Any)
            .expect("setxattr");
        fs.link(files[0], sub, b"hardlink").expect("link");
        fs.symlink(root, b"s", b"dir/file-000-with-a-longer-name", 0, 0)
            .expect("symlink");
        fs.commit().expect("commit");
        // Pending records: each fsync writes one into the fsynced inode's shard log.
        fs.write(big, 7 * BLOCK_BYTES as u64, b"appended after the commit")
            .expect("append");
        fs.fsync(big).expect("fsync");
        fs.rename(
            dir,
            b"file-001-with-a-longer-name",
            sub,
            b"moved",
            RenameFlags::default(),
        )
        .expect("rename");
        fs.fsync(files[1]).expect("fsync");
        let fresh = fs.create(sub, b"fresh", 0o600, 0, 0).expect("create").ino;
        fs.write(fresh, 0, b"fresh data").expect("write");
        fs.fsync(fresh).expect("fsync");
        fs.setxattr(files[3], b"user.more", b"x", crate::XattrFlags::Any)
            .expect("setxattr");
        fs.fsync(files[3]).expect("fsync");
        fs.truncate(files[6], 10).expect("truncate");
        fs.fsync(files[6]).expect("fsync");
        fs.unlink(dir, b"file-002-with-a-longer-name")
            .expect("unlink");
        fs.fsync(dir).expect("fsync");
        let image = {
            let mut dev = fs.into_device();
            let mut image = vec![0u8; STRUCTURED_IMAGE_BYTES];
            nvme::read_sync(&mut *dev, 0, &mut image).expect("reading a memory device");
            image
        };
        let device_blocks = (STRUCTURED_IMAGE_BYTES / BLOCK_BYTES) as u64;
        let (sb_addr, sb) = SUPERBLOCK_ADDRS
            .iter()
            .filter_map(|&a| {
                Superblock::decode(block(&image, a), device_blocks)
                    .ok()
                    .map(|s| (a, s))
            })
            .max_by_key(|(_, s)| s.generation)
            .expect("the template has a superblock");
        let mut nodes = Vec::new();
        for (shard, root) in sb.shards.iter().enumerate() {
            if root.tree.addr != 0 {
                walk(
                    &image,
                    shard as u32,
                    &root.tree,
                    root.level,
                    None,
                    &mut nodes,
                );
            }
        }
        let mut by_kind: std::collections::BTreeMap<u8, Vec<(usize, usize)>> = Default::default();
        for (n, node) in nodes.iter().enumerate().filter(|(_, n)| n.level == 0) {
            let b = block(&image, node.addr);
            for i in 0..le_u16(b, 32) as usize {
                let kind = b[NODE_HEADER_BYTES + i * LEAF_ITEM_HEADER_BYTES + 8];
                by_kind.entry(kind).or_default().push((n, i));
            }
        }
        let items_by_kind = by_kind.into_values().collect();
        let mut records = Vec::new();
        let generation = sb.generation + 1;
        for shard in 0..sb.shards.len() as u32 {
            let start = sb.log_start(shard, generation);
            let area_end = start + sb.log_half_blocks();
            let mut at = start;
            while at < area_end {
                let first = block(&image, at);
                let Ok(header) = crate::log::record::decode_header(first) else {
                    break;
                };
                let end = at + header.blocks as u64;
                if header.generation != generation || end > area_end {
                    break;
                }
                let bytes = &image[at as usize * BLOCK_BYTES..end as usize * BLOCK_BYTES];
                if decode_record(bytes).is_err() {
                    break;
                }
                records.push(RecordAt {
                    block: at,
                    blocks: header.blocks as u64,
                    area_end,
                });
                at = end;
            }
        }
        assert!(
            nodes.iter().any(|n| n.level > 0),
            "the structured template has internal nodes"
        );
        assert!(
            records.len() >= 4,
            "the structured template has pending records"
        );
        Template {
            image,
            sb_addr,
            sb,
            nodes,
            items_by_kind,
            records,
        }
    })
}

fn walk(
    image: &[u8],
    shard: u32,
    ptr: &BlockPtr,
    level: u8,
    parent: Option<(u64, usize)>,
    out: &mut Vec<NodeAt>,
) {
    let (_, body) = decode_node(block(image, ptr.addr), ptr, shard, Some(level))
        .expect("the template's nodes decode");
    out.push(NodeAt {
        addr: ptr.addr,
        shard,
        level,
        parent,
    });
    if let NodeBody::Internal(entries) = body {
        for (i, (_, child)) in entries.iter().enumerate() {
            walk(image, shard, child, level - 1, Some((ptr.addr, i)), out);
        }
    }
}

/// The fuzz bytes as a stream that runs out into zeroes.
struct Input<'a> {
    bytes: &'a [u8],
}

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&b, rest)) => {
                self.bytes = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        b.iter_mut().for_each(|x| *x = self.u8());
        u64::from_le_bytes(b)
    }
    /// An index below `n` (0 when `n` is 0).
    fn index(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            self.u16() as usize % n
        }
    }
    /// A new value for a field holding `old`: small steps either way most of the time (the
    /// interesting values are near the valid ones), sometimes extremes or anything.
    fn near(&mut self, old: u64) -> u64 {
        match self.u8() % 8 {
            0 => old.wrapping_add(1),
            1 => old.wrapping_sub(1),
            2 => old.wrapping_add(self.u8() as u64),
            3 => old.wrapping_sub(self.u8() as u64),
            4 => [0, u64::MAX, u64::MAX - 1, i64::MAX as u64, 1 << 32, 1 << 16]
                [self.u8() as usize % 6],
            5 => u64::MAX >> (self.u8() % 64),
            6 => old ^ (1 << (self.u8() % 64)),
            _ => self.u64(),
        }
    }
    fn near_u16(&mut self, old: u16) -> u16 {
        self.near(old as u64) as u16
    }
    fn near_u32(&mut self, old: u32) -> u32 {
        self.near(old as u64) as u32
    }
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A key kind byte: mostly a known one, sometimes anything.
fn kind_byte(input: &mut Input) -> u8 {
    const KNOWN: [ItemKind; 12] = [
        ItemKind::InodeItem,
        ItemKind::InodeRef,
        ItemKind::InodeExtRef,
        ItemKind::XattrItem,
        ItemKind::DirItem,
        ItemKind::DirIndex,
        ItemKind::ExtentData,
        ItemKind::SymlinkTarget,
        ItemKind::ExtentCsum,
        ItemKind::SpaceBitmap,
        ItemKind::GroupBitmap,
        ItemKind::Test,
    ];
    let pick = input.u8() as usize;
    if pick < 240 {
        KNOWN[pick % KNOWN.len()] as u8
    } else {
        input.u8()
    }
}

/// Mutates the 17-byte key at `key[..17]`: object id, kind or offset.
fn mutate_key(input: &mut Input, key: &mut [u8]) {
    match input.u8() % 3 {
        0 => {
            let v = input.near(le_u64(key, 0));
            put_u64(key, 0, v);
        }
        1 => key[8] = kind_byte(input),
        _ => {
            let v = input.near(le_u64(key, 9));
            put_u64(key, 9, v);
        }
    }
}

/// Writes a small structured value into `value`: a byte, a u16, a u32 or a u64 at a chosen
/// position, each near what was there (an item's lengths, counts, block numbers, modes).
fn mutate_value(input: &mut Input, value: &mut [u8]) {
    if value.is_empty() {
        return;
    }
    let at = input.index(value.len());
    let width = [1, 2, 4, 8][input.u8() as usize % 4];
    let width = width.min(value.len() - at);
    let mut old = [0u8; 8];
    old[..width].copy_from_slice(&value[at..at + width]);
    let new = input.near(u64::from_le_bytes(old)).to_le_bytes();
    value[at..at + width].copy_from_slice(&new[..width]);
}

/// Mutates one field of an item's value, chosen by what the item is (`kind`, the key's kind
/// byte): an inode's mode, link count, size, blocks, timestamp or index counter; an extent's
/// flags, first block, block count or a checksum; a name entry's target, type or length; an
/// xattr's name or value length; a bit of the space bitmap moved to another block (the count
/// the superblock checks stays right). Anything else, or one time in four: any field.
fn mutate_item(input: &mut Input, kind: u8, value: &mut [u8]) {
    // (offset, width) of the fields worth changing, by kind.
    let fields: &[(usize, usize)] = match ItemKind::from_u8(kind) {
        Some(ItemKind::InodeItem) if value.len() == 8 => &[(0, 8)], // an inode counter
        Some(ItemKind::InodeItem) => &[(0, 4), (12, 4), (16, 8), (24, 8), (48, 4), (96, 8)],
        Some(ItemKind::ExtentData) => &[(0, 1), (1, 8), (1, 8), (9, 4), (9, 4), (13, 4)],
        Some(ItemKind::DirItem | ItemKind::DirIndex | ItemKind::InodeRef) => {
            &[(0, 8), (8, 1), (9, 2), (9, 2), (11, 1)]
        }
        Some(ItemKind::InodeExtRef) => &[(0, 8), (8, 8), (16, 2), (16, 2), (18, 1)],
        Some(ItemKind::XattrItem) => &[(0, 2), (2, 2), (4, 1)],
        Some(ItemKind::SpaceBitmap | ItemKind::GroupBitmap) => {
            let set: Vec<usize> = (0..value.len() * 8)
                .filter(|&bit| value[bit / 8] & (1 << (bit % 8)) != 0)
                .collect();
            if !set.is_empty() {
                let from = set[input.index(set.len())];
                let to = input.index(value.len() * 8);
                value[from / 8] &= !(1 << (from % 8));
                value[to / 8] |= 1 << (to % 8);
            }
            return;
        }
        _ => &[],
    };
    if fields.is_empty() || input.u8() % 4 == 0 {
        mutate_value(input, value);
        return;
    }
    let (at, width) = fields[input.index(fields.len())];
    if at + width <= value.len() {
        let mut old = [0u8; 8];
        old[..width].copy_from_slice(&value[at..at + width]);
        let new = input.near(u64::from_le_bytes(old)).to_le_bytes();
        value[at..at + width].copy_from_slice(&new[..width]);
    }
}

/// Mutates the node block at `node.addr`; returns true when the parent's pointer should also
/// take the node's (possibly new) header generation, so the mutation is not stopped by the
/// lost-write check alone. The header's identity fields (address, owner, level) are checked
/// first and simply, so they get few of the mutations; counts, offsets, lengths, keys,
/// pointers and item contents get most.
fn mutate_node(input: &mut Input, t: &Template, image: &mut [u8], node: NodeAt) -> bool {
    let mut follow_generation = false;
    let rounds = 1 + input.u8() % 4;
    for _ in 0..rounds {
        let b = block_mut(image, node.addr);
        let count = le_u16(b, 32) as usize;
        let leaf = b[28] == 0;
        let (entry, max) = if leaf {
            (
                LEAF_ITEM_HEADER_BYTES,
                (BLOCK_BYTES - NODE_HEADER_BYTES) / LEAF_ITEM_HEADER_BYTES,
            )
        } else {
            (
                INTERNAL_ENTRY_BYTES,
                (BLOCK_BYTES - NODE_HEADER_BYTES) / INTERNAL_ENTRY_BYTES,
            )
        };
        let i = input.index(count.clamp(1, max));
        let j = input.index(count.clamp(1, max));
        let at = NODE_HEADER_BYTES + i * entry;
        let other = NODE_HEADER_BYTES + j * entry;
        match input.u8() % 16 {
            0 | 1 => {
                // The entry count: mostly one more or one less.
                let v = match input.u8() % 4 {
                    0 => input.near_u16(count as u16),
                    1 => (count as u16).wrapping_add(1),
                    _ => (count as u16).wrapping_sub(1),
                };
                put_u16(b, 32, v);
            }
            2 | 3 => mutate_key(input, &mut b[at..at + 17]),
            4 => {
                // Swap two entries: keys out of order, data or children crossed.
                let mut tmp = [0u8; INTERNAL_ENTRY_BYTES];
                tmp[..entry].copy_from_slice(&b[at..at + entry]);
                b.copy_within(other..other + entry, at);
                b[other..other + entry].copy_from_slice(&tmp[..entry]);
            }
            5 => {
                // Copy one entry (or only its key) over another: a duplicate key, shared item
                // data, the same child twice.
                let len = if input.u8() % 2 == 0 { entry } else { 17 };
                b.copy_within(other..other + len, at);
            }
            6 => match input.u8() % 4 {
                0 => b[28] = input.u8() % 10,
                1 => {
                    let v = input.near(le_u64(b, 8));
                    put_u64(b, 8, v);
                }
                2 => b[24] = input.u8() % 4,
                _ => {
                    let v = input.near(le_u64(b, 16));
                    put_u64(b, 16, v);
                }
            },
            7 => {
                let v = input.near(le_u64(b, 16));
                put_u64(b, 16, v);
                follow_generation = true;
            }
            op if leaf => match op {
                8 | 9 => {
                    let v = input.near_u16(le_u16(b, at + 17));
                    put_u16(b, at + 17, v);
                }
                10 | 11 => {
                    // A length: near the old one, or just past the largest item.
                    let v = if input.u8() % 4 == 0 {
                        (MAX_ITEM_BYTES + input.u8() as usize % 3) as u16
                    } else {
                        input.near_u16(le_u16(b, at + 19))
                    };
                    put_u16(b, at + 19, v);
                }
                12 => {
                    // Item i takes item j's data: two items share their bytes.
                    b.copy_within(other + 17..other + 21, at + 17);
                }
                _ => {
                    // Inside the item's value (names, extents, inode fields, bitmaps).
                    let kind = b[at + 8];
                    let offset = le_u16(b, at + 17) as usize;
                    let len = le_u16(b, at + 19) as usize;
                    if offset < BLOCK_BYTES {
                        let end = (offset + len).min(BLOCK_BYTES);
                        mutate_item(input, kind, &mut b[offset..end]);
                    }
                }
            },
            op => match op {
                8..=10 => {
                    // Point entry i at another node of the template, with that node's whole
                    // pointer (address, generation, crc): it verifies, but the tree is no
                    // longer a tree (a shared child, a wrong level or shard, a cycle).
                    let target = t.nodes[input.index(t.nodes.len())];
                    let ptr = pointer_to(image, target.addr);
                    let b = block_mut(image, node.addr);
                    ptr.encode(&mut b[at + 17..at + 37]);
                }
                11 | 12 => {
                    let v = input.near(le_u64(b, at + 17));
                    put_u64(b, at + 17, v);
                }
                13 => {
                    let v = input.near(le_u64(b, at + 25));
                    put_u64(b, at + 25, v);
                }
                _ => mutate_key(input, &mut b[at..at + 17]),
            },
        }
    }
    follow_generation
}

/// A pointer that verifies against the block at `addr` as it is in `image` now.
fn pointer_to(image: &[u8], addr: u64) -> BlockPtr {
    let b = block(image, addr);
    BlockPtr {
        addr,
        generation: le_u64(b, 16),
        crc: le_u32(b, 0),
    }
}

fn seal_block(b: &mut [u8]) -> u32 {
    let crc = block_crc(b);
    put_u32(b, 0, crc);
    crc
}

/// Re-seals node `node` and every pointer above it up to the superblock mount uses.
fn seal_path(t: &Template, image: &mut [u8], node: NodeAt, follow_generation: bool) {
    let mut at = node;
    let mut follow = follow_generation;
    loop {
        let crc = seal_block(block_mut(image, at.addr));
        let generation = le_u64(block(image, at.addr), 16);
        match at.parent {
            Some((parent, index)) => {
                let p = block_mut(image, parent);
                let entry = NODE_HEADER_BYTES + index * INTERNAL_ENTRY_BYTES + 17;
                put_u32(p, entry + 16, crc);
                if follow {
                    put_u64(p, entry + 8, generation);
                    // The parent must not be older than its child.
                    if le_u64(p, 16) < generation {
                        put_u64(p, 16, generation);
                    } else {
                        follow = false;
                    }
                }
                at = *t
                    .nodes
                    .iter()
                    .find(|n| n.addr == parent)
                    .expect("a parent is a template node");
            }
            None => {
                let sb = block_mut(image, t.sb_addr);
                let root_at = 128 + at.shard as usize * 48;
                put_u32(sb, root_at + 16, crc);
                if follow {
                    put_u64(sb, root_at + 8, generation);
                }
                seal_block(sb);
                return;
            }
        }
    }
}

fn mutate_superblock(input: &mut Input, t: &Template, image: &mut [u8]) {
    // Mostly the copy mount uses; sometimes the other one (mount falls back on it, fsck
    // repairs from it).
    let addr = if input.u8() % 4 == 0 {
        SUPERBLOCK_ADDRS[0] + SUPERBLOCK_ADDRS[1] - t.sb_addr
    } else {
        t.sb_addr
    };
    let rounds = 1 + input.u8() % 3;
    for _ in 0..rounds {
        let shard_at = 128 + input.index(t.sb.shards.len() + 1) * 48;
        let op = input.u8() % 13;
        if op == 11 {
            let target = t.nodes[input.index(t.nodes.len())];
            let ptr = pointer_to(image, target.addr);
            ptr.encode(&mut block_mut(image, addr)[shard_at..shard_at + 20]);
            continue;
        }
        let b = block_mut(image, addr);
        match op {
            0 => {
                let v = input.near(le_u64(b, 24));
                put_u64(b, 24, v);
            }
            1 => {
                let v = input.near_u32(le_u32(b, 36)) % 80;
                put_u32(b, 36, v);
            }
            2 => {
                let v = input.near(le_u64(b, 40));
                put_u64(b, 40, v);
            }
            3 => {
                let v = input.near(le_u64(b, 96));
                put_u64(b, 96, v);
            }
            4 => {
                let v = input.near(le_u64(b, shard_at));
                put_u64(b, shard_at, v);
            }
            5 => {
                let v = input.near(le_u64(b, shard_at + 8));
                put_u64(b, shard_at + 8, v);
            }
            6 => b[shard_at + 20] = input.u8() % 10,
            7 => {
                let v = input.near(le_u64(b, shard_at + 24));
                put_u64(b, shard_at + 24, v);
            }
            8 => {
                let v = input.near(le_u64(b, 16));
                put_u64(b, 16, v);
            }
            9 => {
                let v = [512, 1024, 2048, 4096, 8192, 0, 3000][input.u8() as usize % 7];
                put_u32(b, 32, v);
            }
            10 => {
                let other = 128 + input.index(t.sb.shards.len()) * 48;
                let mut tmp = [0u8; 48];
                tmp.copy_from_slice(&b[shard_at..shard_at + 48]);
                b.copy_within(other..other + 48, shard_at);
                b[other..other + 48].copy_from_slice(&tmp);
            }
            _ => mutate_value(input, &mut b[..128]),
        }
    }
    seal_block(block_mut(image, addr));
}

fn mutate_record(input: &mut Input, t: &Template, image: &mut [u8]) {
    let record = t.records[input.index(t.records.len())];
    let start = record.block as usize * BLOCK_BYTES;
    let mut blocks = record.blocks as usize;
    // Where each op starts, from the record as the template wrote it.
    let ops: Vec<(usize, u8)> = {
        let bytes = &image[start..start + blocks * BLOCK_BYTES];
        let payload_end = RECORD_HEADER_BYTES + le_u32(bytes, 48) as usize;
        let mut at = RECORD_HEADER_BYTES;
        let mut out = Vec::new();
        while at < payload_end {
            let tag = bytes[at];
            out.push((at, tag));
            at += match tag {
                3 => 9 + BLOCK_BYTES,
                1 => 1 + 17 + 2 + le_u16(bytes, at + 18) as usize,
                _ => 1 + 17,
            };
        }
        out
    };
    let rounds = 1 + input.u8() % 3;
    for _ in 0..rounds {
        let rec = &mut image[start..start + blocks * BLOCK_BYTES];
        let op = input.u8() % 12;
        match op {
            0 => {
                let v = input.near_u32(le_u32(rec, 4));
                put_u32(rec, 4, v);
                // Re-seal over the new size where it still fits the log half.
                let fits = (record.block + v as u64) <= record.area_end && v > 0;
                if fits {
                    blocks = v as usize;
                }
            }
            1 => {
                let v = input.near_u32(le_u32(rec, 44));
                put_u32(rec, 44, v);
            }
            2 => {
                let v = input.near_u32(le_u32(rec, 48));
                put_u32(rec, 48, v);
            }
            3 => {
                let v = input.near_u32(le_u32(rec, 40)) % 70;
                put_u32(rec, 40, v);
            }
            4 => {
                let v = input.near_u32(le_u32(rec, 52));
                put_u32(rec, 52, v);
            }
            5 => {
                let at = [24, 32][input.u8() as usize % 2];
                let v = input.near(le_u64(rec, at));
                put_u64(rec, at, v);
            }
            6 => {
                let v = input.near(le_u64(rec, 16));
                put_u64(rec, 16, v);
            }
            _ if ops.is_empty() => {}
            _ => {
                let (at, tag) = ops[input.index(ops.len())];
                match (op, tag) {
                    (7, _) => rec[at] = input.u8() % 5,
                    (8, 1 | 2) => mutate_key(input, &mut rec[at + 1..at + 18]),
                    (9, 1) => {
                        let v = if input.u8() % 4 == 0 {
                            (MAX_ITEM_BYTES + input.u8() as usize % 3) as u16
                        } else {
                            input.near_u16(le_u16(rec, at + 18))
                        };
                        put_u16(rec, at + 18, v);
                    }
                    (10 | 11, 1) => {
                        let len = le_u16(rec, at + 18) as usize;
                        let end = (at + 20 + len).min(rec.len());
                        let kind = rec[at + 9];
                        mutate_item(input, kind, &mut rec[at + 20..end]);
                    }
                    (_, 3) => {
                        let v = input.near(le_u64(rec, at + 1));
                        put_u64(rec, at + 1, v);
                    }
                    _ => {
                        let end = (at + 20).min(rec.len());
                        mutate_value(input, &mut rec[at..end]);
                    }
                }
            }
        }
    }
    let rec = &mut image[start..start + blocks * BLOCK_BYTES];
    let crc = crc32c::crc32c(&rec[4..]);
    put_u32(rec, 0, crc);
}

/// Mounts, checks, reads, changes, commits and remounts `image`; every error is accepted.
fn exercise(image: &[u8]) {
    let mut cfg = config();
    cfg.capacity_bytes = image.len() as u64;
    // What `corefs fsck` and `corefs dump` read before mounting.
    if let Ok(mut dev) = MemDevice::from_image(image, cfg) {
        let _ = crate::inspect::format_superblocks(&mut dev);
        let _ = crate::inspect::format_logs(&mut dev);
        let _ = crate::inspect::format_trees(&mut dev, None);
    }
    let Ok(dev) = MemDevice::from_image(image, cfg) else {
        return;
    };
    let Ok(mut fs) = Filesystem::mount(Box::new(dev), MountOptions::default()) else {
        return;
    };
    let _ = fs.check();
    let _ = fs.check_data(&mut |_, _| {});
    let found = read_everything(&mut fs);
    // Changes, which a damaged filesystem must refuse or survive.
    let root = fs.root();
    if let Ok(st) = fs.create(root, b"new", 0o644, 0, 0) {
        let _ = fs.write(st.ino, 0, &[1; 5000]);
        let _ = fs.fsync(st.ino);
    }
    let _ = fs.mkdir(root, b"newdir", 0o755, 0, 0);
    for (i, &(dir, ref name, ino, is_dir)) in found.iter().enumerate().take(24) {
        match i % 6 {
            0 if !is_dir => {
                let _ = fs.write(ino, 4096, b"overwrite");
                let _ = fs.fsync(ino);
            }
            1 if !is_dir => {
                let _ = fs.truncate(ino, 1);
            }
            2 if !is_dir => {
                let _ = fs.unlink(dir, name);
            }
            3 => {
                let _ = fs.rename(dir, name, root, b"renamed", RenameFlags::default());
            }
            4 => {
                let _ = fs.setxattr(ino, b"user.fuzz", b"value", crate::XattrFlags::Any);
                let _ = fs.removexattr(ino, b"user.tag");
            }
            5 if is_dir => {
                let _ = fs.rmdir(dir, name);
            }
            _ => {
                let _ = fs.link(ino, root, b"another");
            }
        }
    }
    // A change to every inode found copies every leaf holding one on write (a node reachable
    // twice, or whose block the bitmap calls free, is freed here), and xattrs grow leaves
    // until they split (a leaf with an oversized or overlapping item splits here).
    for (i, &(_, _, ino, _)) in found.iter().enumerate() {
        let change = crate::inode::SetAttr {
            mtime: Some(crate::format::items::Timespec { sec: 7, nsec: 0 }),
            ..Default::default()
        };
        let _ = fs.setattr(ino, change);
        if i % 3 == 0 {
            let _ = fs.setxattr(ino, b"user.grow", &[i as u8; 300], crate::XattrFlags::Any);
        }
    }
    let _ = fs.commit();
    // Remount what is on the device now (whatever the commit did or refused), replaying the
    // fsyncs above.
    let dev = fs.into_device();
    let Ok(mut fs) = Filesystem::mount(dev, MountOptions::default()) else {
        return;
    };
    let _ = fs.check();
    read_everything(&mut fs);
}

/// Reads every file, link and xattr reachable from the root (bounded); returns the names
/// found as (directory, name, inode, is a directory).
fn read_everything(fs: &mut Filesystem) -> Vec<(u64, Vec<u8>, u64, bool)> {
    let mut found = Vec::new();
    let mut stack = vec![fs.root()];
    let mut visited = 0;
    while let Some(dir) = stack.pop() {
        visited += 1;
        if visited > 64 {
            break;
        }
        let mut cookie = 0;
        for _ in 0..8 {
            let Ok(entries) = fs.readdir(dir, cookie, 32) else {
                break;
            };
            let Some(last) = entries.last() else {
                break;
            };
            cookie = last.cookie;
            for e in entries {
                let _ = fs.lookup(dir, &e.name);
                let Ok(st) = fs.stat(e.ino) else {
                    continue;
                };
                if st.is_dir() {
                    stack.push(e.ino);
                } else {
                    let _ = fs.read(e.ino, 0, (st.size as usize).min(1 << 20));
                    let _ = fs.readlink(e.ino);
                }
                if let Ok(names) = fs.listxattr(e.ino) {
                    for name in names.iter().take(8) {
                        let _ = fs.getxattr(e.ino, name);
                    }
                }
                if found.len() < 256 {
                    found.push((dir, e.name.clone(), e.ino, st.is_dir()));
                }
            }
        }
    }
    found
}

/// The structure-aware harness: see the module comment. The first byte picks what to
/// mutate (a tree node, a superblock copy, a log record, or a node and a record together).
pub fn structured_image(bytes: &[u8]) {
    let t = template();
    let mut input = Input { bytes };
    let mut image = t.image.clone();
    let what = input.u8() % 8;
    if what == 0 {
        mutate_superblock(&mut input, t, &mut image);
    }
    if matches!(what, 1 | 2 | 5) {
        // Internal nodes half the time on purpose: they are few.
        let internal: Vec<NodeAt> = t.nodes.iter().copied().filter(|n| n.level > 0).collect();
        let node = if input.u8() % 2 == 0 {
            internal[input.index(internal.len())]
        } else {
            t.nodes[input.index(t.nodes.len())]
        };
        let follow = mutate_node(&mut input, t, &mut image, node);
        seal_path(t, &mut image, node, follow);
    }
    if matches!(what, 3 | 4 | 5 | 7) {
        // One item's value, the kind picked first: the space bitmap or an extent is as likely
        // as one of the many names.
        let rounds = 1 + input.u8() % 3;
        for _ in 0..rounds {
            let of_kind = &t.items_by_kind[input.index(t.items_by_kind.len())];
            let (n, i) = of_kind[input.index(of_kind.len())];
            let node = t.nodes[n];
            let b = block_mut(&mut image, node.addr);
            let at = NODE_HEADER_BYTES + i * LEAF_ITEM_HEADER_BYTES;
            let (kind, offset, len) = (b[at + 8], le_u16(b, at + 17), le_u16(b, at + 19));
            // The header may have been damaged by a mutation before this one (`what` 5
            // mutates the node first, and each round here its item): the harness clamps
            // what it reads from it, as the decoders under test must.
            let start = (offset as usize).min(BLOCK_BYTES);
            let end = (start + len as usize).min(BLOCK_BYTES);
            mutate_item(&mut input, kind, &mut b[start..end]);
            seal_path(t, &mut image, node, false);
        }
    }
    if what >= 6 {
        mutate_record(&mut input, t, &mut image);
    }
    exercise(&image);
}
