//! Entry points for fuzzing (the `fuzz/` cargo-fuzz targets and the seeded regression test in
//! `engine/tests/fuzz_inputs.rs` call these): whatever the bytes, the engine must answer with
//! a value or an error — never panic, hang, or read out of bounds.
//!
//! - [`mount_image`]: mount, check and read back an image built from the bytes: either the
//!   bytes themselves as a whole image, or a valid image (with files, directories and fsync log
//!   records waiting for replay) patched by them, which reaches far deeper than random bytes;
//! - [`log_record`]: the record decoder on raw bytes, and those bytes placed in a shard's log
//!   area of a valid image, so mount's replay reads them;
//! - [`structured_image`]: a valid image with one tree node, superblock or log record
//!   mutated field by field and re-checksummed (with the pointers above it), so the mutation
//!   gets past crc32c to the structure checks and the code behind them.

use crate::fs::{Filesystem, MkfsOptions, MountOptions};
use crate::log::record::{decode_header, decode_record};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::BlockDevice;
use std::sync::OnceLock;

mod structured;
pub use structured::structured_image;

/// Size of the template images: small, so an iteration is cheap.
pub const IMAGE_BYTES: usize = 2 << 20;

fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: IMAGE_BYTES as u64,
        lba_size_bytes: 4096,
        queue_depth: 32,
        buf_bytes: 128 << 10,
        buf_count: 32,
    }
}

fn image_of(mut dev: Box<dyn BlockDevice>) -> Vec<u8> {
    let mut image = vec![0u8; IMAGE_BYTES];
    nvme::read_sync(&mut *dev, 0, &mut image).expect("reading a memory device");
    image
}

/// A valid image: 2 shards, files with data, a directory, a symlink, an xattr, committed;
/// then an append and a rename fsynced without a commit, so two log records wait for replay.
pub fn template() -> &'static [u8] {
    static TEMPLATE: OnceLock<Vec<u8>> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dev = MemDevice::new(config()).expect("memory device");
        let dev = Filesystem::mkfs(
            Box::new(dev),
            &MkfsOptions {
                shards: 2,
                label: "fuzz".into(),
                ..Default::default()
            },
        )
        .expect("mkfs");
        let mut fs = Filesystem::mount(dev, MountOptions::default()).expect("mount");
        let root = fs.root();
        let dir = fs.mkdir(root, b"dir", 0o755, 0, 0).expect("mkdir").ino;
        let a = fs.create(root, b"a", 0o644, 0, 0).expect("create").ino;
        fs.write(a, 0, &[0xa5; 9000]).expect("write");
        let b = fs.create(dir, b"b", 0o644, 0, 0).expect("create").ino;
        fs.write(b, 0, b"small file").expect("write");
        fs.symlink(root, b"s", b"dir/b", 0, 0).expect("symlink");
        fs.setxattr(a, b"user.k", b"v", crate::XattrFlags::Any)
            .expect("setxattr");
        fs.commit().expect("commit");
        fs.write(a, 9000, &[0x5a; 5000]).expect("append");
        fs.fsync(a).expect("fsync");
        fs.rename(dir, b"b", root, b"b2", Default::default())
            .expect("rename");
        fs.fsync(b).expect("fsync");
        image_of(fs.into_device())
    })
}

/// Mounts `image`, and if that works checks it and reads everything reachable.
fn exercise(image: &[u8]) {
    let Ok(dev) = MemDevice::from_image(image, config()) else {
        return;
    };
    let Ok(mut fs) = Filesystem::mount(Box::new(dev), MountOptions::default()) else {
        return;
    };
    let _ = fs.check();
    let _ = fs.check_data(&mut |_, _| {});
    // Walk the namespace from the root, bounded.
    let mut stack = vec![fs.root()];
    let mut visited = 0;
    while let Some(dir) = stack.pop() {
        visited += 1;
        if visited > 64 {
            break;
        }
        let Ok(entries) = fs.readdir(dir, 0, 64) else {
            continue;
        };
        for e in entries {
            match fs.stat(e.ino) {
                Ok(st) if st.is_dir() => stack.push(e.ino),
                Ok(_) => {
                    let _ = fs.read(e.ino, 0, 1 << 16);
                    let _ = fs.readlink(e.ino);
                    let _ = fs.listxattr(e.ino);
                }
                Err(_) => {}
            }
        }
    }
    // And a change, which a damaged filesystem must refuse or survive.
    if let Ok(st) = fs.create(fs.root(), b"new", 0o644, 0, 0) {
        let _ = fs.write(st.ino, 0, b"new data");
        let _ = fs.fsync(st.ino);
    }
    let _ = fs.commit();
}

/// Mount and check of an image made from `bytes` (see the module comment).
pub fn mount_image(bytes: &[u8]) {
    let Some((&mode, rest)) = bytes.split_first() else {
        return;
    };
    if mode % 4 == 0 {
        // The bytes are the image (repeated to its size).
        let mut image = vec![0u8; IMAGE_BYTES];
        if !rest.is_empty() {
            for (i, b) in image.iter_mut().enumerate() {
                *b = rest[i % rest.len()];
            }
        }
        exercise(&image);
    } else {
        // Patches to the template: (block: u16, offset: u16, len: u8, bytes...) repeated.
        let mut image = template().to_vec();
        let blocks = (IMAGE_BYTES / 4096) as u64;
        let mut at = rest;
        while at.len() >= 5 {
            let block = u16::from_le_bytes([at[0], at[1]]) as u64 % blocks;
            let offset = u16::from_le_bytes([at[2], at[3]]) as usize % 4096;
            let len = (at[4] as usize).min(at.len() - 5);
            let start = block as usize * 4096 + offset;
            for (i, &b) in at[5..5 + len].iter().enumerate() {
                if let Some(slot) = image.get_mut(start + i) {
                    *slot = b;
                }
            }
            at = &at[5 + len..];
        }
        exercise(&image);
    }
}

/// The record decoder on `bytes`, then the bytes as shard 0's log area of the template.
pub fn log_record(bytes: &[u8]) {
    let _ = decode_header(bytes);
    let _ = decode_record(bytes);
    let mut image = template().to_vec();
    let sb = crate::inspect::superblocks(
        &mut MemDevice::from_image(&image, config()).expect("template device"),
    )
    .into_iter()
    .filter_map(|(_, s)| s.ok())
    .max_by_key(|s| s.generation)
    .expect("the template has a superblock");
    let start = sb.region_start(0) as usize * 4096;
    let area = sb.log_blocks as usize * 4096;
    let n = bytes.len().min(area);
    image[start..start + n].copy_from_slice(&bytes[..n]);
    exercise(&image);
}
