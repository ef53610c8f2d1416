//! `pread_scaling`: how `corefs_pread` of cached data scales with threads. N threads (1, 2,
//! 4, 8 by default) read 4 KiB blocks at random offsets of one file that was read once before,
//! so the engine's data cache answers every read and the figure is the C ABI's per-call cost
//! (handle lookup, the thread's client, the reactor round trip) rather than the device's.
//! Prints ops/s per thread count and the ratio of the largest count to one thread; numbers
//! are printed, never asserted (speed is judged by people reading them, see bench/).
//!
//! ```sh
//! cargo-locked run --release -p corefs-bindings --example pread_scaling
//! cargo-locked run --release -p corefs-bindings --example pread_scaling -- \
//!     --threads 1,2,4,8 --seconds 3 --handles per-thread --device mem:256MiB
//! ```
//!
//! `--probe lookup` reads through write-only handles instead: each call resolves the
//! filesystem and the file handle, then fails (-EBADF) before any engine call, so it measures
//! the handle path alone, without the reactor round trip that dominates a cached read.
//! `--busy-poll 1` has the reactor busy-poll (a core of its own) instead of spinning then
//! parking. `--handles shared` (the default) has every thread read through one handle, as a database's
//! connections sharing a file do; `per-thread` gives each thread its own handle. Each thread
//! count runs `--seconds` after a short warm-up; the load average is printed first, because a
//! busy machine (2 cores here, other builds) skews every figure.

use corefs::abi::*;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Bytes per read: one block, as a database page read is.
const READ_BYTES: usize = 4096;

struct Config {
    device: String,
    threads: Vec<usize>,
    seconds: f64,
    per_thread_handles: bool,
    busy_poll: bool,
    lookup_only: bool,
    file_bytes: usize,
    seed: u64,
}

fn usage() -> ! {
    eprintln!(
        "usage: pread_scaling [--device DEV] [--threads 1,2,4,8] [--seconds S] \
         [--handles shared|per-thread] [--file-mib M] [--seed N] [--busy-poll 0|1] [--probe read|lookup]"
    );
    std::process::exit(2)
}

fn parse() -> Config {
    let mut c = Config {
        device: "mem:256MiB".into(),
        threads: vec![1, 2, 4, 8],
        seconds: 3.0,
        per_thread_handles: false,
        busy_poll: false,
        lookup_only: false,
        file_bytes: 4 << 20,
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--device" => c.device = value,
            "--threads" => {
                c.threads = value
                    .split(',')
                    .map(|t| t.parse().unwrap_or_else(|_| usage()))
                    .collect()
            }
            "--seconds" => c.seconds = value.parse().unwrap_or_else(|_| usage()),
            "--handles" => {
                c.per_thread_handles = match value.as_str() {
                    "shared" => false,
                    "per-thread" => true,
                    _ => usage(),
                }
            }
            "--file-mib" => {
                c.file_bytes = value
                    .parse::<usize>()
                    .ok()
                    .and_then(|m| m.checked_mul(1 << 20))
                    .filter(|&b| b >= READ_BYTES)
                    .unwrap_or_else(|| usage())
            }
            "--seed" => c.seed = value.parse().unwrap_or_else(|_| usage()),
            "--busy-poll" => c.busy_poll = value == "1",
            "--probe" => {
                c.lookup_only = match value.as_str() {
                    "read" => false,
                    "lookup" => true,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
    }
    if c.threads.is_empty() || c.threads.contains(&0) || !c.seconds.is_finite() || c.seconds <= 0.0
    {
        usage()
    }
    c
}

fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn open(fs: corefs_fs, path: &CStr, flags: i32) -> corefs_fd {
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { corefs_open(fs, path.as_ptr(), flags, 0o644) };
    assert!(fd > 0, "open: {fd} {}", last_error());
    fd
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Reads random blocks through `fd` until `stop`; returns how many.
fn reader(
    fs: corefs_fs,
    fd: corefs_fd,
    expect: i64,
    blocks: u64,
    seed: u64,
    stop: &AtomicBool,
) -> u64 {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut buf = vec![0u8; READ_BYTES];
    let mut ops = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let offset = rng.random_range(0..blocks) * READ_BYTES as u64;
        // SAFETY: `buf` holds READ_BYTES writable bytes.
        let n = unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), READ_BYTES, offset) };
        assert_eq!(n, expect, "pread: {}", last_error());
        ops += 1;
    }
    ops
}

/// Ops/s of `threads` readers over `seconds` (after a warm-up of a tenth of that).
fn run(c: &Config, fs: corefs_fs, shared_fd: corefs_fd, path: &CStr, threads: usize) -> f64 {
    let blocks = (c.file_bytes / READ_BYTES) as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Arc::new(Barrier::new(threads + 1));
    let measure = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (stop, start, measure) = (stop.clone(), start.clone(), measure.clone());
            let per_thread = c.per_thread_handles;
            let (flags, expect) = if c.lookup_only {
                (COREFS_O_WRONLY, -(libc::EBADF as i64))
            } else {
                (COREFS_O_RDONLY, READ_BYTES as i64)
            };
            let path = path.to_owned();
            let seed = c.seed.wrapping_mul(1000).wrapping_add(t as u64);
            std::thread::spawn(move || {
                let fd = if per_thread {
                    open(fs, &path, flags)
                } else {
                    shared_fd
                };
                start.wait();
                // Warm-up: the thread's client exists and its code is hot before timing.
                let warm_until = Instant::now() + Duration::from_millis(100);
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5eed);
                let mut buf = vec![0u8; READ_BYTES];
                while Instant::now() < warm_until {
                    let offset = rng.random_range(0..blocks) * READ_BYTES as u64;
                    // SAFETY: `buf` holds READ_BYTES writable bytes.
                    unsafe { corefs_pread(fs, fd, buf.as_mut_ptr(), READ_BYTES, offset) };
                }
                measure.wait();
                let ops = reader(fs, fd, expect, blocks, seed, &stop);
                if per_thread {
                    assert_eq!(corefs_release(fs, fd), 0, "release: {}", last_error());
                }
                ops
            })
        })
        .collect();
    start.wait();
    measure.wait();
    let began = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(c.seconds));
    stop.store(true, Ordering::Relaxed);
    let ops: u64 = workers.into_iter().map(|w| w.join().expect("reader")).sum();
    ops as f64 / began.elapsed().as_secs_f64()
}

fn main() {
    let c = parse();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "pread_scaling ({}): {} KiB reads of a cached {} MiB file, {} handle(s), device {}, {} s per point, reactor {}",
        if c.lookup_only { "probe: the handle path alone" } else { "probe: cached reads" },
        READ_BYTES / 1024,
        c.file_bytes >> 20,
        if c.per_thread_handles { "per-thread" } else { "one shared" },
        c.device,
        c.seconds,
        if c.busy_poll { "busy-polling" } else { "spinning then parking" }
    );
    println!("cores {cores}, load average {} at start", load_average());
    let device = CString::new(c.device.clone()).expect("device without NUL");
    let options = corefs_options {
        format: 1,
        // Few shards: a file's data lives in one shard's region, a 64th of a small device.
        shards: 4,
        busy_poll: u8::from(c.busy_poll),
        ..{
            // SAFETY: all-zero is a valid corefs_options (NULL label, defaults).
            unsafe { std::mem::zeroed() }
        }
    };
    // SAFETY: a NUL-terminated device string and options without a label.
    let fs = unsafe { corefs_mount(device.as_ptr(), &options) };
    assert!(fs > 0, "mount: {fs} {}", last_error());
    let path = c"/pread_scaling.dat";
    let fd = open(fs, path, COREFS_O_CREAT | COREFS_O_RDWR);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(c.seed);
    let data: Vec<u8> = (0..c.file_bytes).map(|_| rng.random()).collect();
    // SAFETY: `data` holds file_bytes readable bytes.
    let n = unsafe { corefs_pwrite(fs, fd, data.as_ptr(), data.len(), 0) };
    assert_eq!(n, data.len() as i64, "pwrite: {}", last_error());
    assert_eq!(corefs_fsync(fs, fd), 0, "fsync: {}", last_error());
    // The first read brings every block into the data cache; the timed reads hit it.
    let mut back = vec![0u8; c.file_bytes];
    for (i, chunk) in back.chunks_mut(1 << 20).enumerate() {
        // SAFETY: `chunk` is writable for its length.
        let n = unsafe { corefs_pread(fs, fd, chunk.as_mut_ptr(), chunk.len(), (i << 20) as u64) };
        assert_eq!(n, chunk.len() as i64, "pread: {}", last_error());
    }
    assert!(back == data, "the file reads back as written");

    // The probe of the handle path reads through a write-only handle (-EBADF).
    let timed_fd = if c.lookup_only {
        open(fs, path, COREFS_O_WRONLY)
    } else {
        fd
    };
    println!(
        "{:>8} {:>12} {:>14} {:>10}",
        "threads", "ops/s", "ns/op/thread", "vs 1"
    );
    let mut first: Option<(usize, f64)> = None;
    let mut last = None;
    for &threads in &c.threads {
        let rate = run(&c, fs, timed_fd, path, threads);
        let base = *first.get_or_insert((threads, rate));
        println!(
            "{threads:>8} {rate:>12.0} {:>14.0} {:>9.2}x",
            threads as f64 * 1e9 / rate,
            rate / base.1
        );
        last = Some((threads, rate));
    }
    if let (Some((t0, r0)), Some((t1, r1))) = (first, last) {
        println!(
            "scaling {t1} threads vs {t0}: {:.2}x (load average {} at end)",
            r1 / r0,
            load_average()
        );
    }
    if timed_fd != fd {
        assert_eq!(corefs_release(fs, timed_fd), 0, "release: {}", last_error());
    }
    assert_eq!(corefs_release(fs, fd), 0, "release: {}", last_error());
    assert_eq!(corefs_close(fs), 0, "close: {}", last_error());
}
