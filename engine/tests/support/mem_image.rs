//! A 64 MiB memory device with 512-byte LBAs, and the whole image of one: what the log and
//! atomic-batch tests format, record, cut and mount again. Shared by `#[path]` (each test
//! file is its own crate).

use nvme::backend::mem::MemConfig;
use nvme::BlockDevice;

pub const CAPACITY: u64 = 64 << 20;

pub fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: CAPACITY,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 64,
    }
}

/// Every byte of `dev` (a device of [`CAPACITY`]).
pub fn image_of(mut dev: Box<dyn BlockDevice>) -> Vec<u8> {
    let mut image = vec![0u8; CAPACITY as usize];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    image
}
