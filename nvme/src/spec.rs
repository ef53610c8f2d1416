//! Device strings, accepted the same way by every tool and by the C ABI:
//!
//! - `nvme:/dev/ng0n1` — NVMe passthrough on the generic char device;
//! - `file:PATH` — io_uring with O_DIRECT on a file or block device;
//! - `mem:1GiB` — a RAM device.
//!
//! Options follow the path after commas: `file:/srv/corefs.img,size=1GiB,qd=64,sqpoll=2000`.
//! `size=` (file: create/grow; mem: capacity; 4KiB..1EiB), `lba=` (512, 1024, 2048 or 4096;
//! file and mem), `qd=` (queue depth, 1..4096), `buf=` (DMA buffer size = largest I/O; a
//! multiple of 4KiB up to 16MiB), `bufs=` (buffers in the pool, 1..16384; buf x bufs at most
//! 1GiB), `sqpoll[=MS]` (1..60000), `iopoll=auto|on|off` (nvme), `hugepages=on|off`,
//! `cache=volatile` (simulated volatile write cache: a killed process is a power cut),
//! `flushdelay=US` (with it: flushes and FUA writes take effect that many microseconds after
//! submission, at their completion; at most 1000000), `prefault` (mem only: back the whole
//! device with memory at open, in transparent hugepages where the kernel gives them, so that
//! no write pays a first-touch page fault; benchmarks measuring software cost use it). Sizes
//! take K, M, G, T suffixes with optional `iB`/`B`, all binary (1K = 1024).
//!
//! `cache=volatile` and `flushdelay=` ask for a simulation wrapper (`crate::wrap::volatile`),
//! which only a build with the `sim` feature has: without it (libcorefs) they are an error
//! naming the feature, never silently dropped, since a test that believes it cuts the power
//! behind a volatile cache must not run against a device that has none.
//!
//! # Invariants
//! - Every value is range-checked when the string is parsed ([`OpenOptions::check`]) and read
//!   as u64 before any narrowing: a bad string is a [`DevError::BadSpec`] naming the option
//!   and its range, never a wrapped product, a truncated value or a panic at open. The
//!   backends check again what reaches them directly (a program filling in a config).
//! - How the device is opened ([`OpenOptions::access`]: exclusive, read-only shared, another
//!   queue) is the program's choice, not the string's ([`crate::lock`]).

use crate::backend::mem::MemConfig;
use crate::backend::passthrough::{IoPoll, PassthroughConfig};
use crate::backend::uring_file::FileConfig;
use crate::backend::{FileDevice, MemDevice, PassthroughDevice};
use crate::dma::HugepagePolicy;
use crate::{Access, BlockDevice, DevError};
use std::path::PathBuf;

pub use crate::limits::{
    check_lba_size, check_queue_depth, check_sqpoll_idle_ms, format_size, QUEUE_DEPTH_MAX,
    SIZE_BYTES_MAX, SIZE_BYTES_MIN, SQPOLL_IDLE_MS_MAX,
};

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
    /// Exclusive (the default: read-write, holding the device's lock), read-only and shared,
    /// or another queue of a device this process holds ([`crate::lock`]). `mem:` devices
    /// ignore it: no other process can open them.
    pub access: Access,
    /// `flushdelay=MICROSECONDS` (with `cache=volatile`): a flush or FUA write takes effect
    /// (and completes) no earlier than this after it was submitted, widening the window in
    /// which a kill -9 catches an fsync acknowledged before its flush completed.
    pub flush_delay_us: u64,
    /// `prefault` (mem only): the device's memory is faulted in at open
    /// ([`MemDevice::prefault`]), so writes measure copies, not the kernel's page faults.
    pub prefault: bool,
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
            access: Access::Exclusive,
            flush_delay_us: 0,
            prefault: false,
        }
    }
}

impl OpenOptions {
    /// Checks every setting against its range. The messages name the device-string option,
    /// since that is where a bad value comes from (a program setting the fields directly gets
    /// the same names).
    pub fn check(&self) -> Result<(), String> {
        if let Some(size) = self.size_bytes {
            if !(SIZE_BYTES_MIN..=SIZE_BYTES_MAX).contains(&size) {
                return Err(format!(
                    "size={size} must be from {} to {}",
                    format_size(SIZE_BYTES_MIN),
                    format_size(SIZE_BYTES_MAX)
                ));
            }
        }
        check_lba_size(self.lba_size_bytes as u64)?;
        check_queue_depth(self.queue_depth as u64)?;
        crate::dma::check_geometry(self.buf_bytes, self.buf_count)?;
        if let Some(ms) = self.sqpoll_idle_ms {
            check_sqpoll_idle_ms(ms as u64)?;
        }
        self.check_sim_options()
    }

    /// The simulation options need the wrappers, which only a `sim` build carries.
    #[cfg(feature = "sim")]
    fn check_sim_options(&self) -> Result<(), String> {
        Ok(())
    }

    /// The simulation options need the wrappers, which only a `sim` build carries: here they
    /// are an error naming the feature, so that nothing runs believing it has a volatile cache.
    #[cfg(not(feature = "sim"))]
    fn check_sim_options(&self) -> Result<(), String> {
        let needs_sim = |option: &str| {
            format!("{option} needs a build with the `sim` feature (test machinery)")
        };
        if self.volatile_cache {
            return Err(needs_sim("cache=volatile"));
        }
        if self.flush_delay_us != 0 {
            return Err(needs_sim(&format!("flushdelay={}", self.flush_delay_us)));
        }
        Ok(())
    }
}

impl DeviceSpec {
    /// Parses a device string; options in it override `defaults`. Every value is checked
    /// against its range here ([`OpenOptions::check`]), so an open never starts with a bad
    /// one.
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
            // Numbers and sizes are read as u64 and range-checked before any narrowing, so
            // that no value wraps or is truncated into a valid-looking one.
            let number = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| bad(format!("{key}={v} is not a number")))
            };
            let size = |v: &str| parse_size(v).map_err(|why| bad(format!("{key}={v}: {why}")));
            match key {
                "size" => options.size_bytes = Some(size(value)?),
                "lba" => options.lba_size_bytes = check_lba_size(size(value)?).map_err(bad)?,
                "qd" => options.queue_depth = check_queue_depth(number(value)?).map_err(bad)?,
                // Narrowed without loss here; ranges (and buf x bufs) are checked below.
                "buf" => {
                    let bytes = size(value)?;
                    options.buf_bytes = usize::try_from(bytes).map_err(|_| {
                        bad(format!(
                            "buf={bytes} must be a multiple of 4KiB from 4KiB to {}",
                            format_size(crate::dma::BUF_BYTES_MAX as u64)
                        ))
                    })?;
                }
                "bufs" => {
                    let count = number(value)?;
                    options.buf_count = u32::try_from(count).map_err(|_| {
                        bad(format!(
                            "bufs={count} must be 1..{}",
                            crate::dma::MAX_BUFFERS
                        ))
                    })?;
                }
                "sqpoll" => {
                    options.sqpoll_idle_ms = Some(if value.is_empty() {
                        1000
                    } else {
                        check_sqpoll_idle_ms(number(value)?).map_err(bad)?
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
                "prefault" => {
                    options.prefault = match value {
                        "" | "on" => true,
                        "off" => false,
                        _ => return Err(bad(format!("prefault={value}: use on or off"))),
                    }
                }
                _ => return Err(bad(format!("unknown option {key:?}"))),
            }
        }
        if options.prefault && scheme != "mem" {
            // The storage of a file or NVMe device is the device's own: nothing to fault in.
            return Err(bad("prefault applies to mem: devices only".into()));
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
                    options.size_bytes = Some(
                        parse_size(target).map_err(|why| bad(format!("mem:{target}: {why}")))?,
                    );
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
        options.check().map_err(bad)?;
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
                access: o.access,
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
                access: o.access,
            },
        )?),
        DeviceSpec::Mem => {
            let dev = MemDevice::new(MemConfig {
                capacity_bytes: o.size_bytes.expect("parse requires a mem size"),
                lba_size_bytes: o.lba_size_bytes,
                queue_depth: o.queue_depth,
                buf_bytes: o.buf_bytes,
                buf_count: o.buf_count,
            })?;
            if o.prefault {
                dev.prefault()?;
            }
            Box::new(dev)
        }
    };
    #[cfg(feature = "sim")]
    let dev: Box<dyn BlockDevice> = if o.volatile_cache {
        Box::new(crate::wrap::VolatileCacheDevice::with_flush_delay(
            dev,
            std::time::Duration::from_micros(o.flush_delay_us),
        ))
    } else {
        dev
    };
    // `check` (in `parse`) refused the wrapper options in a build without them.
    #[cfg(not(feature = "sim"))]
    assert!(!o.volatile_cache && o.flush_delay_us == 0);
    Ok(dev)
}

/// Parses `4096`, `64K`, `128KiB`, `1GiB`, `2g`, `1TB`, `1EiB` (binary multiples); a product
/// past u64 is an error.
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
        "e" | "eb" | "eib" => 60,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use K, M, G, T, E)"
            ))
        }
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
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

    /// Every option out of its range is an error naming the option and its range, at parse
    /// time: the strings below once wrapped `buf * bufs` (a segfault in mkfs and in
    /// corefs_mount), panicked, or were silently truncated (`lba=4294967808` read as 512).
    #[test]
    fn out_of_range_options_are_named_errors() {
        let d = OpenOptions::default();
        let cases: &[(&str, &[&str])] = &[
            (
                "mem:64MiB,buf=9223372036854779904,bufs=2",
                &["buf=", "16MiB"],
            ),
            (
                "mem:64MiB,buf=4096,bufs=18446744073709551615",
                &["bufs=", "1..16384"],
            ),
            ("mem:64MiB,bufs=20000", &["bufs=20000", "1..16384"]),
            ("mem:64MiB,bufs=0", &["bufs=0", "1..16384"]),
            ("mem:64MiB,buf=4G", &["buf=4294967296", "16MiB"]),
            ("mem:64MiB,buf=6000", &["buf=6000", "multiple of 4KiB"]),
            ("mem:64MiB,buf=0", &["buf=0", "multiple of 4KiB"]),
            (
                "mem:64MiB,buf=16MiB,bufs=128",
                &["buf=16777216 x bufs=128", "1GiB"],
            ),
            ("file:/x,buf=1MiB,bufs=1025", &["bufs=1025", "1GiB"]),
            (
                "mem:64MiB,lba=4294967808",
                &["lba=4294967808", "512, 1024, 2048 or 4096"],
            ),
            ("mem:64MiB,lba=8192", &["lba=8192", "4096"]),
            ("mem:64MiB,lba=0", &["lba=0"]),
            ("mem:64MiB,qd=0", &["qd=0", "1..4096"]),
            ("mem:64MiB,qd=4097", &["qd=4097", "1..4096"]),
            ("mem:64MiB,qd=4294967297", &["qd=4294967297", "1..4096"]),
            ("mem:64MiB,qd=", &["qd=", "not a number"]),
            ("file:/x,size=0", &["size=0", "4KiB", "1EiB"]),
            ("file:/x,size=2048", &["size=2048"]),
            ("file:/x,size=2EiB", &["size=2305843009213693952", "1EiB"]),
            ("file:/x,size=1PiB", &["size=", "unknown unit"]),
            (
                "file:/x,size=2000000T",
                &["size=2199023255552000000", "1EiB"],
            ),
            ("file:/x,size=99999999999T", &["size=", "too large"]),
            ("mem:0", &["size=0"]),
            ("mem:99999999999T", &["mem:", "too large"]),
            ("file:/x,sqpoll=0", &["sqpoll=0", "1..60000"]),
            (
                "file:/x,sqpoll=4294967296",
                &["sqpoll=4294967296", "1..60000"],
            ),
            ("file:/x,sqpoll=-1", &["sqpoll=-1", "not a number"]),
            ("nvme:/dev/ng0n1,iopoll=maybe", &["iopoll=maybe"]),
            ("file:/x,hugepages=yes", &["hugepages=yes"]),
            ("file:/x,cache=write-back", &["cache=write-back"]),
            ("file:/x,prefault", &["prefault", "mem: devices only"]),
            (
                "nvme:/dev/ng0n1,prefault=on",
                &["prefault", "mem: devices only"],
            ),
            ("mem:64MiB,prefault=yes", &["prefault=yes", "on or off"]),
        ];
        for (spec, words) in cases {
            let err = DeviceSpec::parse(spec, &d).expect_err(spec);
            assert!(matches!(err, DevError::BadSpec { .. }), "{spec}: {err}");
            let text = err.to_string();
            for w in *words {
                assert!(text.contains(w), "{spec}: {text:?} does not say {w:?}");
            }
        }
        // The edges of each range are accepted.
        for spec in [
            "mem:4KiB,lba=4096,qd=1,buf=4KiB,bufs=1",
            "mem:1EiB,lba=512,qd=4096,buf=16MiB,bufs=64",
            "file:/x,buf=64KiB,bufs=16384,sqpoll=60000,size=1EiB",
        ] {
            DeviceSpec::parse(spec, &d).unwrap_or_else(|e| panic!("{spec}: {e}"));
        }
    }

    /// Without `sim` (libcorefs), the options asking for the simulated volatile cache are an
    /// error naming the option and the feature, from a string and from a program's defaults
    /// alike: a crash test must never run believing it has a volatile cache it lacks. Runs in
    /// `cargo test -p corefs-nvme --no-default-features --lib` (scripts/test.sh).
    #[cfg(not(feature = "sim"))]
    #[test]
    fn simulation_options_are_named_errors_without_sim() {
        let d = OpenOptions::default();
        for (spec, option) in [
            ("mem:64MiB,cache=volatile", "cache=volatile"),
            ("file:/x,cache=volatile,flushdelay=2000", "cache=volatile"),
            ("mem:64MiB,flushdelay=2000", "flushdelay=2000"),
        ] {
            let err = DeviceSpec::parse(spec, &d).expect_err(spec);
            assert!(matches!(err, DevError::BadSpec { .. }), "{spec}: {err}");
            let text = err.to_string();
            for w in [option, "needs a build with the `sim` feature"] {
                assert!(text.contains(w), "{spec}: {text:?} does not say {w:?}");
            }
            let err = open_device(spec, &d).err().expect(spec);
            assert!(err.to_string().contains("`sim`"), "{spec}: {err}");
        }
        let volatile = OpenOptions {
            volatile_cache: true,
            ..OpenOptions::default()
        };
        let err = open_device("mem:64MiB", &volatile)
            .err()
            .expect("volatile defaults");
        assert!(err.to_string().contains("cache=volatile needs"), "{err}");
        // Without them the same strings open.
        DeviceSpec::parse("mem:64MiB,cache=none,flushdelay=0", &d).unwrap();
        open_device("mem:64MiB,cache=none", &d).unwrap();
    }

    /// `prefault` backs a memory device's every page at open (where an unfaulted device has
    /// none resident), and `prefault=off` is the default.
    #[test]
    fn prefault_backs_a_memory_device_at_open() {
        let d = OpenOptions::default();
        let (_, o) = DeviceSpec::parse("mem:8MiB,prefault", &d).unwrap();
        assert!(o.prefault);
        let (_, o) = DeviceSpec::parse("mem:8MiB,prefault=off", &d).unwrap();
        assert!(!o.prefault);
        let config = MemConfig {
            capacity_bytes: 8 << 20,
            ..MemConfig::default()
        };
        let cold = MemDevice::new(config).unwrap();
        assert_eq!(cold.resident_pages().unwrap(), 0, "nothing touched yet");
        let warm = MemDevice::new(config).unwrap();
        warm.prefault().unwrap();
        assert_eq!(warm.resident_pages().unwrap(), (8 << 20) / 4096);
        // Through the device string too: the device opens and serves I/O as before.
        open_device("mem:8MiB,prefault", &d).unwrap();
    }

    /// With `sim`, the same options parse and open a device (the volatile cache).
    #[cfg(feature = "sim")]
    #[test]
    fn simulation_options_open_with_sim() {
        let d = OpenOptions::default();
        let (_, o) = DeviceSpec::parse("mem:64MiB,cache=volatile,flushdelay=2000", &d).unwrap();
        assert!(o.volatile_cache);
        assert_eq!(o.flush_delay_us, 2000);
        open_device("mem:64MiB,cache=volatile,flushdelay=2000", &d).unwrap();
    }
}
