//! The bounds a device's geometry and queue options must keep, and how sizes are written:
//! checked by the device strings' parser (`crate::spec`) and by each backend as it opens, so
//! that neither needs the other.

/// Smallest `size=`: one 4 KiB block.
pub const SIZE_BYTES_MIN: u64 = 4096;
/// Largest `size=`: 1 EiB, far past any device, and small enough that byte offsets computed
/// from it cannot overflow.
pub const SIZE_BYTES_MAX: u64 = 1 << 60;
/// Largest `qd=`: the ring has a slot per request, and io_uring allows 32768 entries.
pub const QUEUE_DEPTH_MAX: u32 = 4096;
/// Largest `sqpoll=` idle time: a minute of a kernel thread spinning on nothing is already
/// more than any use of it wants.
pub const SQPOLL_IDLE_MS_MAX: u32 = 60_000;

/// `lba=`: 512, 1024, 2048 or 4096 (u64, so that no value is truncated before the check).
pub fn check_lba_size(lba_size_bytes: u64) -> Result<u32, String> {
    if lba_size_bytes.is_power_of_two() && (512..=4096).contains(&lba_size_bytes) {
        Ok(lba_size_bytes as u32)
    } else {
        Err(format!(
            "lba={lba_size_bytes} must be 512, 1024, 2048 or 4096"
        ))
    }
}

/// `qd=`: 1 to [`QUEUE_DEPTH_MAX`].
pub fn check_queue_depth(queue_depth: u64) -> Result<u32, String> {
    if (1..=QUEUE_DEPTH_MAX as u64).contains(&queue_depth) {
        Ok(queue_depth as u32)
    } else {
        Err(format!("qd={queue_depth} must be 1..{QUEUE_DEPTH_MAX}"))
    }
}

/// `sqpoll=MS`: 1 to [`SQPOLL_IDLE_MS_MAX`].
pub fn check_sqpoll_idle_ms(ms: u64) -> Result<u32, String> {
    if (1..=SQPOLL_IDLE_MS_MAX as u64).contains(&ms) {
        Ok(ms as u32)
    } else {
        Err(format!("sqpoll={ms} must be 1..{SQPOLL_IDLE_MS_MAX} ms"))
    }
}

/// Formats a byte count the way `parse_size` reads it back: `64MiB`, `4096`.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [
        (60, "EiB"),
        (40, "TiB"),
        (30, "GiB"),
        (20, "MiB"),
        (10, "KiB"),
    ] {
        if bytes >= 1 << shift && bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}
