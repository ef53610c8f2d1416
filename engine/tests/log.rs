//! The fast fsync log end to end on simulated devices: what an fsync writes, what it skips,
//! replay after a power cut (and after a power cut during replay), torn and corrupt records,
//! a full log, and grouped fsyncs. The ACE crash runs in `crashtest/` check the promises
//! path by path; these check the log's own contracts.

use engine::inode::SetAttr;
use engine::log::FsyncStart;
use engine::{Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::MemDevice;
use nvme::wrap::{crash_image, CrashMode, Record, RecordingDevice};

#[path = "support/mem_image.rs"]
mod mem_image;
use mem_image::{config, image_of};

fn fresh(shards: u32) -> Vec<u8> {
    let dev = MemDevice::new(config()).unwrap();
    let options = MkfsOptions {
        shards,
        label: "log".into(),
        ..Default::default()
    };
    image_of(Filesystem::mkfs(Box::new(dev), &options).unwrap())
}

fn mount(image: &[u8]) -> Filesystem {
    let dev = MemDevice::from_image(image, config()).unwrap();
    Filesystem::mount(Box::new(dev), MountOptions::default()).unwrap()
}

/// `image` mounted on a device that records every write and flush, and the record.
fn mount_recorded(
    image: &[u8],
    options: MountOptions,
) -> (Filesystem, std::sync::Arc<nvme::wrap::WriteLog>) {
    let recording = RecordingDevice::new(MemDevice::from_image(image, config()).unwrap());
    let log = recording.log();
    (
        Filesystem::mount(Box::new(recording), options).unwrap(),
        log,
    )
}

/// A fresh filesystem with `n` empty files `f0`.. under the root, committed.
fn synced_files(n: usize) -> (Filesystem, Vec<u64>) {
    let mut fs = mount(&fresh(4));
    let root = fs.root();
    let inos = (0..n)
        .map(|i| {
            fs.create(root, format!("f{i}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    fs.sync().unwrap();
    (fs, inos)
}

fn block(seed: u8) -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
        .collect()
}

/// Every file under the root with its data, sorted (what a crash must preserve).
fn listing(fs: &mut Filesystem) -> Vec<(Vec<u8>, Vec<u8>)> {
    let root = fs.root();
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = fs
        .readdir(root, 0, 10_000)
        .unwrap()
        .into_iter()
        .map(|e| {
            let size = fs.stat(e.ino).unwrap().size;
            (e.name, fs.read(e.ino, 0, size as usize).unwrap())
        })
        .collect();
    out.sort();
    out
}

/// The first fsync after mount is a record and a flush (data may have been written in place
/// before, which only a flush makes durable); every later one is a single FUA write.
#[test]
fn an_append_fsync_is_one_fua_record_and_replays() {
    let mut fs = mount(&fresh(4));
    let root = fs.root();
    let ino = fs.create(root, b"db", 0o644, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    let commits = fs.commit_stats().commits;

    let image = image_of(fs.unmount().unwrap());
    let (mut fs, log) = mount_recorded(&image, MountOptions::default());
    for i in 0..20u8 {
        fs.write(ino, i as u64 * 4096, &block(i + 1)).unwrap();
        let before = log.len();
        fs.fsync(ino).unwrap();
        let records = log.snapshot();
        let writes = records[before..]
            .iter()
            .filter(|r| matches!(r, Record::Write { .. }))
            .count();
        let flushes = records[before..]
            .iter()
            .filter(|r| matches!(r, Record::Flush { .. }))
            .count();
        let fua = records[before..]
            .iter()
            .filter(|r| matches!(r, Record::Write { fua: true, .. }))
            .count();
        // The appended block (staged by write) travels inside the record: one write.
        if i == 0 {
            assert_eq!(
                (writes, flushes, fua),
                (1, 1, 0),
                "fsync {i}: record + flush"
            );
            assert!(matches!(records.last(), Some(Record::Flush { .. })));
        } else {
            assert_eq!(
                (writes, flushes, fua),
                (1, 0, 1),
                "fsync {i}: one FUA record"
            );
        }
    }
    assert_eq!(fs.log_stats().fua_records, 19);
    let stats = fs.log_stats();
    assert_eq!(stats.log_writes, 20);
    assert_eq!(
        stats.log_blocks, 40,
        "an append's record is its items' block and its data block"
    );
    assert_eq!(stats.fallback_commits(), 0);
    assert_eq!(fs.commit_stats().commits, 0, "no fsync committed");
    assert!(commits >= 1);
    // Nothing new: no I/O at all.
    let before = log.len();
    fs.fsync(ino).unwrap();
    assert_eq!(log.len(), before);
    assert_eq!(fs.log_stats().already_logged, 1);

    // A power cut now: mount replays all 20 records.
    let records = log.snapshot();
    let crashed = crash_image(&image, 512, &records, records.len(), CrashMode::DurableOnly);
    let mut fs = mount(&crashed);
    assert_eq!(fs.log_stats().replayed_records, 20);
    let data: Vec<u8> = (0..20u8).flat_map(|i| block(i + 1)).collect();
    assert_eq!(fs.read(ino, 0, 20 * 4096).unwrap(), data);
    assert_eq!(fs.stat(ino).unwrap().size, 20 * 4096);
    fs.check().unwrap();
    // The replay committed: a second mount replays nothing and sees the same.
    let again = image_of(fs.into_device());
    let mut fs = mount(&again);
    assert_eq!(fs.log_stats().replayed_records, 0);
    assert_eq!(fs.read(ino, 0, 20 * 4096).unwrap(), data);
}

#[test]
fn fdatasync_skips_a_timestamp_only_change_and_fsync_does_not() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let ino = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(ino, 0, &block(3)).unwrap();
    fs.fsync(ino).unwrap();
    assert_eq!(fs.log_stats().log_writes, 1);
    let mtime = Some(engine::format::items::Timespec { sec: 7, nsec: 0 });
    fs.setattr(
        ino,
        SetAttr {
            mtime,
            ..Default::default()
        },
    )
    .unwrap();
    fs.fdatasync(ino).unwrap();
    assert_eq!(
        fs.log_stats().log_writes,
        1,
        "timestamps alone: nothing logged"
    );
    fs.fsync(ino).unwrap();
    assert_eq!(fs.log_stats().log_writes, 2, "fsync logs the timestamps");
    // A size change is what fdatasync must keep.
    fs.setattr(
        ino,
        SetAttr {
            size: Some(100),
            ..Default::default()
        },
    )
    .unwrap();
    fs.fdatasync(ino).unwrap();
    assert_eq!(fs.log_stats().log_writes, 3);
    let crashed = image_of(fs.into_device());
    let mut fs = mount(&crashed);
    assert_eq!(fs.stat(ino).unwrap().size, 100);
    assert_eq!(fs.read(ino, 0, 100).unwrap(), block(3)[..100].to_vec());
}

#[test]
fn a_grouped_fsync_writes_one_record_for_every_member() {
    let (mut fs, inos) = synced_files(8);
    for (i, &ino) in inos.iter().enumerate() {
        fs.write(ino, 0, &block(i as u8 + 1)).unwrap();
    }
    let group: Vec<(u64, bool)> = inos.iter().map(|&i| (i, false)).collect();
    fs.fsync_group(&group).unwrap();
    assert_eq!(fs.log_stats().log_writes, 1);
    assert_eq!(fs.log_stats().inodes_logged, 8);
    let mut fs = mount(&image_of(fs.into_device()));
    for (i, &ino) in inos.iter().enumerate() {
        assert_eq!(fs.read(ino, 0, 4096).unwrap(), block(i as u8 + 1));
    }
}

#[test]
fn an_fsync_does_not_log_unrelated_inodes() {
    let (mut fs, a, b) = files_a_and_b(4);
    fs.sync().unwrap();
    fs.write(a, 0, &block(1)).unwrap();
    fs.write(b, 0, &block(2)).unwrap();
    fs.fsync(a).unwrap();
    assert_eq!(fs.log_stats().inodes_logged, 1);
    let mut fs = mount(&image_of(fs.into_device()));
    assert_eq!(fs.read(a, 0, 4096).unwrap(), block(1));
    assert_eq!(fs.stat(b).unwrap().size, 0, "b was never fsynced");
}

#[test]
fn a_full_log_falls_back_to_a_commit_and_loses_nothing() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let log_blocks = fs.superblock().log_blocks;
    let mut expected = Vec::new();
    for i in 0..(3 * log_blocks) {
        let name = format!("f{i:04}");
        let ino = fs.create(root, name.as_bytes(), 0o644, 0, 0).unwrap().ino;
        fs.write(ino, 0, &block(i as u8)).unwrap();
        fs.fsync(ino).unwrap();
        expected.push((name.into_bytes(), block(i as u8)));
    }
    let stats = fs.log_stats();
    assert!(stats.fallback_log_full >= 1, "{stats:?}");
    assert!(stats.log_writes > stats.fallback_log_full * 10, "{stats:?}");
    let mut fs = mount(&image_of(fs.into_device()));
    assert_eq!(listing(&mut fs), expected);
    fs.check().unwrap();
}

#[test]
fn a_record_larger_than_the_log_commits_instead() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let dir = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    // Thousands of new names coupled to one directory: one record would exceed the area.
    for i in 0..10_000 {
        fs.create(
            dir,
            format!("a-long-file-name-{i:05}").as_bytes(),
            0o644,
            0,
            0,
        )
        .unwrap();
    }
    fs.fsync(dir).unwrap();
    assert_eq!(fs.log_stats().fallback_too_big, 1);
    let mut fs = mount(&image_of(fs.into_device()));
    assert_eq!(fs.readdir(dir, 0, 20_000).unwrap().len(), 10_000);
}

/// Writes three records (one per fsync), then returns the image and the log area address of
/// shard 0 so tests can damage them.
fn three_records() -> (Vec<u8>, u64, u64) {
    let mut fs = mount(&fresh(1));
    let root = fs.root();
    let ino = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    for i in 0..3u8 {
        fs.write(ino, i as u64 * 4096, &block(i + 1)).unwrap();
        fs.fsync(ino).unwrap();
    }
    assert_eq!(fs.log_stats().log_writes, 3);
    // Each record: its items' block, then the appended block it carries.
    assert_eq!(fs.log_stats().log_blocks, 6);
    let log_at = fs.superblock().region_start(0);
    (image_of(fs.into_device()), log_at, ino)
}

#[test]
fn replay_stops_at_the_first_damaged_record() {
    let (image, log_at, ino) = three_records();
    for (damaged, expect_blocks) in [(0u64, 0u64), (1, 1), (2, 2)] {
        let mut bad = image.clone();
        bad[(log_at + 2 * damaged) as usize * 4096 + 200] ^= 0x40;
        let mut fs = mount(&bad);
        assert_eq!(fs.log_stats().replayed_records, damaged);
        assert_eq!(fs.stat(ino).unwrap().size, expect_blocks * 4096);
        fs.check().unwrap();
    }
}

#[test]
fn a_crash_during_replay_replays_again_to_the_same_state() {
    let (image, _, ino) = three_records();
    let reference = {
        let mut fs = mount(&image);
        fs.read(ino, 0, 3 * 4096).unwrap()
    };
    let (fs, log) = mount_recorded(&image, MountOptions::default());
    drop(fs);
    let records = log.snapshot();
    assert!(records.iter().any(|r| matches!(r, Record::Write { .. })));
    let seed = nvme::wrap::seed_from_env();
    for cut in 0..=records.len() {
        for mode in [
            CrashMode::DurableOnly,
            CrashMode::Torn {
                seed: seed ^ cut as u64,
            },
        ] {
            let crashed = crash_image(&image, 512, &records, cut, mode);
            let mut fs = mount(&crashed);
            assert_eq!(
                fs.read(ino, 0, 3 * 4096).unwrap(),
                reference,
                "cut {cut} {mode:?} (seed {seed})"
            );
            fs.check().unwrap();
        }
    }
}

#[test]
fn a_tiny_metadata_cache_neither_loses_an_extent_nor_forces_a_commit() {
    // Eight clean nodes per shard: the extent leaves are evicted and re-read constantly.
    let image = fresh(2);
    let dev = MemDevice::from_image(&image, config()).unwrap();
    let options = MountOptions {
        cache_nodes: 8,
        ..Default::default()
    };
    let mut fs = Filesystem::mount(Box::new(dev), options).unwrap();
    let root = fs.root();
    let ino = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    fs.sync().unwrap();

    // Scattered 4 KiB writes make one extent item each: hundreds of leaves' worth.
    let blocks = 3000u64;
    for round in 0..3u64 {
        for i in (round..blocks).step_by(3) {
            fs.write(ino, i * 4096, &block((i % 250) as u8 + 1))
                .unwrap();
        }
        if round == 0 {
            // Commit: every node is clean now and all but eight per shard are dropped, so the
            // next rounds re-read the extent leaves they change.
            fs.sync().unwrap();
            assert!(
                fs.loaded_nodes() <= 16,
                "{} nodes loaded",
                fs.loaded_nodes()
            );
        } else {
            fs.fsync(ino).unwrap();
        }
    }
    let stats = fs.log_stats();
    assert_eq!(stats.fallback_commits(), 0, "{stats:?}");
    assert_eq!(stats.log_writes, 2, "{stats:?}");
    let mut fs = mount(&image_of(fs.into_device()));
    assert_eq!(fs.log_stats().replayed_records, 2);
    for i in 0..blocks {
        assert_eq!(
            fs.read(ino, i * 4096, 4096).unwrap(),
            block((i % 250) as u8 + 1),
            "block {i}"
        );
    }
    fs.check().unwrap();
}

#[test]
fn a_killed_process_behind_a_volatile_cache_keeps_exactly_the_fsynced_data() {
    // `cache=volatile` keeps unflushed writes in the process: forgetting the filesystem (as a
    // kill -9 would) is a power cut for the image file.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = format!(
        "file:{}/v.img,size=64MiB,cache=volatile",
        dir.path().display()
    );
    let dev = nvme::open_device(&spec, &nvme::OpenOptions::default()).unwrap();
    let dev = Filesystem::mkfs(dev, &MkfsOptions::default()).unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let kept = fs.create(root, b"kept", 0o644, 0, 0).unwrap().ino;
    fs.write(kept, 0, &block(1)).unwrap();
    fs.fsync(kept).unwrap();
    let lost = fs.create(root, b"lost", 0o644, 0, 0).unwrap().ino;
    fs.write(lost, 0, &block(2)).unwrap();
    fs.write(kept, 4096, &block(3)).unwrap();
    std::mem::forget(fs);
    // The forgotten filesystem still holds the image's exclusive lock (a real kill would
    // release it with the process's descriptors): read the image shared, and let the mount's
    // replay write into an overlay in memory, as `corefs fsck -n` does.
    let plain = format!("file:{}/v.img", dir.path().display());
    let dev = nvme::open_device(
        &plain,
        &nvme::OpenOptions {
            access: nvme::Access::ReadShared,
            ..Default::default()
        },
    )
    .unwrap();
    let dev = Box::new(nvme::wrap::OverlayDevice::new(dev));
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    assert_eq!(fs.log_stats().replayed_records, 1);
    assert_eq!(
        fs.read(kept, 0, 8192).unwrap(),
        block(1),
        "exactly the fsynced data"
    );
    assert!(fs.lookup(root, b"lost").is_err(), "never fsynced");
    fs.check().unwrap();
}

#[test]
fn overwrites_between_fsyncs_do_not_hit_enospc_while_frees_wait_for_a_commit() {
    // Each full overwrite frees the previous copy, pinned until a commit; fsyncs alone never
    // commit, so without a commit-and-retry the third copy finds the shard full.
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let ino = fs.create(root, b"big", 0o644, 0, 0).unwrap().ino;
    let shard_free = fs.statfs().free_blocks / 2;
    let blocks = shard_free * 6 / 10;
    let chunk = vec![0x5au8; 64 << 10];
    for round in 0..4 {
        let mut offset = 0;
        while offset < blocks * 4096 {
            fs.write(ino, offset, &chunk)
                .unwrap_or_else(|e| panic!("round {round} offset {offset}: {e}"));
            offset += chunk.len() as u64;
        }
        fs.fsync(ino).unwrap();
    }
    assert!(fs.commit_stats().commits >= 1);
    fs.check().unwrap();
}

#[test]
fn waiters_go_at_super_commit_and_unpinning_comes_after() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let ino = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(ino, 0, &block(1)).unwrap();
    fs.sync().unwrap();
    fs.write(ino, 0, &block(2)).unwrap(); // frees the first copy, pinned
    let generation = fs.commit_to_super().unwrap();
    assert_eq!(fs.durable_generation(), generation);
    assert_eq!(fs.commit_state(), engine::CommitState::SuperCommitted);
    let unpinned = fs.complete_commit();
    assert!(
        unpinned >= 1,
        "the old copy is unpinned after the waiters went"
    );
    assert_eq!(fs.commit_state(), engine::CommitState::Running);
    assert_eq!(fs.complete_commit(), 0, "nothing left to complete");
    assert_eq!(fs.read(ino, 0, 4096).unwrap(), block(2));
}

#[test]
fn an_fsync_of_a_just_unlinked_file_persists_the_removal_and_replays_cleanly() {
    // The classic: fsync through a handle whose last name is gone. The engine has no open
    // handles (orphans), so the inode is gone at unlink; its fsync logs the removal.
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let ino = fs.create(root, b"foo", 0o644, 0, 0).unwrap().ino;
    fs.write(ino, 0, &block(1)).unwrap();
    fs.fsync(ino).unwrap();
    fs.unlink(root, b"foo").unwrap();
    fs.fsync(ino).unwrap();
    assert_eq!(fs.log_stats().log_writes, 2);
    let mut fs = mount(&image_of(fs.into_device()));
    assert_eq!(fs.log_stats().replayed_records, 2);
    assert!(fs.lookup(root, b"foo").is_err());
    assert!(fs.stat(ino).is_err());
    fs.check().unwrap();
    // A never-existing inode is an error, not a silent success.
    assert!(fs.fsync(ino + 1000).is_err());
}

#[test]
fn records_in_flight_become_durable_in_order_and_every_cut_mounts_clean() {
    let (image, log, mut fs, a, b) = two_files_recorded();

    fs.write(a, 0, &block(1)).unwrap();
    let first = fs.fsync_group_start(&[(a, false)]).unwrap();
    fs.write(b, 0, &block(2)).unwrap();
    let second = fs.fsync_group_start(&[(b, false)]).unwrap();
    let (FsyncStart::Pending(t1), FsyncStart::Pending(t2)) = (first, second) else {
        panic!("records were not left in flight: {first:?} {second:?}");
    };
    assert!(t2 > t1);
    assert!(fs.log_in_flight() >= 1);
    // Nothing new for `a`: it still waits for the newest record, which may hold its changes.
    assert_eq!(
        fs.fsync_group_start(&[(a, true)]).unwrap(),
        FsyncStart::Pending(t2)
    );
    // Durability is reported in ticket order and only grows.
    let mut last = 0;
    loop {
        let durable_below = fs.log_progress(None).unwrap();
        assert!(durable_below >= last);
        last = durable_below;
        if durable_below > t2 {
            break;
        }
    }
    assert_eq!(fs.log_in_flight(), 0);
    // Each record's flush comes after its writes: with nothing else in flight, the recorded
    // order is write(s), flush, write(s), flush.
    let records = log.snapshot();
    let kinds: Vec<char> = records
        .iter()
        .map(|r| match r {
            Record::Write { .. } => 'w',
            Record::Flush { .. } => 'f',
            _ => '?',
        })
        .filter(|&c| c != '?')
        .collect();
    // The first record after mount is flushed; the second needs no flush (it is written FUA).
    assert_eq!(kinds.iter().filter(|&&c| c == 'w').count(), 2, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|&&c| c == 'f').count(), 1, "{kinds:?}");
    assert_eq!(
        records
            .iter()
            .filter(|r| matches!(r, Record::Write { fua: true, .. }))
            .count(),
        1
    );

    // A power cut after any prefix of that I/O mounts clean; after all of it, both files
    // hold their data.
    for cut in 0..=records.len() {
        for mode in [CrashMode::DurableOnly, CrashMode::Torn { seed: cut as u64 }] {
            let crashed = crash_image(&image, 512, &records, cut, mode);
            let mut fs = mount(&crashed);
            fs.check()
                .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: {e}"));
            if cut == records.len() && mode == CrashMode::DurableOnly {
                assert_eq!(fs.read(a, 0, 4096).unwrap(), block(1));
                assert_eq!(fs.read(b, 0, 4096).unwrap(), block(2));
            }
        }
    }
}

/// Records that need a flush (data written in place on a device whose FUA is emulated, as a
/// file image's is) share one: three fsyncs started together, each with 64 KiB in place, make
/// three records and one flush (there was a flush per record), and after it each file holds
/// its data through a power cut.
#[test]
fn records_ready_together_share_one_flush() {
    let (fs, inos) = synced_files(3);
    let image = image_of(fs.unmount().unwrap());
    let dev = MemDevice::from_image(&image, config())
        .unwrap()
        .emulating_fua();
    let recording = RecordingDevice::new(dev);
    let log = recording.log();
    let mut fs = Filesystem::mount(Box::new(recording), MountOptions::default()).unwrap();
    // 16 blocks each: more than a record embeds, so the data goes in place.
    let data = |i: usize| -> Vec<u8> {
        (0..16)
            .flat_map(|b| block((i * 16 + b) as u8 + 1))
            .collect()
    };
    let mut tickets = Vec::new();
    for (i, &ino) in inos.iter().enumerate() {
        fs.write(ino, 0, &data(i)).unwrap();
        match fs.fsync_group_start(&[(ino, false)]).unwrap() {
            FsyncStart::Pending(t) => tickets.push(t),
            other => panic!("fsync {i} was not left in flight: {other:?}"),
        }
    }
    let last = *tickets.last().unwrap();
    while fs.log_progress(None).unwrap() <= last {}
    assert_eq!(fs.log_stats().log_writes, 3);
    assert_eq!(fs.log_stats().fua_records, 0, "in-place data, emulated FUA");
    let records = log.snapshot();
    let flushes = records
        .iter()
        .filter(|r| matches!(r, Record::Flush { .. }))
        .count();
    assert_eq!(flushes, 1, "three records ready together share one flush");
    assert!(
        matches!(records.last(), Some(Record::Flush { .. })),
        "the flush follows every record's writes"
    );
    let crashed = crash_image(&image, 512, &records, records.len(), CrashMode::DurableOnly);
    let mut fs = mount(&crashed);
    fs.check().unwrap();
    for (i, &ino) in inos.iter().enumerate() {
        assert!(
            fs.read(ino, 0, 16 * 4096).unwrap() == data(i),
            "file {i} lost its fsynced data"
        );
    }
}

/// A failed record write or flush (background I/O) is never acknowledged: the fsync fails,
/// the filesystem fails stop (every later change and fsync fails), and a remount recovers the
/// last durable state, with the data of every fsync that did succeed.
#[test]
fn a_failed_record_write_or_flush_is_never_acknowledged_and_fails_stop() {
    use nvme::wrap::{FaultConfig, FaultDevice};
    use nvme::OpKind;
    for kind in [OpKind::Write, OpKind::Flush] {
        let mut fs = mount(&fresh(2));
        let root = fs.root();
        let ino = fs.create(root, b"f", 0o644, 0, 0).unwrap().ino;
        if kind == OpKind::Flush {
            fs.write(ino, 0, &block(1)).unwrap();
        }
        fs.sync().unwrap();
        let image = image_of(fs.unmount().unwrap());
        let faulty = FaultDevice::new(
            MemDevice::from_image(&image, config()).unwrap(),
            FaultConfig {
                seed: 11,
                ..Default::default()
            },
        );
        let faults = faulty.handle();
        let mut fs = Filesystem::mount(Box::new(faulty), MountOptions::default()).unwrap();
        // Records are written FUA, with no flush to fail, except the first after a mount
        // (nothing says what the previous mount left unflushed): the Write case fails a FUA
        // record after a durable fsync, the Flush case the first record's flush.
        if kind == OpKind::Write {
            fs.write(ino, 0, &block(1)).unwrap();
            fs.fsync(ino).unwrap(); // durable
        }
        let second = block(2);
        fs.write(ino, 4096, &second).unwrap();
        faults.fail_next(kind, 1);
        // Started in the background; the failure surfaces when it is waited for.
        let started = fs.fsync_group_start(&[(ino, false)]);
        let result = match started {
            Ok(FsyncStart::Pending(ticket)) => fs.wait_durable(ticket),
            Ok(FsyncStart::Durable) => panic!("{kind}: a record with new data was durable at once"),
            Ok(FsyncStart::NeedsCommit | FsyncStart::AfterCommit { .. }) => {
                panic!("{kind}: no commit is in flight")
            }
            Err(e) => Err(e),
        };
        let err = result.expect_err("the fsync whose record failed must fail");
        assert!(
            matches!(err, engine::EngineError::Device(_)),
            "{kind}: {err}"
        );
        assert!(
            matches!(
                fs.write(ino, 0, b"x"),
                Err(engine::EngineError::ReadOnly(_))
            ),
            "{kind}: not fail-stop"
        );
        assert!(fs.fsync(ino).is_err(), "{kind}: a later fsync succeeded");
        // A remount recovers: the first fsync's block is there, the failed one's is not.
        let crashed = image_of(fs.into_device());
        let mut fs = mount(&crashed);
        assert_eq!(fs.read(ino, 0, 4096).unwrap(), block(1), "{kind}");
        let size = fs.stat(ino).unwrap().size;
        match kind {
            // The record never reached the device.
            OpKind::Write => assert_eq!(size, 4096, "the failed record's append"),
            // The record was written and only its flush failed: it may have persisted (an
            // unacknowledged fsync may or may not survive), and then whole.
            _ => {
                let whole = 4096 + second.len() as u64;
                assert!(size == 4096 || size == whole, "{size}");
                if size == whole {
                    assert_eq!(fs.read(ino, 4096, 4096).unwrap(), block(2));
                }
            }
        }
        fs.check().unwrap();
    }
}

/// While commit N is in flight an fsync logs for N+1 into the other half of the log area. Its
/// record counts only once N is durable too: a power cut anywhere mounts clean, and after the
/// point where both are durable, the fsynced data is there.
#[test]
fn an_fsync_logged_while_a_commit_is_in_flight_counts_once_the_commit_is_durable() {
    let (image, log, mut fs, a, b) = two_files_recorded();
    fs.defer_commits(true);
    for i in 0..8u8 {
        fs.write(a, i as u64 * 4096, &block(i + 1)).unwrap();
    }
    assert!(fs.commit_start().unwrap(), "a commit is in flight");
    let generation = fs.commit_in_flight().unwrap();
    fs.write(b, 0, &block(9)).unwrap();
    let started = fs.fsync_group_start(&[(b, false)]).unwrap();
    let FsyncStart::AfterCommit {
        ticket: Some(ticket),
        generation: after,
    } = started
    else {
        panic!("expected a record after the commit: {started:?}");
    };
    assert_eq!(after, generation);
    // Its writes finish at once on a memory device, yet it is not reported durable while the
    // commit is in flight: it belongs to the next generation.
    for _ in 0..3 {
        assert!(
            fs.log_progress(None).unwrap() <= ticket,
            "released before the commit"
        );
    }
    // Both become durable; the fsync is acknowledged only then.
    loop {
        match fs.commit_progress(None).unwrap() {
            engine::commit::CommitProgress::SuperCommitted(g) => {
                assert_eq!(g, generation);
                break;
            }
            _ => continue,
        }
    }
    fs.wait_durable(ticket).unwrap();
    let acknowledged = log.len();
    drop(fs);
    let records = log.snapshot();
    for cut in 0..=records.len() {
        for mode in [CrashMode::DurableOnly, CrashMode::Torn { seed: cut as u64 }] {
            let crashed = crash_image(&image, 512, &records, cut, mode);
            let mut fs = mount(&crashed);
            fs.check()
                .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: {e}"));
            if cut >= acknowledged {
                assert_eq!(fs.read(b, 0, 4096).unwrap(), block(9), "cut {cut} {mode:?}");
                assert_eq!(fs.read(a, 0, 4096).unwrap(), block(1), "cut {cut} {mode:?}");
            }
        }
    }
}

/// How a reactor releases an fsync group started with `start`: at its ticket, or, with none,
/// at the commit's superblock. True once it would have.
fn group_released(fs: &mut Filesystem, start: FsyncStart) -> bool {
    match start {
        FsyncStart::Durable => true,
        FsyncStart::Pending(ticket)
        | FsyncStart::AfterCommit {
            ticket: Some(ticket),
            ..
        } => fs.log_progress(None).unwrap() > ticket,
        FsyncStart::AfterCommit {
            ticket: None,
            generation,
        } => fs.durable_generation() >= generation,
        FsyncStart::NeedsCommit => panic!("a whole mount commits itself"),
    }
}

/// The class of "an fsync acknowledged before the commit holding its changes is durable":
/// every shape of fsync started while a commit is in flight (nothing new to log, its changes
/// all in the commit; nothing new behind another file's record of the next generation; a new
/// record; an fdatasync) is released, by the reactor's rule ([`group_released`]), only once
/// the commit's superblock is durable, and a power cut after its release keeps its data. (A
/// group with nothing new was once named the newest ticket of any kind: one of the commit's
/// own chunks, released long before the superblock. Two reactors lost a file created just
/// before its first fsync that way.)
#[test]
fn no_fsync_started_during_a_commit_is_released_before_its_superblock() {
    for shape in ["nothing-new", "behind-a-record", "new-record", "datasync"] {
        let (image, log, mut fs, a, b) = two_files_recorded();
        fs.defer_commits(true);
        // A commit of many chunks, so some are in flight when the fsync starts.
        for i in 0..64u64 {
            fs.write(a, i * 4096, &block(i as u8 + 1)).unwrap();
        }
        fs.write(b, 0, &block(70)).unwrap();
        assert!(fs.commit_start().unwrap(), "{shape}: a commit is in flight");
        let generation = fs.commit_in_flight().unwrap();
        let (ino, datasync, expect) = match shape {
            "nothing-new" => (a, false, block(1)),
            "behind-a-record" => {
                fs.write(b, 4096, &block(71)).unwrap();
                let other = fs.fsync_group_start(&[(b, false)]).unwrap();
                assert!(
                    matches!(
                        other,
                        FsyncStart::AfterCommit {
                            ticket: Some(_),
                            ..
                        }
                    ),
                    "{shape}: {other:?}"
                );
                (a, false, block(1))
            }
            "new-record" => {
                fs.write(a, 0, &block(90)).unwrap();
                (a, false, block(90))
            }
            _ => (a, true, block(1)),
        };
        let start = fs.fsync_group_start(&[(ino, datasync)]).unwrap();
        assert!(
            matches!(start, FsyncStart::AfterCommit { .. }),
            "{shape}: {start:?}"
        );
        let acknowledged = loop {
            if group_released(&mut fs, start) {
                assert!(
                    fs.durable_generation() >= generation,
                    "{shape}: {start:?} released before commit {generation} is durable"
                );
                break log.len();
            }
            fs.commit_progress(None).unwrap();
        };
        drop(fs);
        let records = log.snapshot();
        for cut in acknowledged..=records.len() {
            let crashed = crash_image(&image, 512, &records, cut, CrashMode::DurableOnly);
            let mut fs = mount(&crashed);
            fs.check()
                .unwrap_or_else(|e| panic!("{shape} cut {cut}: {e}"));
            assert_eq!(
                fs.read(ino, 0, 4096).unwrap(),
                expect,
                "{shape} cut {cut}: acknowledged data lost"
            );
            assert_eq!(fs.read(b, 0, 4096).unwrap(), block(70), "{shape} cut {cut}");
        }
    }
}

/// An fsync with more data than a record carries writes the data in place beside the record,
/// every write FUA and no flush (after the first record since mount), and the data only
/// once (the commit does not write it again). A power cut after any prefix of those writes
/// mounts clean with all of the fsynced data or none of it.
#[test]
fn a_large_fsync_writes_its_data_in_place_fua_once_and_every_cut_mounts_clean() {
    let (image, log, mut fs, a, _b) = two_files_recorded();
    fs.write(a, 0, &block(1)).unwrap();
    fs.fsync(a).unwrap(); // the first record after mount: written, then flushed
    let before = log.len();
    let blocks = engine::log::EMBED_MAX_BLOCKS + 4;
    let big: Vec<u8> = (0..blocks as u8).flat_map(|i| block(i + 10)).collect();
    fs.write(a, 4096, &big).unwrap();
    fs.fsync(a).unwrap();
    let records = log.snapshot();
    let writes: Vec<(bool, usize)> = records[before..]
        .iter()
        .filter_map(|r| match r {
            Record::Write { fua, data, .. } => Some((*fua, data.len())),
            _ => None,
        })
        .collect();
    assert!(
        !records[before..]
            .iter()
            .any(|r| matches!(r, Record::Flush { .. })),
        "a large fsync flushed: {writes:?}"
    );
    assert!(writes.len() >= 2, "record and data: {writes:?}");
    assert!(writes.iter().all(|&(fua, _)| fua), "{writes:?}");
    let written: usize = writes.iter().map(|&(_, len)| len).sum();
    assert!(written > big.len(), "the data went in place: {writes:?}");
    assert!(
        written < 2 * big.len(),
        "the data was written once, not also inside the record: {writes:?}"
    );
    // The commit writes tree nodes only: the data is already in place.
    let before_commit = log.len();
    fs.sync().unwrap();
    let committed: usize = log.snapshot()[before_commit..]
        .iter()
        .filter_map(|r| match r {
            Record::Write { data, .. } => Some(data.len()),
            _ => None,
        })
        .sum();
    assert!(
        committed < big.len(),
        "the commit wrote {committed} bytes: the data again?"
    );

    let old = block(1);
    let new: Vec<u8> = old.iter().chain(&big).copied().collect();
    assert_every_cut_all_or_nothing(&image, &records, before, a, &old, &new);
}

/// Records logged while a commit is in flight wait for its superblock, which only the caller
/// (the reactor) carries on: more of them than the device pipeline holds must not make the
/// next fsync wait for that commit — it would never come. (It hung before: the bound counted
/// those records and waited for the oldest.)
#[test]
fn more_records_than_the_pipeline_holds_during_a_commit_do_not_hang() {
    let (_image, _log, mut fs, a, _b) = two_files_recorded();
    fs.defer_commits(true);
    fs.write(a, 0, &block(1)).unwrap();
    fs.fsync(a).unwrap();
    fs.write(a, 4096, &block(2)).unwrap();
    assert!(fs.commit_start().unwrap(), "a commit started");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let mut after_commit = 0;
        for i in 0..engine::log::inflight::MAX_IN_FLIGHT + 8 {
            fs.write(a, 8192 + i as u64 * 4096, &block(i as u8))
                .unwrap();
            match fs.fsync_group_start(&[(a, false)]).unwrap() {
                FsyncStart::AfterCommit { .. } => after_commit += 1,
                other => panic!("record {i}: {other:?} while a commit is in flight"),
            }
        }
        done_tx.send(after_commit).unwrap();
        fs
    });
    let after_commit = done_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("fsyncs logged during a commit hung");
    assert_eq!(after_commit, engine::log::inflight::MAX_IN_FLIGHT + 8);
    let mut fs = worker.join().unwrap();
    fs.sync().unwrap();
    fs.check().unwrap();
    assert_eq!(fs.read(a, 4096, 4096).unwrap(), block(2));
}

/// A power cut after every prefix of `records` from `from` on (durable writes only, and torn)
/// mounts clean with file `ino` holding exactly `old` or exactly `new`; after all of them,
/// with every write durable, `new` (the fsync returned).
fn assert_every_cut_all_or_nothing(
    image: &[u8],
    records: &[Record],
    from: usize,
    ino: u64,
    old: &[u8],
    new: &[u8],
) {
    for cut in from..=records.len() {
        for mode in [CrashMode::DurableOnly, CrashMode::Torn { seed: cut as u64 }] {
            let crashed = crash_image(image, 512, records, cut, mode);
            let mut fs = mount(&crashed);
            fs.check()
                .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: {e}"));
            let size = fs.stat(ino).unwrap().size;
            let content = fs.read(ino, 0, size as usize).unwrap();
            assert!(
                content == old || content == new,
                "cut {cut} {mode:?}: size {size}, neither the old content nor the new"
            );
            if cut == records.len() && mode == CrashMode::DurableOnly {
                assert!(
                    content == new,
                    "every write completed, and the fsync returned"
                );
            }
        }
    }
}

/// A fresh image of `shards` shards, mounted, with files `a` and `b` in the root (not yet
/// committed): (the filesystem, a, b).
fn files_a_and_b(shards: u32) -> (Filesystem, u64, u64) {
    let mut fs = mount(&fresh(shards));
    let root = fs.root();
    let a = fs.create(root, b"a", 0o644, 0, 0).unwrap().ino;
    let b = fs.create(root, b"b", 0o644, 0, 0).unwrap().ino;
    (fs, a, b)
}

/// Files `a` and `b` committed on a fresh image, mounted again on a recording device:
/// (the image, the write log, the filesystem, a, b).
fn two_files_recorded() -> (
    Vec<u8>,
    std::sync::Arc<nvme::wrap::WriteLog>,
    Filesystem,
    u64,
    u64,
) {
    two_files_recorded_with(MountOptions::default())
}

fn two_files_recorded_with(
    options: MountOptions,
) -> (
    Vec<u8>,
    std::sync::Arc<nvme::wrap::WriteLog>,
    Filesystem,
    u64,
    u64,
) {
    let (mut fs, a, b) = files_a_and_b(2);
    fs.sync().unwrap();
    let image = image_of(fs.unmount().unwrap());
    let (fs, log) = mount_recorded(&image, options);
    (image, log, fs, a, b)
}

/// A commit hands more data to the device than the DMA pool holds (the rest waits in the
/// backlog); a synchronous read meanwhile first drains that background I/O, which needs the
/// buffers of the writes already completed back in the pool. (It failed stop with
/// PoolExhausted when completed background writes kept their buffers until the pipeline
/// looked at them.)
#[test]
fn a_read_during_a_commit_larger_than_the_dma_pool_succeeds() {
    let (mut fs, a, b) = files_a_and_b(2);
    fs.write(b, 0, &block(7)).unwrap();
    fs.sync().unwrap();
    let image = image_of(fs.unmount().unwrap());
    let mut fs = mount(&image);
    // 6 MiB staged: more than the 4 MiB pool (64 buffers of 64 KiB), under every bound.
    let chunk: Vec<u8> = (0..16u8).flat_map(|i| block(i + 1)).collect();
    for i in 0..96u64 {
        fs.write(a, i * chunk.len() as u64, &chunk).unwrap();
    }
    assert!(fs.commit_start().unwrap(), "a commit started");
    // b's block was never read since mount: this read goes to the device.
    assert_eq!(fs.read(b, 0, 4096).unwrap(), block(7));
    fs.sync().unwrap();
    fs.check().unwrap();
    assert_eq!(
        fs.read(a, 95 * chunk.len() as u64, chunk.len()).unwrap(),
        chunk
    );
}

/// Staged data past `writeback_start_bytes` goes to the device in the background before any
/// fsync or commit asks for it, with no flush of its own, and staging stays bounded; the next
/// fsync's record is flushed after those writes. A power cut after any prefix of the writes
/// mounts clean with the file as committed (empty) or with all of the fsynced data.
#[test]
fn staged_data_past_the_threshold_is_written_back_in_the_background_and_every_cut_mounts_clean() {
    let threshold = 64 << 10;
    let options = MountOptions {
        writeback_start_bytes: threshold,
        ..MountOptions::default()
    };
    let (image, log, mut fs, a, _b) = two_files_recorded_with(options);
    let before = log.len();
    let blocks = 40u8;
    for i in 0..blocks {
        fs.write(a, i as u64 * 4096, &block(i + 1)).unwrap();
        assert!(
            fs.staged_bytes() <= threshold,
            "staged {} after write {i}",
            fs.staged_bytes()
        );
    }
    let written_back = fs.log_stats().writeback_bytes;
    assert!(written_back >= 2 * threshold as u64, "{written_back}");
    let plain_write_bytes = |records: &[Record]| -> usize {
        records
            .iter()
            .filter_map(|r| match r {
                Record::Write {
                    data, fua: false, ..
                } => Some(data.len()),
                _ => None,
            })
            .sum()
    };
    let early = log.snapshot()[before..].to_vec();
    assert!(
        plain_write_bytes(&early) > 0,
        "write-backs were submitted before any fsync"
    );
    assert!(
        !early.iter().any(|r| matches!(r, Record::Flush { .. })),
        "a write-back has no flush of its own"
    );
    // Served from memory or the device, the data reads back whole.
    let whole: Vec<u8> = (0..blocks).flat_map(|i| block(i + 1)).collect();
    assert!(fs.read(a, 0, whole.len()).unwrap() == whole, "read back");

    fs.fsync(a).unwrap();
    let records = log.snapshot();
    let flush_at = records[before..]
        .iter()
        .position(|r| matches!(r, Record::Flush { .. }))
        .map(|i| before + i)
        .expect("the fsync flushed: the written-back data is durable only then");
    assert!(
        plain_write_bytes(&records[before..flush_at]) as u64 >= written_back,
        "every write-back was submitted before the flush"
    );

    assert_every_cut_all_or_nothing(&image, &records, before, a, &[], &whole);
}

/// Once a commit is near (here: at once, the commit interval being zero), staged data goes to
/// the device past `PRECOMMIT_STAGED_BYTES` instead of the mount's much higher threshold, so
/// the commit finds little left to write; with the commit far off, the same writes stay
/// staged. A power cut after any prefix of the write-backs and the commit mounts clean with
/// the file empty (as committed) or whole.
#[test]
fn staged_data_goes_to_the_device_early_when_a_commit_is_near_and_every_cut_mounts_clean() {
    use engine::writeback::PRECOMMIT_STAGED_BYTES;
    let blocks = 160u8;
    let whole: Vec<u8> = (0..blocks).flat_map(|i| block(i + 1)).collect();
    assert!(whole.len() > 2 * PRECOMMIT_STAGED_BYTES);

    // The control: far from a commit, everything stays staged (under the 8 MiB default).
    let (_image, _log, mut far, a, _b) = two_files_recorded();
    assert!(!far.commit_near());
    for i in 0..blocks {
        far.write(a, i as u64 * 4096, &block(i + 1)).unwrap();
    }
    assert_eq!(far.staged_bytes(), whole.len());
    assert_eq!(far.log_stats().writeback_bytes, 0);

    let options = MountOptions {
        commit_interval: std::time::Duration::ZERO,
        ..MountOptions::default()
    };
    let (image, log, mut fs, a, _b) = two_files_recorded_with(options);
    assert!(fs.commit_near());
    let before = log.len();
    for i in 0..blocks {
        fs.write(a, i as u64 * 4096, &block(i + 1)).unwrap();
        assert!(
            fs.staged_bytes() <= PRECOMMIT_STAGED_BYTES,
            "staged {} after write {i}",
            fs.staged_bytes()
        );
    }
    let written_back = fs.log_stats().writeback_bytes as usize;
    assert!(
        written_back >= whole.len() - PRECOMMIT_STAGED_BYTES,
        "{written_back}"
    );
    let committed_before = fs.commit_stats().blocks_written;
    fs.sync().unwrap();
    let commit_blocks = (fs.commit_stats().blocks_written - committed_before) as usize;
    // The data left staged, the tree nodes and the superblock: far less than the file.
    assert!(
        commit_blocks * 4096 <= PRECOMMIT_STAGED_BYTES + (64 << 10),
        "the commit wrote {commit_blocks} blocks"
    );
    assert!(fs.read(a, 0, whole.len()).unwrap() == whole, "read back");
    let records = log.snapshot();
    assert_every_cut_all_or_nothing(&image, &records, before, a, &[], &whole);
}

/// A small append's record is one block (its data block travels without its zero tail), and
/// a power cut replays every append, the rest of each block zero.
#[test]
fn a_small_append_is_a_one_block_record_and_replays_with_its_zero_tail() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let ino = fs.create(root, b"wal", 0o644, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    let image = image_of(fs.unmount().unwrap());
    let (mut fs, log) = mount_recorded(&image, MountOptions::default());
    // 130-byte appends (a RocksDB WAL record's size), each made durable: they fill the
    // first block and go on into the second.
    let append = |i: u32| -> Vec<u8> { (0..130u32).map(|b| (b ^ i) as u8 | 1).collect() };
    let appends = 40u32;
    for i in 0..appends {
        fs.write(ino, i as u64 * 130, &append(i)).unwrap();
        fs.fdatasync(ino).unwrap();
    }
    let stats = fs.log_stats();
    assert_eq!(stats.log_writes, appends as u64);
    assert_eq!(stats.fallback_commits(), 0);
    // A record is one block while the block's data and the items fit it; the ones carrying
    // a nearly full block need a second.
    assert!(
        stats.log_blocks <= stats.log_writes + 4,
        "{} blocks for {} records",
        stats.log_blocks,
        stats.log_writes
    );
    let records = log.snapshot();
    let crashed = crash_image(&image, 512, &records, records.len(), CrashMode::DurableOnly);
    let mut fs = mount(&crashed);
    assert_eq!(fs.log_stats().replayed_records, appends as u64);
    let data: Vec<u8> = (0..appends).flat_map(append).collect();
    assert_eq!(fs.stat(ino).unwrap().size, data.len() as u64);
    assert_eq!(fs.read(ino, 0, data.len()).unwrap(), data);
    // Past the end, up to the end of its block, the file reads zero once it grows.
    fs.truncate(ino, 8192).unwrap();
    let tail = fs.read(ino, data.len() as u64, 8192 - data.len()).unwrap();
    assert!(tail.iter().all(|&b| b == 0));
    fs.check().unwrap();
}

/// mkfs gives each shard's log a sixteenth of its region, at most 32 MiB (fewer commits for
/// a stream of small fsyncs; every fsync arriving during a commit waits for it).
#[test]
fn mkfs_gives_each_log_a_sixteenth_of_its_region_up_to_32_mib() {
    for (capacity, shards, log_blocks) in [
        (64u64 << 20, 4u32, (64 << 20) / 4096 / 4 / 16),
        (1 << 30, 2, (1 << 30) / 4096 / 2 / 16),
        (4 << 30, 2, engine::fs::LOG_BLOCKS_MAX),
    ] {
        let dev = MemDevice::new(nvme::backend::mem::MemConfig {
            capacity_bytes: capacity,
            ..config()
        })
        .unwrap();
        let options = MkfsOptions {
            shards,
            label: "logsize".into(),
            ..Default::default()
        };
        let dev = Filesystem::mkfs(Box::new(dev), &options).unwrap();
        let fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
        let sb = fs.superblock();
        // A sixteenth of the region, rounded down (the first blocks go to the superblocks).
        assert!(
            sb.log_blocks == log_blocks || sb.log_blocks == log_blocks - 1,
            "{capacity} bytes, {shards} shards: {} log blocks",
            sb.log_blocks
        );
        assert!(sb.log_blocks <= engine::fs::LOG_BLOCKS_MAX);
    }
}

/// Extent items of every shard of the filesystem on `image`, and the data blocks they hold.
fn extents_on(image: &[u8]) -> (u64, u64) {
    let mut dev = MemDevice::from_image(image, config()).unwrap();
    let sb = engine::inspect::current_superblock(&mut dev).unwrap();
    (0..sb.shards.len() as u32)
        .map(|s| engine::inspect::shard_figures(&mut dev, &sb, s))
        .fold((0, 0), |(e, b), f| (e + f.extents, b + f.data_blocks))
}

/// Appends that continue a file's last extent on disk grow that extent (up to 256 blocks an
/// item: a 64 MiB file written 4 KiB at a time was 16,384 items, and unlinking it held the
/// reactor 8.6 ms, a tree removal each), and each append's record still carries only the
/// block it adds: the earlier blocks of the grown extent replay from the earlier records,
/// which come first. A power cut after any prefix of the I/O mounts clean with every
/// acknowledged append and nothing but appended data.
#[test]
fn appends_grow_one_extent_and_each_record_carries_only_its_new_block() {
    let mut fs = mount(&fresh(4));
    let root = fs.root();
    let ino = fs.create(root, b"log", 0o644, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    let image = image_of(fs.unmount().unwrap());
    let (mut fs, log) = mount_recorded(&image, MountOptions::default());
    const APPENDS: u8 = 40;
    // The recorded I/O's length when each fsync returned: a cut at or past it must keep it.
    let mut acked_at = Vec::new();
    for i in 0..APPENDS {
        fs.write(ino, i as u64 * 4096, &block(i + 1)).unwrap();
        fs.fsync(ino).unwrap();
        acked_at.push(log.len());
    }
    let stats = fs.log_stats();
    assert_eq!(stats.log_writes, APPENDS as u64);
    assert_eq!(stats.fallback_commits(), 0);
    assert_eq!(
        stats.log_blocks,
        2 * APPENDS as u64,
        "each record is its items' block and the one block it adds"
    );
    let records = log.snapshot();
    let whole: Vec<u8> = (0..APPENDS).flat_map(|i| block(i + 1)).collect();
    for cut in 0..=records.len() {
        for mode in [CrashMode::DurableOnly, CrashMode::Torn { seed: cut as u64 }] {
            let crashed = crash_image(&image, 512, &records, cut, mode);
            let mut fs = mount(&crashed);
            fs.check()
                .unwrap_or_else(|e| panic!("cut {cut} {mode:?}: {e}"));
            let size = fs.stat(ino).unwrap().size as usize;
            let acked = acked_at.iter().filter(|&&at| at <= cut).count() * 4096;
            assert!(
                size >= acked,
                "cut {cut} {mode:?}: {size} bytes, {acked} acknowledged"
            );
            assert_eq!(
                fs.read(ino, 0, size).unwrap(),
                whole[..size],
                "cut {cut} {mode:?}: the file is a prefix of the appends"
            );
        }
    }
    // Replayed and committed, the file is one extent.
    let crashed = crash_image(&image, 512, &records, records.len(), CrashMode::DurableOnly);
    let fs = mount(&crashed);
    // An extent per run of contiguous blocks: tree nodes the first changes of a generation
    // copy land between the data blocks here (3 runs), never one item per block (40).
    let replayed = image_of(fs.unmount().unwrap());
    let (extents, blocks) = extents_on(&replayed);
    assert_eq!(blocks, APPENDS as u64);
    assert!(extents <= 4, "{extents} extents after replay");
    let committed = image_of(fs_after_appends(&image, ino, APPENDS).unmount().unwrap());
    let (extents, blocks) = extents_on(&committed);
    assert_eq!(blocks, APPENDS as u64);
    assert!(extents <= 4, "{extents} extents when committed");
}

fn fs_after_appends(image: &[u8], ino: u64, appends: u8) -> Filesystem {
    let mut fs = mount(image);
    for i in 0..appends {
        fs.write(ino, i as u64 * 4096, &block(i + 1)).unwrap();
        fs.fsync(ino).unwrap();
    }
    fs
}

/// Background work the pipeline has not counted is work still waiting: a write-back whose
/// completion another poll took from the device (a synchronous read routes every completion
/// it meets) is done on the device but still in the pipeline until the pipeline counts it,
/// so the device must still report busy. Reported idle, a reactor with no fsync waiting never
/// advanced the pipeline again, and a due commit waited for it forever with the writes it
/// had parked (found by `reactor/tests/caller_runs.rs`, a hang in one run of four).
#[test]
fn a_write_back_completion_another_poll_took_keeps_the_device_busy_until_counted() {
    let image = fresh(1);
    let dev = MemDevice::from_image(&image, config()).unwrap();
    let options = MountOptions {
        // Write-back starts at once, and reads come from the device.
        writeback_start_bytes: 4096,
        data_cache_blocks: 0,
        ..Default::default()
    };
    let mut fs = Filesystem::mount(Box::new(dev), options).unwrap();
    let root = fs.root();
    let cold = fs.create(root, b"cold", 0o644, 0, 0).unwrap().ino;
    fs.write(cold, 0, &block(3)).unwrap();
    fs.commit().unwrap();
    let hot = fs.create(root, b"hot", 0o644, 0, 0).unwrap().ino;
    let mut written_back = false;
    for i in 0..64u64 {
        fs.write(hot, i * 4096, &block(i as u8 + 1)).unwrap();
        // A read from the device: its poll meets the write-backs' completions.
        assert_eq!(fs.read(cold, 0, 4096).unwrap(), block(3));
        if fs.log_in_flight() > 0 {
            written_back = true;
            assert!(
                fs.device_busy(),
                "write {i}: a write-back is in the pipeline but the device says idle"
            );
        }
        while fs.device_busy() {
            fs.log_progress(Some(std::time::Duration::from_millis(10)))
                .unwrap();
        }
        assert_eq!(fs.log_in_flight(), 0, "write {i}: the pipeline drained");
    }
    assert!(written_back, "the test never wrote back in the background");
}

/// `n` blocks of `seed`'s pattern, each block its own (what a file's content must be).
fn blocks_of(seed: u8, n: usize) -> Vec<u8> {
    (0..n as u8)
        .flat_map(|i| block(seed.wrapping_add(i)))
        .collect()
}

/// Bytes written to the device from record `from` of `log` on.
fn bytes_written(log: &nvme::wrap::WriteLog, from: usize) -> usize {
    log.snapshot()[from..]
        .iter()
        .filter_map(|r| match r {
            Record::Write { data, .. } => Some(data.len()),
            _ => None,
        })
        .sum()
}

/// An fsync of one new file in a directory of new files persists the others' names, not
/// their unsynced data (dbench's shape: its flush wrote all eight files of its directory).
/// After a power cut the siblings exist, empty, and the checker passes; an fsync of one of
/// them later, or of the directory, brings its data; a sibling fsynced whole before and
/// renamed since keeps every byte it was fsynced with.
#[test]
fn an_fsync_persists_new_siblings_by_name_and_leaves_their_data_to_their_own_fsync() {
    let (mut fs, log) = mount_recorded(&fresh(2), MountOptions::default());
    let root = fs.root();
    let d = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    let siblings: Vec<u64> = (0..7u8)
        .map(|i| {
            let ino = fs.create(d, &[b's', b'0' + i], 0o644, 0, 0).unwrap().ino;
            fs.write(ino, 0, &blocks_of(i * 16 + 1, 12)).unwrap();
            ino
        })
        .collect();
    let synced = fs.create(d, b"synced", 0o644, 0, 0).unwrap().ino;
    let data = blocks_of(200, 12);
    fs.write(synced, 0, &data).unwrap();
    let before = log.len();
    fs.fsync(synced).unwrap();
    let written = bytes_written(&log, before);
    assert_eq!(fs.log_stats().inodes_named_only, 7);
    assert!(
        written >= data.len() && written < 2 * data.len(),
        "the fsync wrote {written} bytes: its own {} and the record, not the siblings' {}",
        data.len(),
        7 * data.len()
    );

    // Power cut: the siblings are there by name, empty.
    let image = image_of(fs.into_device());
    let mut after = mount(&image);
    assert!(
        after.read(synced, 0, data.len()).unwrap() == data,
        "synced: wrong bytes"
    );
    for (i, &ino) in siblings.iter().enumerate() {
        assert_eq!(after.lookup(d, &[b's', b'0' + i as u8]).unwrap().ino, ino);
        let stat = after.stat(ino).unwrap();
        assert_eq!((stat.size, stat.blocks_512), (0, 0), "sibling {i}");
        assert!(after.read(ino, 0, 4096).unwrap().is_empty());
    }
    after.check().unwrap();

    // The same run carried on: a sibling's own fsync brings its data; so does an fsync of
    // the directory for the new files in it (docs/durability.md).
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let d = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    let a = fs.create(d, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &blocks_of(1, 12)).unwrap();
    let b = fs.create(d, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, &blocks_of(30, 3)).unwrap();
    fs.fsync(b).unwrap();
    assert_eq!(fs.log_stats().inodes_named_only, 1);
    fs.write(a, 12 * 4096, &block(99)).unwrap();
    fs.fsync(a).unwrap();
    let x = fs.create(d, b"x", 0o644, 0, 0).unwrap().ino;
    fs.write(x, 0, &blocks_of(50, 12)).unwrap();
    fs.fsync(d).unwrap();
    assert_eq!(
        fs.log_stats().inodes_named_only,
        1,
        "a directory's children come whole"
    );
    // A file logged whole, then renamed: entangled again by the rename, it is no longer
    // born empty, and a sibling's fsync must not log it so.
    fs.rename(d, b"a", d, b"a2", engine::RenameFlags::default())
        .unwrap();
    let c = fs.create(d, b"c", 0o644, 0, 0).unwrap().ino;
    fs.write(c, 0, &block(70)).unwrap();
    fs.fsync(c).unwrap();
    let mut after = mount(&image_of(fs.into_device()));
    let mut a_data = blocks_of(1, 12);
    a_data.extend_from_slice(&block(99));
    assert_eq!(after.lookup(d, b"a2").unwrap().ino, a);
    assert!(
        after.read(a, 0, 1 << 20).unwrap() == a_data,
        "a: wrong bytes"
    );
    assert!(
        after.read(b, 0, 1 << 20).unwrap() == blocks_of(30, 3),
        "b: wrong bytes"
    );
    assert!(
        after.read(x, 0, 1 << 20).unwrap() == blocks_of(50, 12),
        "x: wrong bytes"
    );
    assert!(
        after.read(c, 0, 1 << 20).unwrap() == block(70),
        "c: wrong bytes"
    );
    assert!(after.lookup(d, b"a").is_err());
    after.check().unwrap();
}

/// A new file renamed over an old one without an fsync of its own (write a new file, rename
/// it over the old: the atomic-replace pattern, or an exchange) is never persisted by name
/// alone: a sibling's fsync brings its content with the name. By name alone the cut would
/// show the old file gone and the name on an empty one.
#[test]
fn a_new_file_that_replaced_another_comes_whole_with_a_siblings_fsync() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let d = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    let old = fs.create(d, b"config", 0o644, 0, 0).unwrap().ino;
    fs.write(old, 0, &blocks_of(1, 3)).unwrap();
    let kept = fs.create(d, b"swap", 0o644, 0, 0).unwrap().ino;
    fs.write(kept, 0, &blocks_of(20, 2)).unwrap();
    fs.sync().unwrap();
    let new = fs.create(d, b"config.tmp", 0o644, 0, 0).unwrap().ino;
    fs.write(new, 0, &blocks_of(40, 5)).unwrap();
    fs.rename(
        d,
        b"config.tmp",
        d,
        b"config",
        engine::RenameFlags::default(),
    )
    .unwrap();
    let swapped = fs.create(d, b"swap.new", 0o644, 0, 0).unwrap().ino;
    fs.write(swapped, 0, &blocks_of(60, 4)).unwrap();
    let exchange = engine::RenameFlags {
        exchange: true,
        ..Default::default()
    };
    fs.rename(d, b"swap.new", d, b"swap", exchange).unwrap();
    let sibling = fs.create(d, b"sibling", 0o644, 0, 0).unwrap().ino;
    fs.write(sibling, 0, &block(9)).unwrap();
    fs.fsync(sibling).unwrap();
    assert_eq!(fs.log_stats().inodes_named_only, 0);
    let mut after = mount(&image_of(fs.into_device()));
    assert_eq!(after.lookup(d, b"config").unwrap().ino, new);
    assert!(
        after.read(new, 0, 1 << 20).unwrap() == blocks_of(40, 5),
        "config: wrong bytes"
    );
    assert_eq!(after.lookup(d, b"swap").unwrap().ino, swapped);
    assert!(
        after.read(swapped, 0, 1 << 20).unwrap() == blocks_of(60, 4),
        "swap: wrong bytes"
    );
    assert_eq!(after.lookup(d, b"swap.new").unwrap().ino, kept);
    assert!(
        after.read(kept, 0, 1 << 20).unwrap() == blocks_of(20, 2),
        "swap.new: wrong bytes"
    );
    after.check().unwrap();
}

/// An fsync of a directory brings its new files' content, also of one a sibling's fsync
/// already carried by name alone (the directory then has nothing of its own left to log).
#[test]
fn a_directory_fsync_brings_the_content_of_new_files_carried_by_name_before() {
    let mut fs = mount(&fresh(2));
    let root = fs.root();
    let d = fs.mkdir(root, b"d", 0o755, 0, 0).unwrap().ino;
    fs.sync().unwrap();
    let a = fs.create(d, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &blocks_of(3, 10)).unwrap();
    let b = fs.create(d, b"b", 0o644, 0, 0).unwrap().ino;
    fs.write(b, 0, &block(5)).unwrap();
    fs.fsync(b).unwrap();
    assert_eq!(fs.log_stats().inodes_named_only, 1);
    let records = fs.log_stats().log_writes;
    fs.fsync(d).unwrap();
    assert_eq!(
        fs.log_stats().log_writes,
        records + 1,
        "a record for a's content"
    );
    // Nothing left for a second one.
    fs.fsync(d).unwrap();
    assert_eq!(fs.log_stats().log_writes, records + 1);
    let mut after = mount(&image_of(fs.into_device()));
    assert!(
        after.read(a, 0, 1 << 20).unwrap() == blocks_of(3, 10),
        "a: wrong bytes"
    );
    assert!(
        after.read(b, 0, 1 << 20).unwrap() == block(5),
        "b: wrong bytes"
    );
    after.check().unwrap();
}
