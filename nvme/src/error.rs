//! Device errors. Every errno and every NVMe status a backend can see is mapped here explicitly,
//! so an error message names what the device said (`EIO`, `NVMe LBA Out of Range (sct 0 sc 0x80)`)
//! instead of a bare number.
//!
//! Invariant: `DevError` is plain data (Clone, PartialEq) so it can travel inside completions,
//! be compared in tests and be made sticky by the engine without reference counting.

use crate::OpKind;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevError {
    #[error("queue full: as many requests are in flight as the queue depth allows")]
    QueueFull,
    #[error("DMA buffer pool exhausted: release buffers or raise the pool size")]
    PoolExhausted,
    #[error("buffer does not belong to this queue's registered DMA pool")]
    ForeignBuffer,
    #[error("shared write piece at {addr:#x}, {len_bytes} bytes, is not aligned to {lba_size_bytes}-byte LBAs in memory and length")]
    Misaligned {
        addr: usize,
        len_bytes: usize,
        lba_size_bytes: u32,
    },
    #[error("transfer of {len_bytes} bytes is not a whole number of {lba_size_bytes}-byte LBAs between 1 LBA and {max_io_bytes} bytes")]
    BadLength {
        len_bytes: u64,
        lba_size_bytes: u32,
        max_io_bytes: u32,
    },
    #[error("LBA range {lba}+{lbas} is outside the device ({capacity_lbas} LBAs)")]
    OutOfRange {
        lba: u64,
        lbas: u64,
        capacity_lbas: u64,
    },
    #[error("{op} failed: {} ({})", errno_name(*errno), errno_text(*errno))]
    Io { op: OpKind, errno: i32 },
    #[error("{op} transferred {got_bytes} of {expected_bytes} bytes")]
    ShortTransfer {
        op: OpKind,
        expected_bytes: u32,
        got_bytes: u32,
    },
    #[error("{op} failed with {status}")]
    Nvme { op: OpKind, status: NvmeStatus },
    #[error("{op} failed: injected fault ({fault})")]
    Injected { op: OpKind, fault: &'static str },
    #[error("{what} is not supported by this device or kernel")]
    Unsupported { what: &'static str },
    #[error("the device queue has failed ({}) and takes no more requests", errno_name(*errno))]
    QueueFailed { errno: i32 },
    #[error("{what}: {} ({}){}", errno_name(*errno), errno_text(*errno), hint_suffix(hint))]
    Setup {
        what: String,
        errno: i32,
        hint: String,
    },
    #[error("bad device string {spec:?}: {why}")]
    BadSpec { spec: String, why: String },
    /// Another open for writing holds the device ([`crate::lock`]): a second writer would
    /// destroy the first one's data.
    #[error(
        "{device} is in use ({holder}): another corefs mount, mkfs or fsck has it open for \
         writing, and two writers would destroy each other's data. Stop that one first; \
         `corefs dump` and `corefs fsck -n` read it without writing"
    )]
    Busy { device: String, holder: String },
}

fn hint_suffix(hint: &str) -> String {
    if hint.is_empty() {
        String::new()
    } else {
        format!(". {hint}")
    }
}

impl DevError {
    pub fn setup(what: impl Into<String>, err: &std::io::Error, hint: impl Into<String>) -> Self {
        DevError::Setup {
            what: what.into(),
            errno: err.raw_os_error().unwrap_or(libc::EIO),
            hint: hint.into(),
        }
    }

    /// True for errors the device reported about data or media (as opposed to a request the
    /// queue refused). These make a corefs shard fail-stop.
    pub fn is_device_failure(&self) -> bool {
        matches!(
            self,
            DevError::Io { .. }
                | DevError::ShortTransfer { .. }
                | DevError::Nvme { .. }
                | DevError::Injected { .. }
                | DevError::QueueFailed { .. }
        )
    }
}

/// The symbolic name of an errno. Every errno a block device path can return through io_uring
/// is listed; anything else prints as `errno N`.
pub fn errno_name(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::ENOTTY => "ENOTTY",
        libc::ENOSYS => "ENOSYS",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECANCELED => "ECANCELED",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::EILSEQ => "EILSEQ",
        libc::EREMOTEIO => "EREMOTEIO",
        libc::ENOLINK => "ENOLINK",
        libc::EBADMSG => "EBADMSG",
        libc::ENODATA => "ENODATA",
        libc::ENOTBLK => "ENOTBLK",
        libc::ETXTBSY => "ETXTBSY",
        libc::EMFILE => "EMFILE",
        libc::ENFILE => "ENFILE",
        libc::EDQUOT => "EDQUOT",
        _ => return format!("errno {errno}"),
    };
    name.to_string()
}

fn errno_text(errno: i32) -> String {
    std::io::Error::from_raw_os_error(errno).to_string()
}

/// An NVMe completion status as the Linux passthrough path returns it in `cqe.res`: the 15-bit
/// status field (SC bits 0–7, SCT bits 8–10, CRD bits 11–12, More bit 13, DNR bit 14).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    pub fn status_code(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    pub fn status_code_type(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }
    pub fn do_not_retry(self) -> bool {
        self.0 & 0x4000 != 0
    }

    /// The specification's name for this status (NVMe Base Specification 2.0, figures 100–106
    /// and the NVM Command Set's additions).
    pub fn name(self) -> &'static str {
        match (self.status_code_type(), self.status_code()) {
            (0, 0x00) => "Successful Completion",
            (0, 0x01) => "Invalid Command Opcode",
            (0, 0x02) => "Invalid Field in Command",
            (0, 0x03) => "Command ID Conflict",
            (0, 0x04) => "Data Transfer Error",
            (0, 0x05) => "Commands Aborted due to Power Loss Notification",
            (0, 0x06) => "Internal Error",
            (0, 0x07) => "Command Abort Requested",
            (0, 0x08) => "Command Aborted due to SQ Deletion",
            (0, 0x09) => "Command Aborted due to Failed Fused Command",
            (0, 0x0a) => "Command Aborted due to Missing Fused Command",
            (0, 0x0b) => "Invalid Namespace or Format",
            (0, 0x0c) => "Command Sequence Error",
            (0, 0x0d) => "Invalid SGL Segment Descriptor",
            (0, 0x0f) => "Invalid SGL Descriptor Type",
            (0, 0x15) => "Invalid Use of Controller Memory Buffer",
            (0, 0x19) => "SGL Offset Invalid",
            (0, 0x1d) => "Sanitize In Progress",
            (0, 0x20) => "Namespace is Write Protected",
            (0, 0x21) => "Command Interrupted",
            (0, 0x22) => "Transient Transport Error",
            (0, 0x80) => "LBA Out of Range",
            (0, 0x81) => "Capacity Exceeded",
            (0, 0x82) => "Namespace Not Ready",
            (0, 0x83) => "Reservation Conflict",
            (0, 0x84) => "Format In Progress",
            (1, 0x80) => "Conflicting Attributes",
            (1, 0x81) => "Invalid Protection Information",
            (1, 0x82) => "Attempted Write to Read Only Range",
            (1, 0x83) => "Command Size Limit Exceeded",
            (1, 0xb8) => "Zoned Boundary Error",
            (2, 0x80) => "Write Fault",
            (2, 0x81) => "Unrecovered Read Error",
            (2, 0x82) => "End-to-end Guard Check Error",
            (2, 0x83) => "End-to-end Application Tag Check Error",
            (2, 0x84) => "End-to-end Reference Tag Check Error",
            (2, 0x85) => "Compare Failure",
            (2, 0x86) => "Access Denied",
            (2, 0x87) => "Deallocated or Unwritten Logical Block",
            (3, 0x00) => "Internal Path Error",
            (3, 0x01) => "Asymmetric Access Persistent Loss",
            (3, 0x02) => "Asymmetric Access Inaccessible",
            (3, 0x03) => "Asymmetric Access Transition",
            (3, 0x60) => "Controller Pathing Error",
            (3, 0x70) => "Host Pathing Error",
            (3, 0x71) => "Command Aborted By Host",
            (7, _) => "Vendor Specific",
            _ => "Unknown Status",
        }
    }
}

impl std::fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVMe {} (sct {} sc {:#04x}{})",
            self.name(),
            self.status_code_type(),
            self.status_code(),
            if self.do_not_retry() { ", DNR" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvme_status_names_lba_out_of_range() {
        let status = NvmeStatus(0x4080);
        assert_eq!(status.status_code(), 0x80);
        assert_eq!(status.status_code_type(), 0);
        assert!(status.do_not_retry());
        assert_eq!(
            status.to_string(),
            "NVMe LBA Out of Range (sct 0 sc 0x80, DNR)"
        );
        assert_eq!(NvmeStatus(0x281).name(), "Unrecovered Read Error");
    }

    #[test]
    fn errno_is_named() {
        let err = DevError::Io {
            op: OpKind::Write,
            errno: libc::ENOSPC,
        };
        assert!(err.to_string().starts_with("write failed: ENOSPC"));
        assert_eq!(errno_name(4242), "errno 4242");
    }
}
