//! The data-block cache can be turned off (`MountOptions::data_cache_blocks: 0`, what the
//! benchmark suite's random-read workloads use so that corefs reads measure the device path as
//! a kernel filesystem's O_DIRECT reads do), and its hits and the blocks read from the device
//! are counted either way.

use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::BlockDevice;

fn mem() -> Box<dyn BlockDevice> {
    let dev = MemDevice::new(MemConfig {
        capacity_bytes: 32 << 20,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 64,
    })
    .unwrap();
    let options = MkfsOptions {
        shards: 2,
        label: "cache".into(),
        ..Default::default()
    };
    Filesystem::mkfs(Box::new(dev), &options).unwrap()
}

/// Writes 4 blocks, remounts with `data_cache_blocks`, reads them twice; the (hits, device
/// blocks) the engine counted.
fn read_twice(data_cache_blocks: usize) -> (u64, u64) {
    let mut fs = Filesystem::mount(mem(), MountOptions::default()).unwrap();
    let root = fs.root();
    let ino = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    let data: Vec<u8> = (0..4 * 4096).map(|i| (i % 251) as u8).collect();
    fs.write(ino, 0, &data).unwrap();
    fs.sync().unwrap();
    let dev = fs.unmount().unwrap();
    let options = MountOptions {
        data_cache_blocks,
        ..Default::default()
    };
    let mut fs = Filesystem::mount(dev, options).unwrap();
    assert_eq!(
        fs.data_cache_hits(),
        (0, 0),
        "a fresh mount has read no data"
    );
    for _ in 0..2 {
        assert_eq!(fs.read(ino, 0, data.len()).unwrap(), data);
    }
    fs.data_cache_hits()
}

#[test]
fn the_block_cache_serves_the_second_read_unless_it_is_off() {
    assert_eq!(read_twice(engine::writeback::CACHE_BLOCKS), (4, 4));
    assert_eq!(read_twice(0), (0, 8));
}

/// A file streamed through the data-block cache (eight times its size, read sequentially in
/// 1 MiB reads, so read-ahead fetches it) leaves a small-file workload beside it as it was:
/// the small files read twice before stay in the cache (no device read for them during the
/// stream), and the tree nodes their stats need stay in the node cache (no synchronous
/// device wait for them). Before the cache had segments, the stream pushed every hot block
/// out of its first-in, first-out queue.
#[test]
fn a_streaming_read_leaves_a_small_file_workload_in_memory() {
    const CACHE_BLOCKS: usize = 1024;
    let dev = MemDevice::new(MemConfig {
        capacity_bytes: 128 << 20,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 64,
    })
    .unwrap();
    let dev = Filesystem::mkfs(
        Box::new(dev),
        &MkfsOptions {
            shards: 2,
            label: "stream".into(),
            ..Default::default()
        },
    )
    .unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let small: Vec<u64> = (0..2000)
        .map(|i| {
            let ino = fs
                .create(root, format!("s{i}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino;
            if i < 50 {
                fs.write(ino, 0, &[i as u8; 8192]).unwrap();
            }
            ino
        })
        .collect();
    let big = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    let chunk = vec![0x5au8; 1 << 20];
    let big_bytes = 8 * CACHE_BLOCKS as u64 * 4096;
    for at in (0..big_bytes).step_by(chunk.len()) {
        fs.write(big, at, &chunk).unwrap();
    }
    fs.sync().unwrap();
    let dev = fs.unmount().unwrap();
    let mut fs = Filesystem::mount(
        dev,
        MountOptions {
            data_cache_blocks: CACHE_BLOCKS,
            ..Default::default()
        },
    )
    .unwrap();
    let hot = &small[..50];
    // The workload's working set: hot files read twice (the second from memory), every
    // small file's inode looked at.
    for _ in 0..2 {
        for &ino in hot {
            assert_eq!(fs.read(ino, 0, 8192).unwrap().len(), 8192);
        }
    }
    let waits_cold = fs.device_wait_stats().waits;
    for &ino in &small {
        fs.stat(ino).unwrap();
    }
    assert!(
        fs.device_wait_stats().waits > waits_cold,
        "the first stats read nodes from the device (the counter counts them)"
    );
    let mut at = 0u64;
    let mut round = 0usize;
    while at < big_bytes {
        assert_eq!(fs.read(big, at, 1 << 20).unwrap().len(), 1 << 20);
        at += 1 << 20;
        // The small-file workload, between the stream's reads.
        let (_, device_before) = fs.data_cache_hits();
        let waits_before = fs.device_wait_stats().waits;
        for k in 0..10 {
            let i = (round * 10 + k) % hot.len();
            assert_eq!(fs.read(hot[i], 0, 8192).unwrap(), vec![i as u8; 8192]);
        }
        for k in 0..40 {
            fs.stat(small[(round * 40 + k) % small.len()]).unwrap();
        }
        let (_, device_after) = fs.data_cache_hits();
        assert_eq!(
            device_after, device_before,
            "after {at} bytes streamed, a hot file was read from the device"
        );
        assert_eq!(
            fs.device_wait_stats().waits,
            waits_before,
            "after {at} bytes streamed, a stat waited for the device"
        );
        round += 1;
    }
    let stats = fs.read_stats();
    assert!(
        stats.ahead_blocks > 0,
        "the stream was read ahead: {stats:?}"
    );
    fs.unmount().unwrap();
}

/// A streaming write (256 KiB or more) is staged but not copied into the cache, and it reads
/// back right before and after it reaches the device; a small write is cached. An earlier
/// use of the same disk blocks, cached, is never served in place of the new data.
#[test]
fn streaming_writes_bypass_the_cache_and_read_back_right() {
    let mut fs = Filesystem::mount(mem(), MountOptions::default()).unwrap();
    let root = fs.root();
    let old = fs.create(root, b"old", 0o644, 0, 0).unwrap().ino;
    fs.write(old, 0, &[1u8; 64 << 10]).unwrap();
    assert_eq!(fs.read(old, 0, 64 << 10).unwrap(), vec![1u8; 64 << 10]);
    // Its blocks freed, committed and unpinned: the big write may take them.
    fs.unlink(root, b"old").unwrap();
    fs.sync().unwrap();
    fs.sync().unwrap();
    let held = fs.data_cache_held();
    let big = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    let data: Vec<u8> = (0..(1 << 20)).map(|i| (i % 253) as u8).collect();
    fs.write(big, 0, &data).unwrap();
    assert!(
        fs.data_cache_held() <= held,
        "a 1 MiB write added blocks to the cache: {held} -> {}",
        fs.data_cache_held()
    );
    assert_eq!(
        fs.read(big, 0, data.len()).unwrap(),
        data,
        "read back while staged"
    );
    fs.sync().unwrap();
    assert_eq!(
        fs.read(big, 0, data.len()).unwrap(),
        data,
        "read back once written"
    );
    let remounted = Filesystem::mount(fs.unmount().unwrap(), MountOptions::default());
    let mut fs = remounted.unwrap();
    assert_eq!(
        fs.read(big, 0, data.len()).unwrap(),
        data,
        "read back after a remount"
    );
    // A small write is cached: two more blocks held.
    let small = fs.create(root, b"small", 0o644, 0, 0).unwrap().ino;
    let held = fs.data_cache_held();
    fs.write(small, 0, &[9u8; 8192]).unwrap();
    assert_eq!(fs.data_cache_held(), held + 2);
    fs.unmount().unwrap();
}
