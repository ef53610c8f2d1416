//! Partitions driven by hand in one thread, the way the reactors drive them across cores: a
//! whole mount split into two partitions on queues of their own, local operations and fsyncs
//! in each (two log streams), operations spanning both run on the coordinator with the
//! shards lent, coordinated commits, and a power cut replaying both streams.

use engine::commit::CommitWritten;
use engine::log::FsyncStart;
use engine::partition::Lent;
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions, RenameFlags};
use nvme::backend::mem::{MemConfig, MemDevice};

fn config() -> MemConfig {
    MemConfig {
        capacity_bytes: 64 << 20,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 64,
    }
}

struct Split {
    coordinator: Filesystem,
    parts: Vec<Filesystem>,
    /// A queue kept to read the device image as a power cut leaves it.
    probe: MemDevice,
}

/// mkfs with 4 shards, a directory in each shard, then split: partition 0 holds shards 0 and
/// 2, partition 1 holds 1 and 3.
fn split() -> (Split, Vec<u64>) {
    let dev = MemDevice::new(config()).unwrap();
    let probe = dev.new_queue().unwrap();
    let second = dev.new_queue().unwrap();
    let third = dev.new_queue().unwrap();
    let options = MkfsOptions {
        shards: 4,
        label: "parts".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(dev), &options).unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    let root = fs.root();
    let dirs: Vec<u64> = (0..4)
        .map(|i| {
            fs.mkdir(root, format!("d{i}").as_bytes(), 0o755, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    fs.commit().unwrap();
    let mut shards_of_dirs: Vec<u32> = dirs.iter().map(|&d| fs.shard_of(d)).collect();
    shards_of_dirs.sort();
    assert_eq!(
        shards_of_dirs,
        vec![0, 1, 2, 3],
        "round-robin spreads the dirs"
    );
    let a = fs.take_shards(&[0, 2]).unwrap();
    let b = fs.take_shards(&[1, 3]).unwrap();
    let p0 = Filesystem::from_shards(Box::new(second), &fs.partition_template(0), a);
    let p1 = Filesystem::from_shards(Box::new(third), &fs.partition_template(1), b);
    fs.set_partitioned();
    (
        Split {
            coordinator: fs,
            parts: vec![p0, p1],
            probe,
        },
        dirs,
    )
}

impl Split {
    fn owner(&self, ino: u64) -> usize {
        let shard = self.coordinator.shard_of(ino);
        self.parts.iter().position(|p| p.holds(shard)).unwrap()
    }

    /// Runs `op` on the coordinator with every shard lent, as the runtime does for an
    /// operation spanning partitions; marks what it changed, gives the shards back.
    fn spanning<T>(&mut self, op: impl FnOnce(&mut Filesystem) -> T) -> T {
        let lent: Vec<(usize, Lent)> = self
            .parts
            .iter_mut()
            .enumerate()
            .map(|(i, p)| {
                let ids = p.held_ids();
                (i, p.take_shards(&ids).unwrap())
            })
            .collect();
        let mut owners = Vec::new();
        for (i, l) in lent {
            owners.push((i, l.ids()));
            self.coordinator.put_shards(l);
        }
        let out = op(&mut self.coordinator);
        self.coordinator.mark_cross();
        for (i, ids) in owners {
            let back = self.coordinator.take_shards(&ids).unwrap();
            self.parts[i].put_shards(back);
        }
        out
    }

    /// The coordinated commit: every partition writes its half, the coordinator writes the
    /// superblock, everyone moves to the next generation.
    fn commit(&mut self) -> u64 {
        let halves: Vec<CommitWritten> = self
            .parts
            .iter_mut()
            .map(|p| {
                p.commit_write()
                    .unwrap()
                    .expect("a partition always writes a half, if only to move to N+1")
            })
            .collect();
        let roots: Vec<_> = halves.iter().flat_map(|h| h.roots.clone()).collect();
        assert!(halves
            .iter()
            .all(|h| h.generation == self.coordinator.generation()));
        let sb = self.coordinator.write_super(&roots).unwrap();
        for p in self.parts.iter_mut() {
            p.commit_finish(&sb);
            p.complete_commit();
        }
        self.coordinator.commit_finish(&sb);
        self.coordinator.complete_commit();
        sb.generation
    }

    fn image(&self) -> Vec<u8> {
        self.probe.image()
    }
}

fn fsync_start(fs: &mut Filesystem, ino: u64) -> FsyncStart {
    fs.check_exists(ino).unwrap();
    fs.fsync_group_start(&[(ino, false)]).unwrap()
}

fn durable(fs: &mut Filesystem, start: FsyncStart) {
    match start {
        FsyncStart::Durable => {}
        FsyncStart::Pending(ticket) => fs.wait_durable(ticket).unwrap(),
        FsyncStart::NeedsCommit | FsyncStart::AfterCommit { .. } => {
            panic!("expected a logged fsync")
        }
    }
}

fn remount(image: &[u8]) -> Filesystem {
    let dev = MemDevice::from_image(image, config()).unwrap();
    Filesystem::mount(Box::new(dev), MountOptions::default()).unwrap()
}

fn data(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn partitions_log_in_their_own_streams_and_replay_independently() {
    let (mut s, dirs) = split();
    // A file in each directory, created on the partition owning the directory: local.
    let mut files = Vec::new();
    for (i, &dir) in dirs.iter().enumerate() {
        let owner = s.owner(dir);
        let p = &mut s.parts[owner];
        let file = p.create(dir, b"f", 0o644, 0, 0).unwrap().ino;
        assert_eq!(
            s.owner(file),
            owner,
            "a file goes to its directory's partition"
        );
        let p = &mut s.parts[owner];
        p.write(file, 0, &data(i as u8, 10_000)).unwrap();
        let start = fsync_start(p, file);
        assert!(
            matches!(start, FsyncStart::Pending(_)),
            "logged, not committed"
        );
        durable(p, start);
        files.push((i, file));
    }
    assert_eq!(s.parts[0].log_stats().log_writes, 2);
    assert_eq!(s.parts[1].log_stats().log_writes, 2);
    assert_eq!(s.parts[0].commit_stats().commits, 0);
    // Power cut: both streams replay.
    let mut fs = remount(&s.image());
    assert_eq!(fs.log_stats().replayed_records, 4);
    for (i, _) in &files {
        let ino = fs.resolve(&format!("d{i}/f")).unwrap();
        assert_eq!(fs.read(ino, 0, 20_000).unwrap(), data(*i as u8, 10_000));
    }
    fs.check().unwrap();
}

#[test]
fn an_operation_spanning_partitions_is_committed_not_logged() {
    let (mut s, dirs) = split();
    let (from, to) = (dirs[0], dirs[1]);
    assert_ne!(
        s.owner(from),
        s.owner(to),
        "the two dirs are in different partitions"
    );
    let owner = s.owner(from);
    let file = s.parts[owner]
        .create(from, b"moving", 0o644, 0, 0)
        .unwrap()
        .ino;
    s.parts[owner].write(file, 0, &data(7, 5000)).unwrap();
    // Moving it into the other partition's directory needs shards of both.
    let denied = s.parts[owner].rename(from, b"moving", to, b"moved", RenameFlags::default());
    assert!(
        matches!(denied, Err(EngineError::Invalid(_))),
        "a partition refuses (and fails stop) rather than change a shard it does not hold"
    );
    // That refusal made the partition fail-stop: start over, routing it right this time.
    let (mut s, dirs) = split();
    let (from, to) = (dirs[0], dirs[1]);
    let owner = s.owner(from);
    let file = s.parts[owner]
        .create(from, b"moving", 0o644, 0, 0)
        .unwrap()
        .ino;
    s.parts[owner].write(file, 0, &data(7, 5000)).unwrap();
    s.spanning(|fs| {
        fs.rename(from, b"moving", to, b"moved", RenameFlags::default())
            .unwrap()
    });
    // Both halves are visible to their owners at once.
    let to_owner = s.owner(to);
    assert_eq!(
        s.parts[to_owner].lookup_ino(to, b"moved").unwrap(),
        Some(file)
    );
    assert_eq!(s.parts[owner].lookup_ino(from, b"moving").unwrap(), None);
    // The file's owner cannot log it (its new name lives in the other partition).
    let p = &mut s.parts[owner];
    assert!(matches!(fsync_start(p, file), FsyncStart::NeedsCommit));
    assert_eq!(p.log_stats().fallback_cross, 1);
    let generation = s.commit();
    // After the commit it logs again.
    let p = &mut s.parts[owner];
    p.write(file, 5000, &data(8, 3000)).unwrap();
    let start = fsync_start(p, file);
    assert!(matches!(start, FsyncStart::Pending(_)));
    durable(p, start);
    let mut fs = remount(&s.image());
    assert_eq!(fs.durable_generation(), generation + 1, "replay committed");
    let ino = fs.resolve("d1/moved").unwrap();
    assert_eq!(ino, file);
    let mut want = data(7, 5000);
    want.extend(data(8, 3000));
    assert_eq!(fs.read(ino, 0, 10_000).unwrap(), want);
    assert!(fs.resolve("d0/moving").is_err());
    fs.check().unwrap();
}

#[test]
fn coordinated_commits_keep_every_partition_in_one_generation() {
    let (mut s, dirs) = split();
    for round in 0..5u8 {
        for &dir in &dirs {
            let owner = s.owner(dir);
            let p = &mut s.parts[owner];
            let name = format!("r{round}");
            let ino = p.create(dir, name.as_bytes(), 0o644, 0, 0).unwrap().ino;
            p.write(ino, 0, &data(round, 3000)).unwrap();
        }
        // A directory made in the other partition: the spanning path.
        let owner = s.owner(dirs[0]);
        let other = 1 - owner;
        let target = s.parts[other].held_ids()[round as usize % 2];
        let sub = s.spanning(|fs| {
            fs.place_next(target);
            fs.mkdir(dirs[0], format!("sub{round}").as_bytes(), 0o755, 0, 0)
                .unwrap()
        });
        // The owner's placement holds: the directory lives in the shard it named.
        assert_eq!(s.coordinator.shard_of(sub.ino), target);
        let generation = s.commit();
        for p in &s.parts {
            assert_eq!(p.generation(), generation + 1);
            assert_eq!(p.durable_generation(), generation);
        }
        assert_eq!(s.coordinator.generation(), generation + 1);
    }
    // A clean shutdown is a commit; everything is there and consistent.
    s.commit();
    let mut fs = remount(&s.image());
    assert_eq!(fs.log_stats().replayed_records, 0);
    for round in 0..5u8 {
        for i in 0..4 {
            let ino = fs.resolve(&format!("d{i}/r{round}")).unwrap();
            assert_eq!(fs.read(ino, 0, 4096).unwrap(), data(round, 3000));
        }
        let sub = fs.resolve(&format!("d0/sub{round}")).unwrap();
        assert_eq!(fs.stat(sub).unwrap().nlink, 2);
    }
    let report = fs.check().unwrap();
    assert_eq!(report.inodes, 1 + 4 + 20 + 5, "{report:?}");
}
