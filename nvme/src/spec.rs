//! Device strings, accepted the same way by every tool and by the C ABI:
//!
//! - `nvme:/dev/ng0n1` — NVMe passthrough on the generic char device;
//! - `file:PATH` — io_uring with O_DIRECT on a file or block device;
//! - `mem:1GiB` — a RAM device.
//!
//! Options follow the path after commas: `file:/srv/corefs.img,size=1GiB,qd=64,sqpoll=2000`.
//! `size=` (file: create/grow; mem: capacity), `lba=` (512..4096, file and mem), `qd=` (queue
//! depth), `buf=` (DMA buffer size = largest I/O), `bufs=` (buffers in the pool), `sqpoll[=MS]`,
//! `iopoll=auto|on|off` (nvme), `hugepages=on|off`, `cache=volatile` (simulated volatile
//! write cache: a killed process is a power cut), `flushdelay=US` (its flushes and FUA writes
//! take effect that many microseconds after submission, at their completion). Sizes take K, M, G, T suffixes with optional
//! `iB`/`B`, all binary (1K = 1024).

use crate::backend::mem::MemConfig;
use crate::backend::passthrough::{IoPoll, PassthroughConfig};
use crate::backend::uring_file::FileConfig;
use crate::backend::{FileDevice, MemDevice, PassthroughDevice};
use crate::dma::HugepagePolicy;
use crate::{BlockDevice, DevError};
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    Nvme { path: PathBuf },
    File { path: PathBuf },
    Mem,
}

/// Everything a device string can set, with defaults suited to a file-backed image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenOptions {
    /// Capacity of a `mem:` device, or the size to create/grow a `file:` image to.
    pub size_bytes: Option<u64>,
    pub lba_size_bytes: u32,
    pub queue_depth: u32,
    pub buf_bytes: usize,
    pub buf_count: u32,
    pub sqpoll_idle_ms: Option<u32>,
    pub iopoll: IoPoll,
    pub hugepages: HugepagePolicy,
    /// `cache=volatile`: simulate a volatile write cache ([`crate::wrap::volatile`]), so that
    /// killing the process loses exactly the unflushed writes (crash testing).
    pub volatile_cache: bool,
    /// `flushdelay=MICROSECONDS` (with `cache=volatile`): a flush or FUA write takes effect
    /// (and completes) no earlier than this after it was submitted, widening the window in
    /// which a kill -9 catches an fsync acknowledged before its flush completed.
    pub flush_delay_us: u64,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            size_bytes: None,
            lba_size_bytes: 4096,
            queue_depth: 128,
            buf_bytes: 128 << 10,
            buf_count: 256,
            sqpoll_idle_ms: None,
            iopoll: IoPoll::Auto,
            hugepages: HugepagePolicy::Prefer,
            volatile_cache: false,
            flush_delay_us: 0,
        }
    }
}

impl DeviceSpec {
    /// Parses a device string; options in it override `defaults`.
    pub fn parse(
        spec: &str,
        defaults: &OpenOptions,
    ) -> Result<(DeviceSpec, OpenOptions), DevError> {
        let bad = |why: String| DevError::BadSpec {
            spec: spec.to_string(),
            why,
        };
        let (scheme, rest) = spec
            .split_once(':')
            .ok_or_else(|| bad("expected nvme:/dev/ngXnY, file:PATH or mem:SIZE".into()))?;
        let mut parts = rest.split(',');
        let target = parts.next().unwrap_or_default();
        let mut options = defaults.clone();
        for option in parts {
            let (key, value) = option.split_once('=').unwrap_or((option, ""));
            let number = |v: &str| {
                v.parse::<u32>()
                    .map_err(|_| bad(format!("{key}={v} is not a number")))
            };
            match key {
                "size" => options.size_bytes = Some(parse_size(value).map_err(bad)?),
                "lba" => options.lba_size_bytes = parse_size(value).map_err(bad)? as u32,
                "qd" => options.queue_depth = number(value)?,
                "buf" => options.buf_bytes = parse_size(value).map_err(bad)? as usize,
                "bufs" => options.buf_count = number(value)?,
                "sqpoll" => {
                    options.sqpoll_idle_ms = Some(if value.is_empty() {
                        1000
                    } else {
                        number(value)?
                    })
                }
                "iopoll" => {
                    options.iopoll = match value {
                        "auto" => IoPoll::Auto,
                        "on" => IoPoll::On,
                        "off" => IoPoll::Off,
                        _ => return Err(bad(format!("iopoll={value}: use auto, on or off"))),
                    }
                }
                "hugepages" => {
                    options.hugepages = match value {
                        "on" => HugepagePolicy::Prefer,
                        "off" => HugepagePolicy::Never,
                        _ => return Err(bad(format!("hugepages={value}: use on or off"))),
                    }
                }
                "cache" => {
                    options.volatile_cache = match value {
                        "volatile" => true,
                        "none" => false,
                        _ => return Err(bad(format!("cache={value}: use volatile or none"))),
                    }
                }
                "flushdelay" => {
                    let us: u64 = value
                        .parse()
                        .ok()
                        .filter(|&us| us <= 1_000_000)
                        .ok_or_else(|| {
                            bad(format!("flushdelay={value}: microseconds, at most 1000000"))
                        })?;
                    options.flush_delay_us = us;
                }
                _ => return Err(bad(format!("unknown option {key:?}"))),
            }
        }
        if !options.lba_size_bytes.is_power_of_two()
            || !(512..=4096).contains(&options.lba_size_bytes)
        {
            return Err(bad(format!(
                "lba={} must be 512, 1024, 2048 or 4096",
                options.lba_size_bytes
            )));
        }
        if options.buf_bytes == 0 || options.buf_bytes % 4096 != 0 {
            return Err(bad(format!(
                "buf={} must be a multiple of 4 KiB",
                options.buf_bytes
            )));
        }
        if options.queue_depth == 0 || options.queue_depth > 4096 || options.buf_count == 0 {
            return Err(bad("qd must be 1..4096 and bufs at least 1".into()));
        }
        let device = match scheme {
            "nvme" if target.is_empty() => {
                return Err(bad("give the char device: nvme:/dev/ng0n1".into()))
            }
            "nvme" => DeviceSpec::Nvme {
                path: target.into(),
            },
            "file" if target.is_empty() => {
                return Err(bad("give a path: file:/path/to/image".into()))
            }
            "file" => DeviceSpec::File {
                path: target.into(),
            },
            "mem" => {
                if !target.is_empty() {
                    options.size_bytes = Some(parse_size(target).map_err(bad)?);
                }
                if options.size_bytes.is_none() {
                    return Err(bad("give a size: mem:1GiB".into()));
                }
                DeviceSpec::Mem
            }
            other => {
                return Err(bad(format!(
                    "unknown backend {other:?}: use nvme, file or mem"
                )))
            }
        };
        Ok((device, options))
    }
}

/// Opens a device string with `defaults` for whatever the string does not set.
pub fn open_device(spec: &str, defaults: &OpenOptions) -> Result<Box<dyn BlockDevice>, DevError> {
    let (device, o) = DeviceSpec::parse(spec, defaults)?;
    let dev: Box<dyn BlockDevice> = match device {
        DeviceSpec::Nvme { path } => Box::new(PassthroughDevice::open(
            &path,
            &PassthroughConfig {
                queue_depth: o.queue_depth,
                buf_bytes: o.buf_bytes,
                buf_count: o.buf_count,
                iopoll: o.iopoll,
                hugepages: o.hugepages,
                check_ranges: true,
                register_buffers: true,
            },
        )?),
        DeviceSpec::File { path } => Box::new(FileDevice::open(
            &path,
            &FileConfig {
                create_bytes: o.size_bytes,
                lba_size_bytes: o.lba_size_bytes,
                queue_depth: o.queue_depth,
                buf_bytes: o.buf_bytes,
                buf_count: o.buf_count,
                sqpoll_idle_ms: o.sqpoll_idle_ms,
                hugepages: o.hugepages,
            },
        )?),
        DeviceSpec::Mem => Box::new(MemDevice::new(MemConfig {
            capacity_bytes: o.size_bytes.expect("parse requires a mem size"),
            lba_size_bytes: o.lba_size_bytes,
            queue_depth: o.queue_depth,
            buf_bytes: o.buf_bytes,
            buf_count: o.buf_count,
        })?),
    };
    Ok(if o.volatile_cache {
        Box::new(crate::wrap::VolatileCacheDevice::with_flush_delay(
            dev,
            std::time::Duration::from_micros(o.flush_delay_us),
        ))
    } else {
        dev
    })
}

/// Parses `4096`, `64K`, `128KiB`, `1GiB`, `2g`, `1TB` (binary multiples).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use K, M, G, T)")),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Formats a byte count the way `parse_size` reads it back: `64MiB`, `4096`.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        for (text, bytes) in [
            ("4096", 4096),
            ("64K", 65536),
            ("1GiB", 1 << 30),
            ("2g", 2 << 30),
            ("3MB", 3 << 20),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
        }
        assert!(parse_size("12X").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn device_strings_parse_with_options() {
        let d = OpenOptions::default();
        let (spec, o) = DeviceSpec::parse("file:/tmp/a.img,size=1GiB,qd=32,sqpoll", &d).unwrap();
        assert_eq!(
            spec,
            DeviceSpec::File {
                path: "/tmp/a.img".into()
            }
        );
        assert_eq!(o.size_bytes, Some(1 << 30));
        assert_eq!(o.queue_depth, 32);
        assert_eq!(o.sqpoll_idle_ms, Some(1000));
        let (spec, o) = DeviceSpec::parse("mem:64MiB,lba=512", &d).unwrap();
        assert_eq!(spec, DeviceSpec::Mem);
        assert_eq!((o.size_bytes, o.lba_size_bytes), (Some(64 << 20), 512));
        let (spec, o) = DeviceSpec::parse("nvme:/dev/ng0n1,iopoll=off", &d).unwrap();
        assert_eq!(
            spec,
            DeviceSpec::Nvme {
                path: "/dev/ng0n1".into()
            }
        );
        assert_eq!(o.iopoll, IoPoll::Off);
        for bad in [
            "ng0n1",
            "disk:/x",
            "mem:",
            "file:",
            "mem:1G,lba=300",
            "file:/x,qd=zero",
            "file:/x,wat=1",
            "nvme:",
        ] {
            let err = DeviceSpec::parse(bad, &d).unwrap_err();
            assert!(matches!(err, DevError::BadSpec { .. }), "{bad}: {err}");
        }
    }
}
