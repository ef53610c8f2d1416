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
