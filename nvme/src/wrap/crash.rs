//! Rebuilding crash states from a recorded write log.
//!
//! Model (the storage fault model in docs/durability.md): a power cut after the first `cut`
//! records of the log leaves on the media
//! - every record a completed flush covers, and every FUA write, exactly;
//! - for each other write completed before the cut, independently: all of it, none of it, or
//!   (torn) some of its LBAs — writes are atomic per LBA, not per request;
//! - optionally one LBA of one uncovered write holding garbage (a crash corrupting a sector).
//!
//! Writes are applied in completion order, so "a later write lost, an earlier one kept" is how
//! reordering in a volatile cache shows up. The same (`log`, `cut`, `mode`, seed) always gives
//! the same image.

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
    assert!(
        cut <= log.len(),
        "cut {cut} past the {} records logged",
        log.len()
    );
    let lba_size = lba_size_bytes as usize;
    image.clear();
    image.extend_from_slice(base);
    let durable = durable_prefix(log, cut);
    let seed = match mode {
        CrashMode::RandomSubset { seed }
        | CrashMode::Torn { seed }
        | CrashMode::CorruptSector { seed } => seed,
        _ => 0,
    };
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let uncovered_writes: Vec<usize> = (durable..cut)
        .filter(|&i| {
            matches!(
                log[i],
                Record::Write { fua: false, .. }
                    | Record::WriteZeroes { .. }
                    | Record::Deallocate { .. }
            )
        })
        .collect();
    let corrupt = match mode {
        CrashMode::CorruptSector { .. } if !uncovered_writes.is_empty() => {
            Some(uncovered_writes[rng.random_range(0..uncovered_writes.len())])
        }
        _ => None,
    };

    for (index, record) in log[..cut].iter().enumerate() {
        let covered = index < durable || matches!(record, Record::Write { fua: true, .. });
        let (lba, lbas, data): (u64, usize, Option<&[u8]>) = match record {
            Record::Flush { .. } => continue,
            Record::Write { lba, data, .. } => (*lba, data.len() / lba_size, Some(data)),
            Record::WriteZeroes { lba, lbas } | Record::Deallocate { lba, lbas } => {
                (*lba, *lbas as usize, None)
            }
        };
        let lands = |rng: &mut Xoshiro256PlusPlus| -> bool {
            match mode {
                CrashMode::DurableOnly => false,
                CrashMode::AllLanded => true,
                _ => rng.random_bool(0.5),
            }
        };
        let whole = covered || lands(&mut rng);
        let torn = !covered
            && matches!(
                mode,
                CrashMode::Torn { .. } | CrashMode::CorruptSector { .. }
            )
            && !whole;
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
            let at = (lba as usize + block) * lba_size;
            rng.fill(&mut image[at..at + lba_size]);
        }
    }
}
