//! CPU cores: which ones the process may run on, checking a core id a caller asked for, and
//! pinning a thread. Every core id that reaches pinning (the reactors' `Config::core` and
//! `Config::cores`, the C ABI's `corefs_options.core`, `corefs mount --core`, the benchmark
//! clients) goes through [`check_cores`] or [`pin_current_thread`] here.
//!
//! # Invariants
//! - A core id is checked against the calling thread's affinity mask (`sched_getaffinity`)
//!   before it is used; an id outside it is an error naming the core and the allowed set,
//!   never a panic. (libc's `CPU_SET` is an `extern "C"` function that indexes a 1024-bit
//!   array: a core ≥ 1024 made it panic where a panic cannot unwind, and the process
//!   aborted.)
//! - Masks are sized to the core ids involved, so machines with more than 1024 CPUs work.
//!
//! Fault model: `sched_getaffinity` failing (it does not in practice) is reported as an
//! error; a pin that the kernel refuses (the allowed set changed since the check) is an
//! error the caller logs.

use engine::EngineError;

/// The most CPUs a mask is grown to while asking the kernel for the affinity mask.
const MASK_BITS_MAX: usize = 1 << 20;

/// The cores the calling thread may run on (its affinity mask), ascending.
pub fn allowed_cores() -> Result<Vec<usize>, EngineError> {
    let mut words = 1024 / 64;
    loop {
        let mut mask = vec![0u64; words];
        // SAFETY: `mask` is writable for `words * 8` bytes, the size passed; the kernel
        // writes at most that many.
        let rc = unsafe {
            libc::sched_getaffinity(0, words * 8, mask.as_mut_ptr().cast::<libc::cpu_set_t>())
        };
        if rc == 0 {
            let cores = (0..words * 64)
                .filter(|&core| mask[core / 64] & (1 << (core % 64)) != 0)
                .collect();
            return Ok(cores);
        }
        let e = std::io::Error::last_os_error();
        // EINVAL: the mask is smaller than the kernel's CPU count; try a larger one.
        if e.raw_os_error() == Some(libc::EINVAL) && words * 64 < MASK_BITS_MAX {
            words *= 2;
            continue;
        }
        return Err(EngineError::Invalid(format!(
            "reading the CPU affinity mask: {e}"
        )));
    }
}

/// `0-3,8,10-11`: a set of cores as Linux prints cpu lists.
pub fn cpu_list(cores: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cores.len() {
        let start = cores[i];
        let mut end = start;
        while i + 1 < cores.len() && cores[i + 1] == end + 1 {
            i += 1;
            end = cores[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if end == start {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// Checks that every core in `cores` is one the process may run on. The error names the
/// first core that is not and the allowed set (`core 5000 is not a core this process may
/// run on (allowed: 0-1)`).
pub fn check_cores(cores: &[usize]) -> Result<(), EngineError> {
    if cores.is_empty() {
        return Ok(());
    }
    let allowed = allowed_cores()?;
    match cores.iter().find(|c| allowed.binary_search(c).is_err()) {
        None => Ok(()),
        Some(core) => Err(EngineError::Invalid(format!(
            "core {core} is not a core this process may run on (allowed: {})",
            cpu_list(&allowed)
        ))),
    }
}

/// `count` consecutive cores from `first` (one per reactor), each checked ([`check_cores`]).
pub fn consecutive_cores(first: usize, count: usize) -> Result<Vec<usize>, EngineError> {
    let cores: Vec<usize> = (0..count.max(1))
        .map(|i| {
            first.checked_add(i).ok_or_else(|| {
                EngineError::Invalid(format!("core {first} + {i} is past the largest core id"))
            })
        })
        .collect::<Result<_, _>>()?;
    check_cores(&cores)?;
    Ok(cores)
}

/// Lets the calling thread run on any of `cores` (a pinned reactor spreading out while its core
/// is shared, [`crate::contention`]): cores taken from [`allowed_cores`] before the thread
/// pinned itself. Not checked against the thread's mask now: that is the one core it is
/// pinned to, and the check refused every wider set (the pinned reactor never spread, and
/// gave up trying at its first attempt). The kernel refuses cores the process may not use.
pub fn set_current_thread_cores(cores: &[usize]) -> Result<(), EngineError> {
    if cores.is_empty() {
        return Err(EngineError::Invalid("no cores to run on".into()));
    }
    if let Some(core) = cores.iter().find(|&&c| c >= MASK_BITS_MAX) {
        return Err(EngineError::Invalid(format!(
            "core {core} is past the largest core id a mask here holds"
        )));
    }
    let words = cores.iter().max().map_or(1, |&c| c / 64 + 1);
    let mut mask = vec![0u64; words];
    for &core in cores {
        mask[core / 64] |= 1 << (core % 64);
    }
    // SAFETY: as in `pin_current_thread`.
    let rc =
        unsafe { libc::sched_setaffinity(0, words * 8, mask.as_ptr().cast::<libc::cpu_set_t>()) };
    if rc != 0 {
        return Err(EngineError::Invalid(format!(
            "setting the cores to {}: {}",
            cpu_list(cores),
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// The cores the kernel keeps from ordinary scheduling (`isolcpus=`, `nohz_full=`), from
/// sysfs (empty where it says nothing).
pub fn isolated_cores() -> Vec<usize> {
    let mut out = Vec::new();
    for file in [
        "/sys/devices/system/cpu/isolated",
        "/sys/devices/system/cpu/nohz_full",
    ] {
        if let Ok(text) = std::fs::read_to_string(file) {
            out.extend(parse_cpu_list(text.trim()));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// `0-3,8,10-11` as Linux prints CPU lists; what does not parse is left out.
fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b.min(a + MASK_BITS_MAX));
                }
            }
            None => out.extend(part.parse::<usize>()),
        }
    }
    out
}

/// Pins the calling thread to `core`, after checking it ([`check_cores`]).
pub fn pin_current_thread(core: usize) -> Result<(), EngineError> {
    check_cores(&[core])?;
    let words = core / 64 + 1;
    let mut mask = vec![0u64; words];
    mask[core / 64] |= 1 << (core % 64);
    // SAFETY: `mask` is readable for `words * 8` bytes, the size passed; a mask shorter
    // than the kernel's CPU count is read as zero past its end.
    let rc =
        unsafe { libc::sched_setaffinity(0, words * 8, mask.as_ptr().cast::<libc::cpu_set_t>()) };
    if rc != 0 {
        return Err(EngineError::Invalid(format!(
            "pinning to core {core}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// For tests that need a shared core: pins the calling thread to the first allowed core and
/// spins another thread there until dropped.
#[cfg(test)]
pub(crate) struct CoreHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(test)]
impl CoreHog {
    pub(crate) fn beside_me() -> CoreHog {
        use std::sync::atomic::{AtomicBool, Ordering};
        let core = allowed_cores().unwrap()[0];
        pin_current_thread(core).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin_current_thread(core).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        CoreHog {
            stop,
            thread: Some(thread),
        }
    }
}

#[cfg(test)]
impl Drop for CoreHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_linux_prints_them() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("x,2"), vec![2]);
    }

    #[test]
    fn cpu_lists_print_as_linux_prints_them() {
        assert_eq!(cpu_list(&[]), "");
        assert_eq!(cpu_list(&[0]), "0");
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
    }

    #[test]
    fn a_core_outside_the_affinity_mask_is_an_error_naming_it_and_the_allowed_set() {
        let allowed = allowed_cores().unwrap();
        assert!(!allowed.is_empty());
        check_cores(&allowed).unwrap();
        for core in [5000, 1024, usize::MAX, allowed.last().unwrap() + 1] {
            let e = check_cores(&[allowed[0], core]).unwrap_err().to_string();
            assert!(
                e.contains(&format!("core {core} ")) && e.contains(&cpu_list(&allowed)),
                "{e}"
            );
            assert!(pin_current_thread(core).is_err());
        }
        assert!(consecutive_cores(usize::MAX, 2).is_err());
        assert_eq!(consecutive_cores(allowed[0], 1).unwrap(), vec![allowed[0]]);
    }

    /// A pinned reactor spreads over the cores the process had before it pinned itself: its
    /// own mask, one core, must not decide what it may spread to.
    #[test]
    fn a_pinned_thread_spreads_back_over_the_cores_it_had() {
        std::thread::spawn(|| {
            let wide = allowed_cores().unwrap();
            pin_current_thread(*wide.last().unwrap()).unwrap();
            assert_eq!(allowed_cores().unwrap(), vec![*wide.last().unwrap()]);
            set_current_thread_cores(&wide).unwrap();
            assert_eq!(allowed_cores().unwrap(), wide);
            assert!(set_current_thread_cores(&[]).is_err());
            assert!(set_current_thread_cores(&[usize::MAX]).is_err());
            assert!(set_current_thread_cores(&[MASK_BITS_MAX + 1]).is_err());
        })
        .join()
        .unwrap();
    }
}
