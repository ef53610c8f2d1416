//! Device backends, one file each:
//! - [`passthrough`]: NVMe commands straight to the controller through io_uring `URING_CMD` on
//!   the generic char device `/dev/ngXnY` (no block layer, no page cache).
//! - [`uring_file`]: io_uring on a regular file or block device with `O_DIRECT`; the default for a
//!   file-backed image.
//! - [`mem`]: a RAM device, for tests and for measuring pure software cost.
//!
//! [`slots`] is the bounded in-flight table both io_uring backends share.

pub mod mem;
pub mod passthrough;
pub(crate) mod ring;
pub(crate) mod slots;
pub mod uring_file;

pub use mem::MemDevice;
pub use passthrough::PassthroughDevice;
pub use uring_file::FileDevice;
