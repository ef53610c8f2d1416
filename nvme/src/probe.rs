//! Start-up probe of the kernel features corefs uses, each with what to do when it is missing.
//! A library never exits: the probe reports, and callers decide (`corefs probe` prints it).

use io_uring::{cqueue, opcode, squeue, IoUring, Probe};

#[derive(Debug, Clone)]
pub struct Feature {
    pub name: &'static str,
    pub available: bool,
    /// What the operator can do when it is not available.
    pub fix: String,
}

#[derive(Debug, Clone)]
pub struct KernelReport {
    pub kernel_release: String,
    pub features: Vec<Feature>,
    pub hugepages_free: u64,
    pub memlock_limit_bytes: Option<u64>,
    pub nvme_generic_devices: Vec<String>,
}

impl KernelReport {
    pub fn feature(&self, name: &str) -> Option<&Feature> {
        self.features.iter().find(|f| f.name == name)
    }
}

pub fn probe() -> KernelReport {
    let kernel_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let mut features = Vec::new();

    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    let ring = IoUring::<squeue::Entry, cqueue::Entry>::new(8);
    features.push(Feature {
        name: "io_uring",
        available: ring.is_ok(),
        fix: match (&ring, disabled) {
            (Ok(_), _) => String::new(),
            (Err(_), 1 | 2) => "io_uring is disabled: sysctl -w kernel.io_uring_disabled=0".into(),
            (Err(e), _) => format!("io_uring unavailable ({e}): Linux 5.19 or later is needed"),
        },
    });

    let mut probe = Probe::new();
    let probed = ring
        .as_ref()
        .map(|r| r.submitter().register_probe(&mut probe).is_ok())
        .unwrap_or(false);
    for (name, code) in [
        ("io_uring READ_FIXED/WRITE_FIXED", opcode::WriteFixed::CODE),
        ("io_uring FSYNC", opcode::Fsync::CODE),
        ("io_uring FALLOCATE", opcode::Fallocate::CODE),
        ("io_uring URING_CMD", opcode::UringCmd80::CODE),
    ] {
        features.push(Feature {
            name,
            available: probed && probe.is_supported(code),
            fix: "upgrade the kernel (URING_CMD for NVMe needs 5.19, fixed buffers with it 6.1)"
                .into(),
        });
    }
    let big = IoUring::<squeue::Entry128, cqueue::Entry32>::builder().build(8);
    features.push(Feature {
        name: "io_uring SQE128/CQE32",
        available: big.is_ok(),
        fix: "NVMe passthrough needs Linux 5.19 or later".into(),
    });
    let coop = IoUring::<squeue::Entry, cqueue::Entry>::builder()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(8);
    features.push(Feature {
        name: "io_uring COOP_TASKRUN",
        available: coop.is_ok(),
        fix: "without it every poll enters the kernel (Linux 5.19 adds it)".into(),
    });

    let hugepages_free =
        std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
    features.push(Feature {
        name: "2 MiB hugepages reserved",
        available: hugepages_free > 0,
        fix: "as root: echo 64 > /proc/sys/vm/nr_hugepages (128 MiB); corefs falls back to ordinary memory".into(),
    });

    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct through the pointer.
    let memlock_limit_bytes = (unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0)
        .then_some(limit.rlim_cur)
        .filter(|&l| l != libc::RLIM_INFINITY);

    let mut nvme_generic_devices: Vec<String> = std::fs::read_dir("/dev")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    n.strip_prefix("ng")
                        .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
                })
                .map(|n| format!("/dev/{n}"))
                .collect()
        })
        .unwrap_or_default();
    nvme_generic_devices.sort();

    KernelReport {
        kernel_release,
        features,
        hugepages_free,
        memlock_limit_bytes,
        nvme_generic_devices,
    }
}

impl std::fmt::Display for KernelReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "kernel {}", self.kernel_release)?;
        for feature in &self.features {
            if feature.available {
                writeln!(f, "  ok       {}", feature.name)?;
            } else {
                writeln!(f, "  missing  {}: {}", feature.name, feature.fix)?;
            }
        }
        match self.memlock_limit_bytes {
            Some(bytes) => writeln!(
                f,
                "  memlock  {} KiB (registering DMA pools may need more: ulimit -l unlimited)",
                bytes >> 10
            )?,
            None => writeln!(f, "  memlock  unlimited")?,
        }
        if self.nvme_generic_devices.is_empty() {
            writeln!(
                f,
                "  nvme     no /dev/ngXnY devices (use file: or mem: backends)"
            )
        } else {
            writeln!(f, "  nvme     {}", self.nvme_generic_devices.join(" "))
        }
    }
}
