//! The oracle's check of a run: every crash state the write log allows, at every cut that
//! matters, rebuilt, mounted (which replays the logs) and compared with what the persistence
//! points promised; then the tree checker, then a usability pass (create in every directory,
//! delete everything, check again).

use super::{
    config, data_of, lbas_of, mount_options, names_of, snapshot, split, summarize, Entry, Outcome,
    Point, Promise, Tree,
};
use engine::{EngineError, Filesystem};
use nvme::backend::mem::MemDevice;
use nvme::wrap::{crash_state_onto, cut_has_choices, CrashMode, Record, RecordingDevice};
use std::cell::RefCell;

/// Checks every crash state the write log allows against the persistence points, at cuts
/// outside `skip` (the prelude, the same for every workload; the fallback schedule's fillings).
pub(crate) fn check_points(
    base: &[u8],
    records: &[Record],
    submissions: &[nvme::wrap::Submission],
    points: &[Point],
    skip: &[std::ops::Range<usize>],
    seed: u64,
    mut outcome: Outcome,
) -> Result<Outcome, String> {
    let mut points: Vec<&Point> = points.iter().collect();
    points.sort_by_key(|p| p.at);
    // Crash points: every persistence point; every flush, both before it completes (the
    // epoch's writes uncovered, later ones in flight) and after; every FUA write before it
    // completes (in flight: torn, or its batch's other writes missing) and after.
    let mut cuts: Vec<usize> = points.iter().map(|p| p.at).collect();
    cuts.push(records.len());
    for (i, record) in records.iter().enumerate() {
        if matches!(
            record,
            Record::Flush { .. } | Record::Write { fua: true, .. }
        ) {
            cuts.push(i);
            cuts.push(i + 1);
        }
    }
    cuts.retain(|cut| !skip.iter().any(|r| r.contains(cut)));
    cuts.sort_unstable();
    cuts.dedup();
    outcome.persistence_points += points.len() as u64;
    CHECKER.with_borrow_mut(|slot| {
        let checker = Checker::for_base(slot, base)?;
        for cut in cuts {
            let promised: Vec<&Point> = points.iter().copied().filter(|p| p.at <= cut).collect();
            // A cut inside persistence operations (started, not acknowledged) may show what
            // each was persisting; a cut between two also what the next one persists (it may
            // have been under way already).
            let mut in_flight: Vec<&Tree> = points
                .iter()
                .filter(|p| p.started_at <= cut && p.at > cut)
                .map(|p| &p.tree)
                .collect();
            if let Some(next) = points.iter().find(|p| p.at > cut) {
                in_flight.push(&next.tree);
            }
            let writes_in_flight = submissions.iter().any(|s| s.in_flight_at(cut));
            let modes: &[CrashMode] = if cut_has_choices(records, submissions, cut) {
                let seed = seed ^ (cut as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                &[
                    CrashMode::DurableOnly,
                    CrashMode::AllLanded,
                    CrashMode::RandomSubset { seed },
                    CrashMode::Torn { seed },
                    CrashMode::CorruptSector { seed },
                ]
            } else {
                &[CrashMode::DurableOnly]
            };
            // Modes that give the same image at this cut are checked once.
            let mut seen = std::collections::HashSet::new();
            for &mode in modes {
                if !checker.build(base, records, submissions, cut, mode, &mut seen)? {
                    continue;
                }
                let context = format!(
                    "crash after record {cut} of {}{} ({mode:?})",
                    records.len(),
                    if writes_in_flight {
                        ", writes in flight"
                    } else {
                        ""
                    }
                );
                checker.check(base, &promised, &in_flight, &context)?;
                outcome.crash_states += 1;
                outcome.in_flight_states += writes_in_flight as u64;
            }
        }
        Ok(outcome)
    })
}

/// What checks crash states on one thread: a memory device and an image buffer that hold the
/// base image between states. A state changes only the LBAs its writes touch, and those (and
/// whatever mounting and checking it wrote) are put back from the base afterwards: copying
/// two whole images for each state spent half the run in memmove.
struct Checker {
    base_crc: u32,
    image: Vec<u8>,
    /// None after a failed mount (which keeps the device): rebuilt for the next state.
    device: Option<Box<dyn nvme::BlockDevice>>,
    /// The device's own write log (what mount and the checks wrote, to undo).
    writes: std::sync::Arc<nvme::wrap::WriteLog>,
    touched: Vec<std::ops::Range<u64>>,
}

thread_local! {
    static CHECKER: RefCell<Option<Checker>> = const { RefCell::new(None) };
}

impl Checker {
    /// The thread's checker, (re)built when `base` is not the image it holds.
    fn for_base<'a>(slot: &'a mut Option<Checker>, base: &[u8]) -> Result<&'a mut Checker, String> {
        let base_crc = crc32c::crc32c(base);
        let fresh = match slot {
            Some(c) => c.base_crc != base_crc || c.image.len() != base.len() || c.device.is_none(),
            None => true,
        };
        if fresh {
            let recording = RecordingDevice::new(
                MemDevice::from_image(base, config()).map_err(|e| e.to_string())?,
            );
            *slot = Some(Checker {
                base_crc,
                image: base.to_vec(),
                writes: recording.log(),
                device: Some(Box::new(recording)),
                touched: Vec::new(),
            });
        }
        Ok(slot.as_mut().expect("just set"))
    }

    /// Builds the crash state of (`cut`, `mode`) onto the device; false (and nothing changed)
    /// when an earlier mode at this cut gave the same image (`seen` holds their digests).
    fn build(
        &mut self,
        base: &[u8],
        records: &[Record],
        submissions: &[nvme::wrap::Submission],
        cut: usize,
        mode: CrashMode,
        seen: &mut std::collections::HashSet<(u32, u64)>,
    ) -> Result<bool, String> {
        if self.device.is_none() {
            let recording = RecordingDevice::new(
                MemDevice::from_image(base, config()).map_err(|e| e.to_string())?,
            );
            self.writes = recording.log();
            self.device = Some(Box::new(recording));
        }
        self.touched.clear();
        crash_state_onto(
            512,
            records,
            submissions,
            cut,
            mode,
            &mut self.image,
            &mut self.touched,
        );
        self.touched.sort_by_key(|r| (r.start, r.end));
        // The digest of every changed sector with its address.
        let mut crc = 0u32;
        let mut lbas = 0u64;
        for r in &self.touched {
            let bytes = &self.image[r.start as usize * 512..r.end as usize * 512];
            crc = crc32c::crc32c_append(crc, &r.start.to_le_bytes());
            crc = crc32c::crc32c_append(crc, bytes);
            lbas = lbas.wrapping_mul(31).wrapping_add(r.end - r.start);
        }
        let new = seen.insert((crc, lbas));
        if new {
            let sim = self
                .device
                .as_mut()
                .expect("a device")
                .sim_access()
                .expect("a memory device");
            for r in &self.touched {
                sim.sim_write(
                    r.start,
                    &self.image[r.start as usize * 512..r.end as usize * 512],
                );
            }
        }
        for r in &self.touched {
            let (from, to) = (r.start as usize * 512, r.end as usize * 512);
            self.image[from..to].copy_from_slice(&base[from..to]);
        }
        if !new {
            self.touched.clear();
        }
        Ok(new)
    }

    /// Mounts the state built, checks it, and puts the base back on the device.
    fn check(
        &mut self,
        base: &[u8],
        promised: &[&Point],
        in_flight: &[&Tree],
        context: &str,
    ) -> Result<(), String> {
        let dev = self.device.take().expect("a device");
        let mut fs = Filesystem::mount(dev, mount_options())
            .map_err(|e| format!("{context}: mount failed: {e}"))?;
        let result = check_mounted(&mut fs, promised, in_flight, context);
        let mut dev = fs.into_device();
        let (_, written) = self.writes.take();
        let sim = dev.sim_access().expect("a memory device");
        let lbas = written.iter().filter_map(|s| lbas_of(&s.record));
        for r in self.touched.drain(..).chain(lbas) {
            let (from, to) = (r.start as usize * 512, r.end as usize * 512);
            sim.sim_write(r.start, &base[from..to]);
        }
        self.device = Some(dev);
        result
    }
}

fn check_mounted(
    fs: &mut Filesystem,
    promised: &[&Point],
    in_flight: &[&Tree],
    context: &str,
) -> Result<(), String> {
    let now = snapshot(fs).map_err(|e| format!("{context}: walking the tree: {e}"))?;
    // The path shows what a persistence operation in flight was making durable.
    let as_in_flight = |path: &str| in_flight.iter().any(|t| t.get(path) == now.get(path));
    // The path names, as an operation in flight names it, the same file (or a directory, a
    // symlink): a rename of an ancestor in flight brings a subtree's names, whose content that
    // operation does not persist (a child's unsynced data stays behind).
    let named_in_flight = |path: &str| {
        let same = |t: &Tree| match (now.get(path), t.get(path)) {
            (Some(Entry::File { ino, .. }), Some(Entry::File { ino: other, .. })) => ino == other,
            (Some(Entry::Dir { .. }), Some(Entry::Dir { .. }))
            | (Some(Entry::Symlink { .. }), Some(Entry::Symlink { .. })) => true,
            _ => false,
        };
        in_flight.iter().any(|t| same(t))
    };
    for (i, point) in promised.iter().enumerate() {
        let at_point = &point.tree;
        content_kept(&now, &promised[i..], in_flight, context)?;
        // A promise binds while what it promised is still what the live filesystem held at
        // every later persistence point before the crash. Later changes may supersede it, and
        // a change undone later (an xattr set, synced, then removed) still does: the sync made
        // the middle state durable, and a later fsync of another path need not persist the
        // undo, so the state the earlier promise named is no longer the only one allowed.
        let unchanged = |path: &str| {
            promised[i..]
                .iter()
                .all(|later| later.tree.get(path) == at_point.get(path))
        };
        match &point.promise {
            // After a sync every path is promised: each one that has not changed since must be
            // exactly as synced (present or absent).
            Promise::All(tree) => {
                for path in tree.keys().chain(now.keys()) {
                    if unchanged(path)
                        && tree.get(path) != now.get(path)
                        && !as_in_flight(path)
                        && !(tree.get(path).is_none() && named_in_flight(path))
                    {
                        return Err(format!(
                            "{context}: after sync /{path} should be {}, found {}",
                            summarize(tree.get(path)),
                            summarize(now.get(path))
                        ));
                    }
                }
            }
            Promise::Whole(path, entry) if unchanged(path) => {
                let found = now.get(path);
                let ok = match (entry, found) {
                    (Some(Entry::Dir { names, .. }), Some(Entry::Dir { names: got, .. })) => {
                        names == got
                    }
                    (expected, found) => expected.as_ref() == found,
                };
                if !ok && !as_in_flight(path) {
                    return Err(format!(
                        "{context}: fsync({path}) promised {}, found {}",
                        summarize(entry.as_ref()),
                        summarize(found)
                    ));
                }
                // An fsynced file's names are all persisted, and only those: a name is in
                // exactly one place after a rename, and every hard link is there.
                if let Some(Entry::File { ino, .. }) = entry {
                    let promised_names = names_of(at_point, *ino);
                    if promised[i..]
                        .iter()
                        .all(|later| names_of(&later.tree, *ino) == promised_names)
                        && names_of(&now, *ino) != promised_names
                        && !in_flight
                            .iter()
                            .any(|t| names_of(t, *ino) == names_of(&now, *ino))
                    {
                        return Err(format!(
                            "{context}: fsync({path}) promised the names {promised_names:?}, found {:?}",
                            names_of(&now, *ino)
                        ));
                    }
                }
            }
            Promise::Data(path, data) if unchanged(path) => {
                let found = data_of(now.get(path));
                if data.is_some() && &found != data && !as_in_flight(path) {
                    return Err(format!(
                        "{context}: fdatasync({path}) promised {} bytes, found {:?}",
                        data.as_ref().map_or(0, |d| d.len()),
                        found.map(|d| d.len())
                    ));
                }
            }
            _ => {}
        }
    }
    fs.check().map_err(|e| format!("{context}: checker: {e}"))?;
    usable(fs, &now).map_err(|e| format!("{context}: not usable: {e}"))?;
    fs.check()
        .map(drop)
        .map_err(|e| format!("{context}: checker after use: {e}"))
}

/// The content a persistence point made durable stays with its inode, whatever names the
/// inode has later: while every later point shows the inode with that content (under any
/// name), each name the crash state gives the inode shows it too, or what an operation in
/// flight was persisting. A promise by path alone lapses at a rename; this one does not, so a
/// record that logged a renamed file as new and empty (taking back what an earlier fsync or
/// sync gave it) is caught.
fn content_kept(
    now: &Tree,
    points: &[&Point],
    in_flight: &[&Tree],
    context: &str,
) -> Result<(), String> {
    let content_of = |tree: &Tree, ino: u64| -> Vec<Vec<u8>> {
        tree.values()
            .filter_map(|e| match e {
                Entry::File { ino: i, data, .. } if *i == ino => Some(data.clone()),
                _ => None,
            })
            .collect()
    };
    let point = points[0];
    let promised: Vec<(u64, &Vec<u8>)> = match &point.promise {
        Promise::Whole(_, Some(Entry::File { ino, data, .. })) => vec![(*ino, data)],
        Promise::Data(path, Some(data)) => match point.tree.get(path) {
            Some(Entry::File { ino, .. }) => vec![(*ino, data)],
            _ => Vec::new(),
        },
        Promise::All(tree) => tree
            .values()
            .filter_map(|e| match e {
                Entry::File { ino, data, .. } => Some((*ino, data)),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    for (ino, data) in promised {
        let kept = points.iter().all(|later| {
            let found = content_of(&later.tree, ino);
            !found.is_empty() && found.iter().all(|d| d == data)
        });
        if !kept {
            continue;
        }
        for (path, entry) in now {
            let Entry::File {
                ino: i, data: got, ..
            } = entry
            else {
                continue;
            };
            if *i == ino
                && got != data
                && !in_flight.iter().any(|t| content_of(t, ino).contains(got))
            {
                return Err(format!(
                    "{context}: inode {ino} was made durable with {} bytes and kept them, \
                     found /{path} with {}",
                    data.len(),
                    got.len()
                ));
            }
        }
    }
    Ok(())
}

/// Creates a file in every directory, then deletes everything, deepest first.
fn usable(fs: &mut Filesystem, tree: &Tree) -> Result<(), EngineError> {
    let dirs: Vec<&String> = tree
        .iter()
        .filter(|(_, e)| matches!(e, Entry::Dir { .. }))
        .map(|(p, _)| p)
        .collect();
    for dir in &dirs {
        let ino = fs.resolve(dir)?;
        fs.create(ino, b"usable-probe", 0o644, 0, 0)?;
    }
    let mut paths: Vec<String> = tree.keys().filter(|p| !p.is_empty()).cloned().collect();
    paths.extend(dirs.iter().map(|d| {
        if d.is_empty() {
            "usable-probe".to_string()
        } else {
            format!("{d}/usable-probe")
        }
    }));
    paths.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
    for path in paths {
        let (parent, name) = split(&path);
        let dir = fs.resolve(parent)?;
        match fs.rmdir(dir, name.as_bytes()) {
            Err(EngineError::NotDir) => fs.unlink(dir, name.as_bytes())?,
            other => other?,
        }
    }
    fs.commit()?;
    Ok(())
}
