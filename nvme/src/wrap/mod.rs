//! Device wrappers for testing what corefs does when the device misbehaves or the power fails:
//! - [`recording`]: logs every completed write and flush, in completion order, and every
//!   write's submission (so writes in flight at a cut are known), so any crash
//!   state can be rebuilt afterwards ([`crash`]);
//! - [`fault`]: seeded fault injection — EIO, bit rot, misdirected and lost writes, ignored
//!   flushes, latency spikes, and a simulated power cut that drops or tears unflushed writes;
//! - [`volatile`]: a volatile write cache (`cache=volatile`): unflushed writes live in memory,
//!   so killing the process is a power cut;
//! - [`overlay`]: every write kept in memory and none passed down (`corefs fsck -n`: the engine
//!   mounts and replays as usual, the image is not changed).
//!
//! Each wraps any [`crate::BlockDevice`] and is a device itself, so they stack.

pub mod crash;
pub mod fault;
pub mod overlay;
pub mod recording;
pub mod volatile;

pub use crash::{
    crash_image, crash_image_in_flight_into, crash_image_into, crash_state_onto, cut_has_choices,
    CrashMode,
};
pub use fault::{FaultConfig, FaultDevice, FaultHandle, FaultStats};
pub use overlay::OverlayDevice;
pub use recording::{Record, RecordingDevice, Submission, WriteLog};
pub use volatile::VolatileCacheDevice;

/// The seed for a seeded test or simulation: `COREFS_SEED` when set (to replay a failure),
/// otherwise fresh. Printed either way, so every failing run can be replayed.
pub fn seed_from_env() -> u64 {
    let seed = std::env::var("COREFS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            // Mix the clock with the thread so parallel tests draw different seeds.
            let thread = format!("{:?}", std::thread::current().id());
            crc32c::crc32c(thread.as_bytes()) as u64 ^ now.as_nanos() as u64
        });
    eprintln!("seed {seed} (replay with COREFS_SEED={seed})");
    seed
}

/// Maps wrapper-issued tokens to per-request state: a fixed table indexed by the token, sized to
/// the queue depth, so a wrapper never allocates per I/O once warm.
pub(crate) struct TokenTable<T> {
    entries: Vec<Option<T>>,
    free: Vec<u64>,
}

impl<T> TokenTable<T> {
    pub fn new(depth: u32) -> Self {
        TokenTable {
            entries: (0..depth).map(|_| None).collect(),
            free: (0..depth as u64).rev().collect(),
        }
    }

    pub fn insert(&mut self, value: T) -> Option<u64> {
        let token = self.free.pop()?;
        self.entries[token as usize] = Some(value);
        Some(token)
    }

    pub fn remove(&mut self, token: u64) -> T {
        let value = self.entries[token as usize]
            .take()
            .unwrap_or_else(|| panic!("wrapper token {token} completed twice or never issued"));
        self.free.push(token);
        value
    }
}
