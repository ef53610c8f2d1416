//! corefs benchmarks. Numbers are printed, never asserted: speed targets are checked by people
//! reading these reports (and by `compare` runs), not by timed unit tests.
//!
//! - [`device`]: the device-layer micro-benchmark — CPU cost per operation on the memory
//!   backend, latency percentiles at queue depth 1 and 32 on the file (and NVMe) backends, side
//!   by side with `fio` on the same file in the same run;
//! - [`engine`]: create rate, overwrite cost, commit latency and index batching of the engine;
//! - [`clients`]: 1, 4 and 16 clients appending + fsyncing through the reactor, and the CPU an
//!   idle reactor uses;
//! - [`suite`]: the fsperf-style suite (the README's main job): the same workloads on corefs and
//!   on kernel filesystems, JSON results, compare mode, SVG plots;
//! - [`soak`]: a long verified mixed workload with RSS and open descriptors over time;
//! - [`fsync`]: 4 KiB append + fsync latency on the file backend next to the raw device's
//!   write + flush and the kernel filesystem's append + fdatasync, in the same run.

pub mod clients;
pub mod device;
pub mod engine;
pub mod fio;
pub mod fsync;
pub mod soak;
pub mod stats;
pub mod suite;
