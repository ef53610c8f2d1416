//! Device backends, one file each:
//! - [`passthrough`]: NVMe commands straight to the controller through io_uring `URING_CMD` on
//!   the generic char device `/dev/ngXnY` (no block layer, no page cache).
//! - [`uring_file`]: io_uring on a regular file or block device with `O_DIRECT`; the default for a
//!   file-backed image.
//! - [`mem`]: a RAM device, for tests and for measuring pure software cost.
//!
//! [`slots`] is the bounded in-flight table both io_uring backends share, [`ring`] their ring
//! and fail-stop handling, and [`admit`] the checks every backend makes before it queues a
//! request.

pub mod mem;
pub mod passthrough;
pub(crate) mod ring;
pub(crate) mod slots;
pub mod uring_file;

use crate::{validate, DevError, DeviceInfo, DmaPool, IoOp};

pub use mem::MemDevice;
pub use passthrough::PassthroughDevice;
pub use uring_file::FileDevice;

/// What a queue knows of itself when a request arrives, for [`admit`].
#[derive(Debug, Default)]
pub(crate) struct Gate<'a> {
    /// The error the queue failed with, if it has (fail-stop: it refuses everything after).
    pub failed: Option<&'a DevError>,
    /// As many requests are in flight as the queue holds.
    pub full: bool,
    /// Opened read-shared: writes are refused.
    pub read_only: bool,
    /// Out-of-range LBAs go on to the device (only to test a controller's own range check).
    pub ranges_unchecked: bool,
}

/// Whether a backend may queue `op`, checked in the order every backend reports a refusal: a
/// failed queue stays failed, a full one refuses with `QueueFull`, then the request itself
/// ([`validate`]: buffer, length, range), then a write to a read-only queue (`EROFS`).
#[inline]
pub(crate) fn admit(
    gate: &Gate,
    info: &DeviceInfo,
    pool: &DmaPool,
    op: &IoOp,
) -> Result<(), DevError> {
    if let Some(failed) = gate.failed {
        return Err(failed.clone());
    }
    if gate.full {
        return Err(DevError::QueueFull);
    }
    match validate(info, pool, op) {
        Err(DevError::OutOfRange { .. }) if gate.ranges_unchecked => {}
        other => other?,
    }
    if gate.read_only {
        crate::refuse_writes(op)?;
    }
    Ok(())
}
