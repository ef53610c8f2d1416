//! Reactor statistics, in the style of btrfs's commit_stats and fsperf: commits, log writes,
//! fallbacks, and the fsync latency split by phase.

use engine::{CommitStats, LogStats};
use hdrhistogram::Histogram;

/// Percentiles of one latency histogram, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Latency {
    pub count: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    pub mean_ns: f64,
}

impl Latency {
    pub(crate) fn of(h: &Histogram<u64>) -> Latency {
        Latency {
            count: h.len(),
            p50_ns: h.value_at_quantile(0.5),
            p99_ns: h.value_at_quantile(0.99),
            max_ns: h.max(),
            mean_ns: h.mean(),
        }
    }
}

/// Everything a reactor reports ([`crate::Op::Stats`], and [`crate::Runtime::shutdown`]).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ReactorStats {
    /// Operations executed, and the reactor thread's CPU time (busy polling included).
    pub ops: u64,
    pub cpu_ns: u64,
    /// Wall time the reactor spent running batches of requests: its busy time, against
    /// which `cpu_ns` also counts polling (a busy-polling reactor's CPU is all of its time;
    /// this is how much of it was work).
    pub batch_ns: u64,
    /// Batches drained from the request queue; times the reactor parked when idle.
    pub batches: u64,
    pub parks: u64,
    /// Requests clients ran themselves while the reactor slept ([`crate::caller`]), and
    /// those they tried but memory did not answer (sent to the reactor instead).
    pub caller_ran: u64,
    pub caller_missed: u64,
    /// Reactors whose device queue rings their doorbell on completion ([`crate::doorbell`]),
    /// and the times one slept on it waiting for its device (hearing its clients meanwhile).
    pub device_ring_reactors: u64,
    pub device_sleeps: u64,
    /// Of those sleeps, the ones that ended at their timeout instead of a ring.
    pub device_sleep_timeouts: u64,
    /// Times a spin-then-park reactor's spin for an fsync's record ended with a record
    /// durable (instead of a sleep on the doorbell; [`crate::durable_spin_budget`]).
    pub durable_spin_releases: u64,
    /// fsync groups (one log record, or one fallback commit, each) and the largest group.
    pub fsync_groups: u64,
    pub fsync_group_max: u64,
    /// Runs of consecutive reads served together, their device reads in flight at once.
    pub read_groups: u64,
    /// fsync latency by phase: waiting in the queue, then the group's log write + flush (or
    /// the fallback commit, to SuperCommitted), and in total from submit to completion.
    pub fsync_queue_wait: Latency,
    pub fsync_log_write: Latency,
    pub fsync_commit_wait: Latency,
    pub fsync_total: Latency,
    /// Every request, from its client's submit to its completion pushed to the client's
    /// queue: what the reactor took (queueing, parks, device waits, its loop's turns), without
    /// the client's own wake-up. Against a client's latency it tells the reactor's share of
    /// a slow request from the client's scheduling (or a stolen client core).
    pub reply: Latency,
    pub commit: CommitStats,
    pub log: LogStats,
    /// Blocks the last commit unpinned after SuperCommitted.
    pub unpinned_blocks_last: u64,
    /// Reads whose device I/O ran while the reactor served other requests.
    pub reads: engine::ReadStats,
    /// Time operations spent waiting for the device synchronously (metadata cache misses,
    /// drains before a flush): the reactor served no one meanwhile.
    pub device_waits: engine::DeviceWaitStats,
    /// The longest the loop went without looking at its request queue.
    pub loop_gap_ns_max: u64,
    /// Of the loop's gaps, the most the reactor can have spent running in one
    /// (`GapMeter`): the part of a gap that is the reactor's own work, not time its thread or
    /// its virtual CPU was descheduled.
    pub loop_gap_on_cpu_ns_max: u64,
    /// Requests parked while the tree nodes their lookups need were read
    /// (`reactor/src/meta_wait.rs`), and the engine's counters of those reads.
    pub meta_parks: u64,
    pub fetch: engine::FetchStats,
    /// Writes parked while staged data was at its bound, until write-back made room
    /// ([`engine::writeback`]'s `STAGED_PARK_BYTES`).
    pub room_parks: u64,
    /// Fsyncs and writes parked while a due commit waited for the device pipeline to empty
    /// (`reactor/src/runtime/commit.rs`).
    pub barrier_parks: u64,
    /// File data blocks reads took from the engine's block cache, and from the device.
    pub data_cache_hits: u64,
    pub data_blocks_read: u64,
    /// Inode items and name chains lookups found decoded in memory, and those they read
    /// from the trees ([`engine::decoded`]).
    pub decoded_hits: u64,
    pub decoded_misses: u64,
    /// The pool of block groups: free groups, and the groups shards took from it and gave
    /// back since the mount (one pool for the whole filesystem, whatever the reactors).
    pub space: engine::space::PoolStats,
}

impl ReactorStats {
    /// CPU time per operation, in nanoseconds.
    pub fn cpu_ns_per_op(&self) -> f64 {
        if self.ops == 0 {
            0.0
        } else {
            self.cpu_ns as f64 / self.ops as f64
        }
    }

    /// Share of fsyncs that fell back to a full commit.
    pub fn fallback_share(&self) -> f64 {
        if self.log.fsyncs == 0 {
            0.0
        } else {
            self.log.fallback_commits() as f64 / self.log.fsyncs as f64
        }
    }
}

impl ReactorStats {
    /// Adds another reactor's counters to these (several reactors, one filesystem). Commit
    /// figures are the coordinator's and are set by the caller; latencies are recomputed from
    /// the merged histograms.
    pub(crate) fn absorb(&mut self, other: &ReactorStats) {
        // Every reactor reports the one pool: the latest look at it stands.
        if other.space.taken + other.space.returned >= self.space.taken + self.space.returned {
            self.space = other.space;
        }
        self.ops += other.ops;
        self.cpu_ns += other.cpu_ns;
        self.batch_ns += other.batch_ns;
        self.batches += other.batches;
        self.parks += other.parks;
        self.device_ring_reactors += other.device_ring_reactors;
        self.device_sleeps += other.device_sleeps;
        self.device_sleep_timeouts += other.device_sleep_timeouts;
        self.durable_spin_releases += other.durable_spin_releases;
        self.fsync_groups += other.fsync_groups;
        self.fsync_group_max = self.fsync_group_max.max(other.fsync_group_max);
        self.read_groups += other.read_groups;
        self.data_cache_hits += other.data_cache_hits;
        self.data_blocks_read += other.data_blocks_read;
        self.decoded_hits += other.decoded_hits;
        self.decoded_misses += other.decoded_misses;
        let (r, o) = (&mut self.reads, &other.reads);
        r.sets_async += o.sets_async;
        r.device_reads += o.device_reads;
        r.device_reads_queued += o.device_reads_queued;
        r.device_reads_done += o.device_reads_done;
        r.device_read_ns_sum += o.device_read_ns_sum;
        r.sets_in_flight_max = r.sets_in_flight_max.max(o.sets_in_flight_max);
        let (w, o) = (&mut self.device_waits, &other.device_waits);
        w.waits += o.waits;
        w.wait_ns_total += o.wait_ns_total;
        w.wait_ns_max = w.wait_ns_max.max(o.wait_ns_max);
        self.loop_gap_ns_max = self.loop_gap_ns_max.max(other.loop_gap_ns_max);
        self.loop_gap_on_cpu_ns_max = self
            .loop_gap_on_cpu_ns_max
            .max(other.loop_gap_on_cpu_ns_max);
        self.meta_parks += other.meta_parks;
        self.room_parks += other.room_parks;
        self.barrier_parks += other.barrier_parks;
        let (f, o) = (&mut self.fetch, &other.fetch);
        f.deferred += o.deferred;
        f.blocks_fetched += o.blocks_fetched;
        f.blocks_used += o.blocks_used;
        f.blocks_stale += o.blocks_stale;
        f.blocks_dropped += o.blocks_dropped;
        f.blocks_ahead += o.blocks_ahead;
        f.edge_deferred += o.edge_deferred;
        f.edge_blocks += o.edge_blocks;
        self.reads.node_sets += other.reads.node_sets;
        self.commit.pause_ns_max = self.commit.pause_ns_max.max(other.commit.pause_ns_max);
        let (a, b) = (&mut self.log, &other.log);
        a.fsyncs += b.fsyncs;
        a.log_writes += b.log_writes;
        a.log_blocks += b.log_blocks;
        a.inodes_logged += b.inodes_logged;
        a.inodes_named_only += b.inodes_named_only;
        a.already_logged += b.already_logged;
        a.fallback_log_full += b.fallback_log_full;
        a.fallback_too_big += b.fallback_too_big;
        a.fallback_cross += b.fallback_cross;
        a.fua_records += b.fua_records;
        a.replayed_records += b.replayed_records;
        a.replayed_ops += b.replayed_ops;
    }
}

#[derive(Clone)]
pub(crate) struct Histograms {
    pub queue_wait: Histogram<u64>,
    pub log_write: Histogram<u64>,
    pub commit_wait: Histogram<u64>,
    pub total: Histogram<u64>,
    pub reply: Histogram<u64>,
}

impl Histograms {
    pub fn new() -> Histograms {
        let h = || Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds");
        Histograms {
            queue_wait: h(),
            log_write: h(),
            commit_wait: h(),
            total: h(),
            reply: h(),
        }
    }

    /// Adds another reactor's samples.
    pub fn add(&mut self, other: &Histograms) {
        // Same bounds on both sides: adding cannot fail.
        let _ = self.queue_wait.add(&other.queue_wait);
        let _ = self.log_write.add(&other.log_write);
        let _ = self.commit_wait.add(&other.commit_wait);
        let _ = self.total.add(&other.total);
        let _ = self.reply.add(&other.reply);
    }

    /// The phase latencies into `stats`.
    pub fn fill(&self, stats: &mut ReactorStats) {
        stats.fsync_queue_wait = Latency::of(&self.queue_wait);
        stats.fsync_log_write = Latency::of(&self.log_write);
        stats.fsync_commit_wait = Latency::of(&self.commit_wait);
        stats.fsync_total = Latency::of(&self.total);
        stats.reply = Latency::of(&self.reply);
    }
}

/// CPU time of the calling thread, in nanoseconds.
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// How long the reactor's loop goes between two looks at its queue, and how much of such a
/// gap the reactor can have spent running, as opposed to descheduled.
///
/// A gap is the longest any request waited for the reactor's attention. On a shared or
/// virtual machine most long gaps are not the reactor's work: its thread was preempted, or
/// the hypervisor stopped the virtual CPU (this machine's host takes one of two busy vCPUs
/// for 3–5 ms at a time). The thread's CPU clock does not advance while the thread is
/// preempted, nor while its vCPU is stolen when the hypervisor reports that time as steal
/// (paravirtual steal accounting), so the CPU time spent in a window around the gap bounds
/// the reactor's own share of it. A pause the hypervisor does not report is counted as
/// running: the figure is an upper bound (on this VM one 4.96 ms gap counted whole while
/// `perf` saw no sample from any thread of the process in it).
///
/// Invariants: `on_cpu_ns_max <= gap_ns_max`; the CPU clock is read at most once per
/// [`GapMeter::CPU_SAMPLE_EVERY`] plus once per gap of [`GapMeter::ATTRIBUTED_FROM`] or
/// more (a system call each, a fraction of a percent of a busy loop).
#[derive(Debug, Default)]
pub(crate) struct GapMeter {
    last_look: Option<std::time::Instant>,
    /// The last CPU clock sample: (wall time, the thread's CPU ns).
    sample: Option<(std::time::Instant, u64)>,
    pub gap_ns_max: u64,
    /// The longest gap's upper bound on the reactor's running time in it: the gap itself
    /// for gaps shorter than `ATTRIBUTED_FROM`, else the thread's CPU time since the sample
    /// before the gap (at most `CPU_SAMPLE_EVERY` of it from before the gap).
    pub on_cpu_ns_max: u64,
}

impl GapMeter {
    /// How often the CPU clock is sampled while the loop turns.
    pub const CPU_SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_micros(250);
    /// Gaps from this length on are split into running and descheduled time.
    pub const ATTRIBUTED_FROM: std::time::Duration = std::time::Duration::from_micros(500);

    /// The loop looks at its queue at `now`; `cpu_ns` reads the thread's CPU clock.
    pub fn look(&mut self, now: std::time::Instant, cpu_ns: impl FnOnce() -> u64) {
        let Some(last) = self.last_look.replace(now) else {
            self.sample = Some((now, cpu_ns()));
            return;
        };
        let gap = now.saturating_duration_since(last);
        let gap_ns = gap.as_nanos() as u64;
        self.gap_ns_max = self.gap_ns_max.max(gap_ns);
        let (sampled_at, sampled_cpu_ns) = self.sample.expect("sampled at the first look");
        let attributed = gap >= Self::ATTRIBUTED_FROM;
        let mut on_cpu_ns = gap_ns;
        if attributed || now.saturating_duration_since(sampled_at) >= Self::CPU_SAMPLE_EVERY {
            let cpu_now_ns = cpu_ns();
            if attributed {
                on_cpu_ns = gap_ns.min(cpu_now_ns.saturating_sub(sampled_cpu_ns));
            }
            self.sample = Some((now, cpu_now_ns));
        }
        self.on_cpu_ns_max = self.on_cpu_ns_max.max(on_cpu_ns);
    }
}

#[cfg(test)]
mod gap_tests {
    use super::GapMeter;
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    /// A loop turning every 100 µs on its CPU, then one 4.5 ms gap in which its thread ran
    /// for only 0.1 ms (descheduled), then one 1.2 ms gap of its own work.
    #[test]
    fn a_gap_the_thread_spent_descheduled_is_not_counted_as_its_work() {
        let t0 = Instant::now();
        let cpu = Cell::new(0u64);
        let reads = Cell::new(0u32);
        let read = || {
            reads.set(reads.get() + 1);
            cpu.get()
        };
        let mut m = GapMeter::default();
        let mut at = Duration::ZERO;
        for _ in 0..20 {
            m.look(t0 + at, read);
            at += Duration::from_micros(100);
            cpu.set(cpu.get() + 100_000);
        }
        // 20 looks over 2 ms: the first plus one sample per 250 µs, not one per look.
        assert!(reads.get() <= 1 + 8, "{} CPU clock reads", reads.get());
        assert_eq!(m.gap_ns_max, 100_000);
        assert_eq!(m.on_cpu_ns_max, 100_000);
        // Descheduled: 4.5 ms of wall time, 0.1 ms of CPU.
        m.look(t0 + at, read);
        at += Duration::from_micros(4_500);
        cpu.set(cpu.get() + 100_000);
        m.look(t0 + at, read);
        assert_eq!(m.gap_ns_max, 4_500_000);
        assert!(m.on_cpu_ns_max <= 100_000 + 250_000, "{}", m.on_cpu_ns_max);
        // Its own work: 1.2 ms of both.
        at += Duration::from_micros(1_200);
        cpu.set(cpu.get() + 1_200_000);
        m.look(t0 + at, read);
        assert_eq!(m.gap_ns_max, 4_500_000);
        assert_eq!(m.on_cpu_ns_max, 1_200_000);
        assert!(m.on_cpu_ns_max <= m.gap_ns_max);
    }
}
