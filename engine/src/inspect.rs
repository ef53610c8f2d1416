//! Read-only inspection of an image for `corefs dump` (like btrfs inspect-internal dump-tree
//! and dump-super): superblocks, every tree node, one inode's items, the fsync logs. It reads
//! the device directly and never mounts, so it works on an image that will not mount, and it
//! shows the logs as they are (a mount would replay and truncate them).
//!
//! Fault model: every block is verified as the engine verifies it (checksum, address,
//! generation, owner, level against the parent pointer); a block that fails is printed as
//! such, with the reason, and the walk goes on with its siblings.

use crate::blocks::read_block;
use crate::format::items::{decode_names, decode_xattrs, ExtentItem, InodeItem, XattrValue};
use crate::format::{
    decode_node, BlockPtr, ItemKind, Key, NodeBody, Superblock, BLOCK_BYTES, SUPERBLOCK_ADDRS,
};
use crate::fs::SPACE_OBJECTID;
use crate::inode::INO_COUNTER_OBJECTID;
use crate::log::record::{decode_header, decode_record, LogOp};
use nvme::BlockDevice;
use std::fmt::Write;

/// Both superblock copies, decoded or with the reason they are not.
pub fn superblocks(dev: &mut dyn BlockDevice) -> Vec<(u64, Result<Superblock, String>)> {
    let device_blocks = dev.info().capacity_bytes() / BLOCK_BYTES as u64;
    SUPERBLOCK_ADDRS
        .iter()
        .map(|&addr| {
            let decoded = read_block(dev, addr)
                .map_err(|e| e.to_string())
                .and_then(|b| Superblock::decode(&b, device_blocks));
            (addr, decoded)
        })
        .collect()
}

/// Writes `sb` over the superblock copy at `addr` and flushes (fsck's repair of a damaged
/// copy from the current one: safe, since mount reads the copy with the highest valid
/// generation and both then say the same).
pub fn rewrite_superblock(
    dev: &mut dyn BlockDevice,
    sb: &Superblock,
    addr: u64,
) -> Result<(), String> {
    assert!(
        SUPERBLOCK_ADDRS.contains(&addr),
        "{addr} is not a superblock address"
    );
    let bytes = sb.encode();
    assert_eq!(bytes.len(), BLOCK_BYTES);
    let lba = crate::blocks::block_lba(dev, addr);
    nvme::write_sync(dev, lba, &bytes, false).map_err(|e| e.to_string())?;
    nvme::flush_sync(dev).map_err(|e| e.to_string())
}

/// Per-shard figures from a walk of the durable trees.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardFigures {
    pub nodes: u64,
    pub leaves: u64,
    pub bad_nodes: u64,
    pub items: u64,
    pub inodes: u64,
    pub extents: u64,
    pub data_blocks: u64,
}

pub fn shard_figures(dev: &mut dyn BlockDevice, sb: &Superblock, shard: u32) -> ShardFigures {
    let mut f = ShardFigures::default();
    walk_tree(dev, sb, shard, &mut |_, _, node| match node {
        Err(_) => f.bad_nodes += 1,
        Ok(NodeBody::Internal(_)) => f.nodes += 1,
        Ok(NodeBody::Leaf(items)) => {
            f.nodes += 1;
            f.leaves += 1;
            f.items += items.len() as u64;
            for (key, value) in items {
                match key.kind {
                    ItemKind::InodeItem if key.objectid >= crate::fs::FIRST_INODE => f.inodes += 1,
                    ItemKind::ExtentData => {
                        f.extents += 1;
                        if let Ok(e) = ExtentItem::decode(value) {
                            f.data_blocks += e.blocks as u64;
                        }
                    }
                    _ => {}
                }
            }
        }
    });
    f
}

/// Statistics of the durable image: per shard and in total.
pub fn format_stats(dev: &mut dyn BlockDevice) -> Result<String, String> {
    let sb = current_superblock(dev)?;
    let mut out = String::new();
    let mut total = ShardFigures::default();
    let _ = writeln!(
        out,
        "generation {}, {} shards, {} blocks of 4 KiB, {} block groups of {} blocks ({} owned)\n\
         {:>5} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10} {:>10} {:>5}",
        sb.generation,
        sb.shards.len(),
        sb.total_blocks,
        crate::space::Geometry::of(&sb).group_count(),
        sb.group_blocks,
        sb.shards.iter().map(|s| s.groups).sum::<u64>(),
        "shard",
        "groups",
        "nodes",
        "leaves",
        "items",
        "inodes",
        "extents",
        "data blks",
        "used blks",
        "bad"
    );
    for shard in 0..sb.shards.len() as u32 {
        let f = shard_figures(dev, &sb, shard);
        let _ = writeln!(
            out,
            "{shard:>5} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10} {:>10} {:>5}",
            sb.shards[shard as usize].groups,
            f.nodes,
            f.leaves,
            f.items,
            f.inodes,
            f.extents,
            f.data_blocks,
            sb.shards[shard as usize].used_blocks,
            f.bad_nodes
        );
        total.nodes += f.nodes;
        total.leaves += f.leaves;
        total.items += f.items;
        total.inodes += f.inodes;
        total.extents += f.extents;
        total.data_blocks += f.data_blocks;
        total.bad_nodes += f.bad_nodes;
    }
    let used: u64 = sb.shards.iter().map(|s| s.used_blocks).sum();
    let _ = writeln!(
        out,
        "{:>5} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10} {:>10} {:>5}",
        "all",
        sb.shards.iter().map(|s| s.groups).sum::<u64>(),
        total.nodes,
        total.leaves,
        total.items,
        total.inodes,
        total.extents,
        total.data_blocks,
        used,
        total.bad_nodes
    );
    Ok(out)
}

/// The valid superblock with the highest generation (what mount uses).
pub fn current_superblock(dev: &mut dyn BlockDevice) -> Result<Superblock, String> {
    let all = superblocks(dev);
    let best = all
        .iter()
        .filter_map(|(_, s)| s.as_ref().ok())
        .max_by_key(|s| s.generation)
        .cloned();
    best.ok_or_else(|| {
        let why: Vec<String> = all
            .iter()
            .map(|(a, s)| {
                format!(
                    "copy {a}: {}",
                    s.as_ref().err().cloned().unwrap_or_default()
                )
            })
            .collect();
        format!("no valid superblock ({})", why.join("; "))
    })
}

pub fn format_superblocks(dev: &mut dyn BlockDevice) -> String {
    let mut out = String::new();
    for (addr, sb) in superblocks(dev) {
        match sb {
            Err(why) => {
                let _ = writeln!(out, "superblock copy at block {addr}: INVALID: {why}");
            }
            Ok(sb) => {
                let uuid: String = sb.uuid.iter().map(|b| format!("{b:02x}")).collect();
                let _ = writeln!(
                    out,
                    "superblock copy at block {addr}: generation {} label {:?} uuid {uuid}\n  \
                     {} blocks of 4 KiB, LBA {} B, {} shards, regions of {} blocks (log {}), \
                     block groups of {} blocks",
                    sb.generation,
                    sb.label,
                    sb.total_blocks,
                    sb.lba_size_bytes,
                    sb.shards.len(),
                    sb.region_blocks,
                    sb.log_blocks,
                    sb.group_blocks
                );
                for (i, s) in sb.shards.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "  shard {i:>2}: log {:>9}.. root {:>9} gen {:>6} level {} used {} blocks \
                         in {} groups",
                        sb.region_start(i as u32),
                        s.tree.addr,
                        s.tree.generation,
                        s.level,
                        s.used_blocks,
                        s.groups
                    );
                }
            }
        }
    }
    out
}

/// One item, decoded for people.
pub fn format_item(key: &Key, value: &[u8]) -> String {
    let k = format!("({} {:?} {})", key.objectid, key.kind, key.offset);
    let body = match key.kind {
        _ if key.objectid == SPACE_OBJECTID => {
            let used: u32 = value.iter().map(|b| b.count_ones()).sum();
            match key.kind {
                ItemKind::GroupBitmap => format!(
                    "block group {}: {used} of {} blocks in use",
                    key.offset,
                    value.len() * 8
                ),
                _ => format!(
                    "space bitmap chunk: {used} of {} blocks in use",
                    value.len() * 8
                ),
            }
        }
        _ if key.objectid == INO_COUNTER_OBJECTID => match value.get(..8) {
            Some(b) => format!(
                "next inode {}",
                u64::from_le_bytes(b.try_into().expect("8 bytes"))
            ),
            None => "inode counter (short)".into(),
        },
        ItemKind::InodeItem => match InodeItem::decode(value) {
            Ok(i) => format!(
                "inode mode {:o} nlink {} size {} blocks {} uid {} gid {} gen {} mtime {}.{:09}",
                i.mode,
                i.nlink,
                i.size,
                i.blocks,
                i.uid,
                i.gid,
                i.generation,
                i.mtime.sec,
                i.mtime.nsec
            ),
            Err(why) => format!("inode: BAD: {why}"),
        },
        ItemKind::InodeExtRef => match crate::format::items::decode_ext_refs(value) {
            Ok(refs) => refs
                .iter()
                .map(|e| {
                    format!(
                        "{:?} in {} (index {})",
                        String::from_utf8_lossy(e.name()),
                        e.dir(),
                        e.index
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            Err(why) => format!("extended back-reference: BAD: {why}"),
        },
        ItemKind::DirItem | ItemKind::DirIndex | ItemKind::InodeRef => match decode_names(value) {
            Ok(names) => names
                .iter()
                .map(|n| {
                    format!(
                        "{:?} -> {} (type {})",
                        String::from_utf8_lossy(&n.name),
                        n.target,
                        n.kind
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            Err(why) => format!("names: BAD: {why}"),
        },
        ItemKind::ExtentData => match ExtentItem::decode(value) {
            Ok(e) => format!(
                "extent at file offset {} -> disk {}+{}{}",
                key.offset,
                e.disk_block,
                e.blocks,
                if e.prealloc { " prealloc" } else { "" }
            ),
            Err(why) => format!("extent: BAD: {why}"),
        },
        ItemKind::XattrItem => match decode_xattrs(value) {
            Ok(x) => x
                .iter()
                .map(|x| {
                    let value = match &x.value {
                        XattrValue::Inline(v) => format!("{} bytes", v.len()),
                        XattrValue::Pieces { slot, len } => {
                            format!("{len} bytes in pieces, slot {slot}")
                        }
                    };
                    format!("xattr {:?} ({value})", String::from_utf8_lossy(&x.name))
                })
                .collect::<Vec<_>>()
                .join(", "),
            Err(why) => format!("xattrs: BAD: {why}"),
        },
        ItemKind::SymlinkTarget => format!("symlink -> {:?}", String::from_utf8_lossy(value)),
        ItemKind::XattrValue => format!("xattr value piece ({} bytes)", value.len()),
        ItemKind::OrphanMark => "orphan: deleted when its last holder lets go, or at mount".into(),
        ItemKind::OrphanIndex => "orphan index".into(),
        _ => format!("{} bytes", value.len()),
    };
    format!("{k} {body}")
}

/// What [`walk_tree`] calls for each node: depth, the pointer to it, the node or why it failed.
pub type NodeVisitor<'a> = dyn FnMut(usize, &BlockPtr, Result<&NodeBody, String>) + 'a;

/// Walks shard `shard`'s tree from its root, calling `visit(depth, ptr, node)` for every node
/// in key order, or `Err(reason)` for a node that fails verification.
pub fn walk_tree(
    dev: &mut dyn BlockDevice,
    sb: &Superblock,
    shard: u32,
    visit: &mut NodeVisitor<'_>,
) {
    let root = sb.shards[shard as usize];
    if root.tree.addr == 0 {
        return;
    }
    walk(dev, shard, &root.tree, root.level, 0, visit);
}

fn walk(
    dev: &mut dyn BlockDevice,
    shard: u32,
    ptr: &BlockPtr,
    level: u8,
    depth: usize,
    visit: &mut NodeVisitor<'_>,
) {
    let decoded = read_block(dev, ptr.addr)
        .map_err(|e| e.to_string())
        .and_then(|b| decode_node(&b, ptr, shard, Some(level)));
    match decoded {
        Err(why) => visit(depth, ptr, Err(why)),
        Ok((_, body)) => {
            visit(depth, ptr, Ok(&body));
            if let NodeBody::Internal(children) = &body {
                for (_, child) in children {
                    walk(dev, shard, child, level - 1, depth + 1, visit);
                }
            }
        }
    }
}

/// Every node of the chosen shards (all when `only` is None), items decoded.
pub fn format_trees(dev: &mut dyn BlockDevice, only: Option<u32>) -> Result<String, String> {
    let sb = current_superblock(dev)?;
    let mut out = String::new();
    for shard in 0..sb.shards.len() as u32 {
        if only.is_some_and(|s| s != shard) {
            continue;
        }
        let _ = writeln!(out, "shard {shard}:");
        walk_tree(dev, &sb, shard, &mut |depth, ptr, node| {
            let pad = "  ".repeat(depth + 1);
            match node {
                Err(why) => {
                    let _ = writeln!(
                        out,
                        "{pad}node {} gen {}: BAD: {why}",
                        ptr.addr, ptr.generation
                    );
                }
                Ok(NodeBody::Internal(children)) => {
                    let _ = writeln!(
                        out,
                        "{pad}internal {} gen {} ({} children)",
                        ptr.addr,
                        ptr.generation,
                        children.len()
                    );
                }
                Ok(NodeBody::Leaf(items)) => {
                    let _ = writeln!(
                        out,
                        "{pad}leaf {} gen {} ({} items)",
                        ptr.addr,
                        ptr.generation,
                        items.len()
                    );
                    for (key, value) in items {
                        let _ = writeln!(out, "{pad}  {}", format_item(key, value));
                    }
                }
            }
        });
    }
    Ok(out)
}

/// Every item of inode `ino`, from its shard's tree.
pub fn format_inode(dev: &mut dyn BlockDevice, ino: u64) -> Result<String, String> {
    let sb = current_superblock(dev)?;
    let shard = (ino % sb.shards.len() as u64) as u32;
    let mut out = String::new();
    let mut found = 0;
    walk_tree(dev, &sb, shard, &mut |_, ptr, node| match node {
        Ok(NodeBody::Leaf(items)) => {
            for (key, value) in items.iter().filter(|(k, _)| k.objectid == ino) {
                found += 1;
                let _ = writeln!(out, "leaf {}: {}", ptr.addr, format_item(key, value));
            }
        }
        Err(why) => {
            let _ = writeln!(out, "node {}: BAD: {why}", ptr.addr);
        }
        Ok(_) => {}
    });
    if found == 0 {
        let _ = writeln!(out, "inode {ino}: no items in shard {shard}");
    }
    Ok(out)
}

/// Each shard's log area: the records of the current transaction (which the next mount
/// replays) and where the log ends, with why.
pub fn format_logs(dev: &mut dyn BlockDevice) -> Result<String, String> {
    scan_logs(dev).map(|(text, _)| text)
}

/// How many fsync log records the next mount finds to replay (what `format_logs` lists).
pub fn pending_log_records(dev: &mut dyn BlockDevice) -> Result<usize, String> {
    scan_logs(dev).map(|(_, records)| records)
}

/// The logs' description and the count of records in it.
fn scan_logs(dev: &mut dyn BlockDevice) -> Result<(String, usize), String> {
    let sb = current_superblock(dev)?;
    let next_generation = sb.generation + 1;
    let mut out = String::new();
    let mut total = 0;
    for shard in 0..sb.shards.len() as u32 {
        let start = sb.log_start(shard, next_generation);
        let mut head = 0u64;
        let mut seq = 0u64;
        let mut lines = Vec::new();
        let end = loop {
            if head >= sb.log_half_blocks() {
                break "log area full".to_string();
            }
            let first = match read_block(dev, start + head) {
                Ok(b) => b,
                Err(e) => break format!("read error: {e}"),
            };
            let header = match decode_header(&first) {
                Ok(h) => h,
                Err(why) => break format!("no record ({why})"),
            };
            if header.generation != next_generation || header.uuid != sb.uuid {
                break format!(
                    "stale record of generation {} (current transaction: {next_generation})",
                    header.generation
                );
            }
            if header.shard != shard || header.shard_seq != seq {
                break format!(
                    "record out of place (shard {} seq {})",
                    header.shard, header.shard_seq
                );
            }
            let mut bytes = first;
            for b in 1..header.blocks as u64 {
                match read_block(dev, start + head + b) {
                    Ok(block) => bytes.extend_from_slice(&block),
                    Err(e) => return Err(e.to_string()),
                }
            }
            match decode_record(&bytes) {
                Err(why) => break format!("torn record {seq}: {why}"),
                Ok((h, ops)) => {
                    let (mut puts, mut deletes, mut data) = (0, 0, 0);
                    for op in &ops {
                        match op {
                            LogOp::Put(..) => puts += 1,
                            LogOp::Delete(..) => deletes += 1,
                            LogOp::Data(..) => data += 1,
                        }
                    }
                    lines.push(format!(
                        "  record {seq} at block {}: stream {} seq {} generation {} {} blocks: \
                         {puts} puts, {deletes} deletes, {data} data blocks",
                        start + head,
                        h.stream,
                        h.global_seq,
                        h.generation,
                        h.blocks
                    ));
                }
            }
            head += header.blocks as u64;
            seq += 1;
        };
        total += lines.len();
        if !lines.is_empty() {
            let _ = writeln!(out, "shard {shard}: {} records, then {end}", lines.len());
            for l in lines {
                let _ = writeln!(out, "{l}");
            }
        }
    }
    let _ = writeln!(
        out,
        "{total} records of generation {next_generation} in {} logs (the next mount replays them)",
        sb.shards.len()
    );
    Ok((out, total))
}
