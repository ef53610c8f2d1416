//! The Linux NVMe passthrough ABI (`include/uapi/linux/nvme_ioctl.h`) and the NVMe structures
//! corefs reads (Identify Namespace, Identify Controller), with their layouts checked at
//! compile time. Every on-wire integer is little-endian; x86_64 and aarch64 hosts match.

#![allow(dead_code)]

use std::mem::size_of;

/// `struct nvme_uring_cmd`: the 72-byte command carried in the 80-byte `cmd` area of a 128-byte
/// SQE for `IORING_OP_URING_CMD` with `NVME_URING_CMD_IO`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmeUringCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    /// User address of the data buffer (inside the registered buffer when fixed).
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub rsvd2: u32,
}
const _: () = assert!(size_of::<NvmeUringCmd>() == 72);

impl NvmeUringCmd {
    /// The command as the bytes of the SQE's 80-byte command area (the last 8 bytes unused).
    pub fn to_sqe_cmd(&self) -> [u8; 80] {
        let mut bytes = [0u8; 80];
        // SAFETY: NvmeUringCmd is repr(C), 72 bytes of plain integers with no padding (the
        // const assertion above checks the size matches the sum of its fields).
        let raw = unsafe {
            std::slice::from_raw_parts((self as *const Self).cast::<u8>(), size_of::<Self>())
        };
        bytes[..72].copy_from_slice(raw);
        bytes
    }
}

/// `struct nvme_passthru_cmd` (`nvme_admin_cmd`): the ioctl form, 72 bytes, with `result`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmePassthruCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub result: u32,
}
const _: () = assert!(size_of::<NvmePassthruCmd>() == 72);

/// `_IOWR('N', 0x80, struct nvme_uring_cmd)`.
pub const NVME_URING_CMD_IO: u32 = 0xC048_4E80;
/// `_IO('N', 0x40)`: the namespace id of the opened device.
pub const NVME_IOCTL_ID: libc::c_ulong = 0x4E40;
/// `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
pub const NVME_IOCTL_ADMIN_CMD: libc::c_ulong = 0xC048_4E41;
const _: () = assert!(NVME_URING_CMD_IO == (3 << 30) | (72 << 16) | ((b'N' as u32) << 8) | 0x80);
const _: () =
    assert!(NVME_IOCTL_ADMIN_CMD as u32 == (3 << 30) | (72 << 16) | ((b'N' as u32) << 8) | 0x41);
/// `_IOWR('N', 0x43, struct nvme_passthru_cmd)`: one I/O command, synchronous (the handle
/// beside the queue, [`crate::AnyThreadIo`]).
pub const NVME_IOCTL_IO_CMD: libc::c_ulong = 0xC048_4E43;
const _: () =
    assert!(NVME_IOCTL_IO_CMD as u32 == (3 << 30) | (72 << 16) | ((b'N' as u32) << 8) | 0x43);

pub const NVME_CMD_FLUSH: u8 = 0x00;
pub const NVME_CMD_WRITE: u8 = 0x01;
pub const NVME_CMD_READ: u8 = 0x02;
pub const NVME_CMD_WRITE_ZEROES: u8 = 0x08;
pub const NVME_CMD_DSM: u8 = 0x09;
pub const NVME_ADMIN_IDENTIFY: u8 = 0x06;

/// cdw12 bit 30 of Read/Write/Write Zeroes: Force Unit Access.
pub const CDW12_FUA: u32 = 1 << 30;
/// cdw11 bit 2 of Dataset Management: Attribute – Deallocate.
pub const DSM_ATTR_DEALLOCATE: u32 = 1 << 2;
/// Read, Write and Write Zeroes carry "number of logical blocks − 1" in 16 bits.
pub const MAX_LBAS_PER_CMD: u64 = 1 << 16;

/// One Dataset Management range descriptor (16 bytes; the length is 1-based).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct DsmRange {
    pub context_attributes: u32,
    pub lbas: u32,
    pub start_lba: u64,
}
const _: () = assert!(size_of::<DsmRange>() == 16);

fn le_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}
fn le_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2 bytes"))
}

/// The Identify Namespace fields corefs uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceId {
    /// Namespace size in LBAs (NSZE).
    pub size_lbas: u64,
    /// Bytes per LBA of the formatted LBA format.
    pub lba_size_bytes: u32,
    /// Metadata bytes per LBA of the formatted format (corefs needs 0).
    pub metadata_bytes: u16,
    /// DLFEAT bits 0–2 = 001b: deallocated blocks read as zeroes.
    pub deallocate_reads_zeroes: bool,
}

impl NamespaceId {
    /// Parses an Identify Namespace data structure (CNS 0, 4096 bytes).
    pub fn parse(data: &[u8]) -> Result<NamespaceId, String> {
        if data.len() < 4096 {
            return Err(format!("identify data is {} bytes, not 4096", data.len()));
        }
        let size_lbas = le_u64(data, 0);
        let nlbaf = data[25] as usize + 1;
        let flbas = data[26];
        // FLBAS bits 3:0 are the low bits of the format index, bits 6:5 the high bits.
        let index = (flbas & 0x0f) as usize | (((flbas >> 5) & 0x3) as usize) << 4;
        if index >= nlbaf || index >= 64 {
            return Err(format!(
                "formatted LBA format {index} is outside the {nlbaf} listed"
            ));
        }
        let lbaf = 128 + index * 4;
        let metadata_bytes = le_u16(data, lbaf);
        let lbads = data[lbaf + 2];
        if !(9..=12).contains(&lbads) {
            return Err(format!(
                "LBA data size 2^{lbads} is outside 512..4096 bytes"
            ));
        }
        if size_lbas == 0 {
            return Err("namespace size is zero".into());
        }
        // The size comes from the controller: its byte count must fit the u64 every offset
        // is computed in.
        if size_lbas.checked_mul(1 << lbads).is_none() {
            return Err(format!(
                "namespace size {size_lbas} LBAs of 2^{lbads} bytes overflows 64 bits"
            ));
        }
        Ok(NamespaceId {
            size_lbas,
            lba_size_bytes: 1 << lbads,
            metadata_bytes,
            deallocate_reads_zeroes: data[33] & 0x7 == 0x1,
        })
    }
}

/// The Identify Controller fields corefs uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerId {
    /// Maximum data transfer size as a power of two of the minimum page size (0 = no limit).
    pub mdts: u8,
    pub supports_write_zeroes: bool,
    pub supports_dsm: bool,
    pub volatile_write_cache: bool,
}

impl ControllerId {
    pub fn parse(data: &[u8]) -> Result<ControllerId, String> {
        if data.len() < 4096 {
            return Err(format!("identify data is {} bytes, not 4096", data.len()));
        }
        let oncs = le_u16(data, 520);
        Ok(ControllerId {
            mdts: data[77],
            supports_dsm: oncs & (1 << 2) != 0,
            supports_write_zeroes: oncs & (1 << 3) != 0,
            volatile_write_cache: data[525] & 1 != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identify_namespace_picks_the_formatted_lba_size() {
        let mut data = vec![0u8; 4096];
        data[0..8].copy_from_slice(&16384u64.to_le_bytes());
        data[25] = 1; // two formats
        data[26] = 1; // formatted: index 1
        data[128 + 2] = 9; // format 0: 512 B
        data[132 + 2] = 12; // format 1: 4 KiB
        data[33] = 1;
        let ns = NamespaceId::parse(&data).unwrap();
        assert_eq!(ns.lba_size_bytes, 4096);
        assert_eq!(ns.size_lbas, 16384);
        assert!(ns.deallocate_reads_zeroes);
        data[26] = 0;
        assert_eq!(NamespaceId::parse(&data).unwrap().lba_size_bytes, 512);
        data[26] = 5; // not listed
        assert!(NamespaceId::parse(&data).is_err());
    }

    #[test]
    fn uring_cmd_bytes_follow_the_c_layout() {
        let cmd = NvmeUringCmd {
            opcode: NVME_CMD_WRITE,
            nsid: 1,
            addr: 0x1122_3344_5566_7788,
            data_len: 4096,
            cdw10: 7,
            cdw12: CDW12_FUA,
            ..Default::default()
        };
        let bytes = cmd.to_sqe_cmd();
        assert_eq!(bytes[0], 1);
        assert_eq!(&bytes[4..8], &1u32.to_le_bytes());
        assert_eq!(&bytes[24..32], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&bytes[36..40], &4096u32.to_le_bytes());
        assert_eq!(&bytes[40..44], &7u32.to_le_bytes());
        assert_eq!(&bytes[48..52], &CDW12_FUA.to_le_bytes());
    }
}
