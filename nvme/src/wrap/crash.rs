//! Rebuilding crash states from a recorded write log.
//!
//! Model (the storage fault model in docs/durability.md): a power cut after the first `cut`
//! records of the log leaves on the media
//! - every record a completed flush covers, and every FUA write that completed, exactly;
//! - for each other write completed before the cut, independently: all of it, none of it, or
//!   (torn) some of its LBAs — writes are atomic per LBA, not per request;
//! - for each write *in flight* at the cut (submitted, not completed: [`Submission`]), FUA or
//!   not, the same choice: a FUA record torn at sector granularity, or a FUA batch whose record
//!   landed and whose in-place data did not;
//! - optionally one LBA of one uncovered or in-flight write damaged: garbage, or one flipped
//!   bit (what only a checksum can tell).
//!
//! Completed writes are applied in completion order, then the writes in flight, so "a later
//! write lost, an earlier one kept" is how reordering in a volatile cache shows up. The same
//! (`log`, submissions, `cut`, `mode`, seed) always gives the same image.

use super::recording::Submission;
use super::Record;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Only what flushes and FUA made durable survives.
    DurableOnly,
    /// Every completed write landed.
    AllLanded,
    /// Each uncovered write lands or not, by coin flip.
    RandomSubset { seed: u64 },
    /// As `RandomSubset`, and landed writes may be torn at LBA granularity.
    Torn { seed: u64 },
    /// As `Torn`, and one LBA of one uncovered write is garbage.
    CorruptSector { seed: u64 },
}

/// How many of the first `cut` records the last completed flush made durable.
pub fn durable_prefix(log: &[Record], cut: usize) -> usize {
    log[..cut]
        .iter()
        .filter_map(|r| match r {
            Record::Flush { covers } => Some(*covers),
            _ => None,
        })
        .max()
        .unwrap_or(0)
        .min(cut)
}

/// The device image after a power cut following record `cut`, starting from `base`.
pub fn crash_image(
    base: &[u8],
    lba_size_bytes: u32,
    log: &[Record],
    cut: usize,
    mode: CrashMode,
) -> Vec<u8> {
    let mut image = Vec::new();
    crash_image_into(base, lba_size_bytes, log, cut, mode, &mut image);
    image
}

/// [`crash_image`] into a buffer the caller reuses (crash testers build millions of images).
pub fn crash_image_into(
    base: &[u8],
    lba_size_bytes: u32,
    log: &[Record],
    cut: usize,
    mode: CrashMode,
    image: &mut Vec<u8>,
) {
    crash_image_in_flight_into(base, lba_size_bytes, log, &[], cut, mode, image)
}

/// True when a crash state at `cut` can differ between modes: some write is neither durable
/// nor absent for certain (uncovered, or in flight). When false every mode gives the
/// [`CrashMode::DurableOnly`] image.
pub fn cut_has_choices(log: &[Record], submissions: &[Submission], cut: usize) -> bool {
    let durable = durable_prefix(log, cut);
    (durable..cut).any(|i| uncovered(&log[i])) || submissions.iter().any(|s| s.in_flight_at(cut))
}

fn uncovered(record: &Record) -> bool {
    matches!(
        record,
        Record::Write { fua: false, .. } | Record::WriteZeroes { .. } | Record::Deallocate { .. }
    )
}

/// The LBAs a write covers and its bytes (None: zeroes).
fn extent(record: &Record, lba_size: usize) -> Option<(u64, usize, Option<&[u8]>)> {
    match record {
        Record::Flush { .. } => None,
        Record::Write { lba, data, .. } => Some((*lba, data.len() / lba_size, Some(data))),
        Record::WriteZeroes { lba, lbas } | Record::Deallocate { lba, lbas } => {
            Some((*lba, *lbas as usize, None))
        }
    }
}

/// [`crash_image_into`] with the writes in flight at `cut` (from
/// [`super::WriteLog::submissions`]) landing as `mode` says.
pub fn crash_image_in_flight_into(
    base: &[u8],
    lba_size_bytes: u32,
    log: &[Record],
    submissions: &[Submission],
    cut: usize,
    mode: CrashMode,
    image: &mut Vec<u8>,
) {
    image.clear();
    image.extend_from_slice(base);
    let mut touched = Vec::new();
    crash_state_onto(
        lba_size_bytes,
        log,
        submissions,
        cut,
        mode,
        image,
        &mut touched,
    );
}

/// The crash state of [`crash_image_in_flight_into`] built onto `image`, which holds the base
/// image: only the LBAs written are changed, and their ranges are appended to `touched`, so a
/// caller building millions of states can undo them from the base instead of copying whole
/// images.
pub fn crash_state_onto(
    lba_size_bytes: u32,
    log: &[Record],
    submissions: &[Submission],
    cut: usize,
    mode: CrashMode,
    image: &mut [u8],
    touched: &mut Vec<std::ops::Range<u64>>,
) {
    assert!(
        cut <= log.len(),
        "cut {cut} past the {} records logged",
        log.len()
    );
    let lba_size = lba_size_bytes as usize;
    let durable = durable_prefix(log, cut);
    let seed = match mode {
        CrashMode::RandomSubset { seed }
        | CrashMode::Torn { seed }
        | CrashMode::CorruptSector { seed } => seed,
        _ => 0,
    };
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Completed-and-uncovered writes by record index, then writes in flight (after them, in
    // the same numbering: log.len() + their index among those in flight).
    let in_flight: Vec<&Record> = submissions
        .iter()
        .filter(|s| s.in_flight_at(cut))
        .map(|s| &s.record)
        .collect();
    let candidates: Vec<usize> = (durable..cut)
        .filter(|&i| uncovered(&log[i]))
        .chain((0..in_flight.len()).map(|i| log.len() + i))
        .collect();
    let corrupt = match mode {
        CrashMode::CorruptSector { .. } if !candidates.is_empty() => {
            Some(candidates[rng.random_range(0..candidates.len())])
        }
        _ => None,
    };
    let torn_mode = matches!(
        mode,
        CrashMode::Torn { .. } | CrashMode::CorruptSector { .. }
    );
    let completed = log[..cut].iter().enumerate().map(|(i, r)| {
        let covered = i < durable || matches!(r, Record::Write { fua: true, .. });
        (i, r, covered)
    });
    let pending = in_flight
        .iter()
        .enumerate()
        .map(|(i, r)| (log.len() + i, *r, false));
    for (index, record, covered) in completed.chain(pending) {
        let Some((lba, lbas, data)) = extent(record, lba_size) else {
            continue;
        };
        let whole = covered
            || match mode {
                CrashMode::DurableOnly => false,
                CrashMode::AllLanded => true,
                _ => rng.random_bool(0.5),
            };
        let torn = !whole && torn_mode;
        if whole || torn {
            touched.push(lba..lba + lbas as u64);
        }
        for block in 0..lbas {
            let keep = whole || (torn && rng.random_bool(0.5));
            if !keep {
                continue;
            }
            let at = (lba as usize + block) * lba_size;
            let target = &mut image[at..at + lba_size];
            match data {
                Some(data) => {
                    target.copy_from_slice(&data[block * lba_size..(block + 1) * lba_size])
                }
                None => target.fill(0),
            }
        }
        if corrupt == Some(index) {
            let block = rng.random_range(0..lbas.max(1));
            touched.push(lba + block as u64..lba + block as u64 + 1);
            let at = (lba as usize + block) * lba_size;
            let sector = &mut image[at..at + lba_size];
            if rng.random_bool(0.5) {
                rng.fill(sector);
            } else {
                // One flipped bit: the damage only a checksum can tell.
                let bit = rng.random_range(0..lba_size * 8);
                sector[bit / 8] ^= 1 << (bit % 8);
            }
        }
    }
}
