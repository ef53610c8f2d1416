//! Transactions and commit, end to end on simulated devices: model-checked changes across
//! unmount/mount, a power cut at every write of several commits (each crash state mounted and
//! compared with the generation its superblocks promise), corrupt images, fail-stop on device
//! errors, and a full device. Seeds print; `COREFS_SEED=N` replays.

use engine::format::{ItemKind, Key};
use engine::{EngineError, Filesystem, MkfsOptions, MountOptions};
use nvme::backend::mem::{MemConfig, MemDevice};
use nvme::wrap::{crash_image, CrashMode, FaultConfig, FaultDevice, Record, RecordingDevice};
use nvme::{BlockDevice, OpKind};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::BTreeMap;

type Model = BTreeMap<(u32, Key), Vec<u8>>;

fn seed() -> u64 {
    nvme::wrap::seed_from_env()
}

fn mem_config(bytes: u64) -> MemConfig {
    MemConfig {
        capacity_bytes: bytes,
        lba_size_bytes: 512,
        queue_depth: 32,
        buf_bytes: 64 << 10,
        buf_count: 64,
    }
}

fn mkfs_mem(bytes: u64, shards: u32) -> MemDevice {
    let dev = MemDevice::new(mem_config(bytes)).unwrap();
    let options = MkfsOptions {
        shards,
        label: "test".into(),
        ..Default::default()
    };
    let dev = Filesystem::mkfs(Box::new(dev), &options).unwrap();
    MemDevice::from_image(&image_of(dev), mem_config(bytes)).unwrap()
}

fn random_change(fs: &mut Filesystem, model: &mut Model, rng: &mut Xoshiro256PlusPlus) {
    let shard = rng.random_range(0..fs.shard_count());
    let key = Key::new(
        256 + rng.random_range(0..400),
        ItemKind::Test,
        rng.random_range(0..4),
    );
    if rng.random_bool(0.7) {
        let value = vec![rng.random::<u8>(); rng.random_range(0..300)];
        fs.insert_item(shard, key, value.clone()).unwrap();
        model.insert((shard, key), value);
    } else {
        assert_eq!(
            fs.remove_item(shard, &key).unwrap(),
            model.remove(&(shard, key))
        );
    }
}

fn assert_matches(fs: &mut Filesystem, model: &Model, context: &str) {
    for shard in 0..fs.shard_count() {
        let got: Vec<(Key, Vec<u8>)> = fs
            .range_items(shard, Key::new(256, ItemKind::InodeItem, 0), Key::MAX)
            .unwrap()
            .into_iter()
            .filter(|(k, _)| k.kind == ItemKind::Test)
            .collect();
        let want: Vec<(Key, Vec<u8>)> = model
            .range((shard, Key::MIN)..=(shard, Key::MAX))
            .map(|((_, k), v)| (*k, v.clone()))
            .collect();
        assert!(
            got == want,
            "{context}: shard {shard} has {} items, model {}",
            got.len(),
            want.len()
        );
    }
    fs.check()
        .unwrap_or_else(|e| panic!("{context}: check failed: {e}"));
}

#[test]
fn changes_survive_unmount_and_mount() {
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut dev: Box<dyn BlockDevice> = Box::new(mkfs_mem(32 << 20, 4));
    let mut model = Model::new();
    for round in 0..8 {
        let mut fs = Filesystem::mount(
            dev,
            MountOptions {
                cache_nodes: 8,
                ..Default::default()
            },
        )
        .unwrap();
        assert_matches(
            &mut fs,
            &model,
            &format!("seed {seed} round {round} after mount"),
        );
        for _ in 0..rng.random_range(1..3) {
            for _ in 0..rng.random_range(0..600) {
                random_change(&mut fs, &mut model, &mut rng);
            }
            fs.commit().unwrap();
        }
        assert_matches(
            &mut fs,
            &model,
            &format!("seed {seed} round {round} before unmount"),
        );
        dev = fs.unmount().unwrap();
    }
}

#[test]
fn a_commit_with_nothing_to_do_writes_nothing() {
    let mut fs =
        Filesystem::mount(Box::new(mkfs_mem(8 << 20, 2)), MountOptions::default()).unwrap();
    assert_eq!(
        fs.commit().unwrap(),
        2,
        "mkfs committed the root as generation 2"
    );
    assert_eq!(fs.commit_stats().commits, 0);
    fs.insert_item(1, Key::new(300, ItemKind::Test, 0), vec![1])
        .unwrap();
    assert_eq!(fs.commit().unwrap(), 3);
    assert_eq!(fs.commit().unwrap(), 3);
    assert_eq!(fs.commit_stats().commits, 1);
    assert!(matches!(
        fs.insert_item(0, Key::new(5, ItemKind::Test, 0), vec![]),
        Err(EngineError::Invalid(_))
    ));
}

/// A power cut after every record of the write log, in every crash mode: the mounted state is
/// exactly the generation of the last superblock written before the cut.
#[test]
fn power_cut_at_every_write_gives_a_whole_generation() {
    let seed = seed();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let base = mkfs_mem(8 << 20, 2);
    let base_image = base.image().to_vec();
    let recording = RecordingDevice::new(base);
    let log = recording.log();
    let mut fs = Filesystem::mount(
        Box::new(recording),
        MountOptions {
            cache_nodes: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let mut models: BTreeMap<u64, Model> = BTreeMap::new();
    models.insert(2, Model::new());
    let mut model = Model::new();
    for _ in 0..12 {
        for _ in 0..rng.random_range(50..400) {
            random_change(&mut fs, &mut model, &mut rng);
        }
        let generation = fs.commit().unwrap();
        models.insert(generation, model.clone());
    }
    drop(fs);
    let records = log.snapshot();
    // Which generation each record index has made durable: superblock writes are FUA.
    let superblock_lbas = [0u64, 8]; // blocks 0 and 1 at 512-byte LBAs
    let mut durable_at = vec![2u64; records.len() + 1];
    let mut durable = 2;
    for (i, record) in records.iter().enumerate() {
        if let Record::Write {
            lba,
            data,
            fua: true,
        } = record
        {
            if superblock_lbas.contains(lba) {
                durable = u64::from_le_bytes(data[16..24].try_into().unwrap());
            }
        }
        durable_at[i + 1] = durable;
    }
    let mut mounts = 0;
    for cut in 0..=records.len() {
        for mode in [
            CrashMode::DurableOnly,
            CrashMode::AllLanded,
            CrashMode::Torn {
                seed: seed ^ cut as u64,
            },
        ] {
            let image = crash_image(&base_image, 512, &records, cut, mode);
            let dev = MemDevice::from_image(&image, mem_config(image.len() as u64)).unwrap();
            let context = format!("seed {seed} cut {cut}/{} {mode:?}", records.len());
            let mut fs = Filesystem::mount(Box::new(dev), MountOptions::default())
                .unwrap_or_else(|e| panic!("{context}: mount: {e}"));
            assert_eq!(fs.durable_generation(), durable_at[cut], "{context}");
            assert_matches(&mut fs, &models[&durable_at[cut]], &context);
            mounts += 1;
        }
    }
    eprintln!(
        "{mounts} crash states mounted and checked over {} records",
        records.len()
    );
}

#[test]
fn corrupt_images_are_refused_by_name_and_one_bad_superblock_is_survived() {
    let mut dev = mkfs_mem(8 << 20, 2);
    {
        let mut fs = Filesystem::mount(
            Box::new(MemDevice::from_image(&dev.image(), mem_config(8 << 20)).unwrap()),
            MountOptions::default(),
        )
        .unwrap();
        for i in 0..500 {
            fs.insert_item(
                i % 2,
                Key::new(256 + i as u64, ItemKind::Test, 0),
                vec![7; 100],
            )
            .unwrap();
        }
        fs.commit().unwrap();
        let image = image_of(fs.unmount().unwrap());
        dev = MemDevice::from_image(&image, mem_config(8 << 20)).unwrap();
    }
    let image = dev.image().to_vec();
    let mount = |image: &[u8]| {
        Filesystem::mount(
            Box::new(MemDevice::from_image(image, mem_config(8 << 20)).unwrap()),
            MountOptions::default(),
        )
    };

    // Both superblocks garbage: a clear error naming both.
    let mut bad = image.clone();
    bad[..8192].fill(0xee);
    let err = mount(&bad).err().unwrap();
    assert!(
        matches!(
            err,
            EngineError::Corrupt {
                what: "superblock",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("copy 0") && err.to_string().contains("copy 1"),
        "{err}"
    );

    // The newest copy torn: the previous generation mounts.
    let mut torn = image.clone();
    let newest = if u64::from_le_bytes(image[16..24].try_into().unwrap())
        > u64::from_le_bytes(image[4096 + 16..4096 + 24].try_into().unwrap())
    {
        0
    } else {
        4096
    };
    torn[newest + 300] ^= 1;
    let fs = mount(&torn).unwrap();
    assert_eq!(fs.durable_generation(), 2, "fell back to mkfs's generation");

    // A flipped bit in a tree node: reported with its block when read, never returned.
    for shard in 0..2u32 {
        let sb = mount(&image).unwrap().superblock().clone();
        let root = sb.shards[shard as usize].tree.addr as usize;
        let mut rotten = image.clone();
        rotten[root * 4096 + 1000] ^= 0x40;
        match mount(&rotten) {
            Err(EngineError::Corrupt { block, why, .. }) => {
                assert_eq!(block as usize, root);
                assert!(why.contains("checksum"), "{why}");
            }
            Ok(_) => panic!("a corrupt root mounted"),
            Err(e) => panic!("unexpected error {e}"),
        }
    }
}

/// The whole content of a device, read through its queue.
fn image_of(mut dev: Box<dyn BlockDevice>) -> Vec<u8> {
    let mut image = vec![0u8; dev.info().capacity_bytes() as usize];
    nvme::read_sync(&mut *dev, 0, &mut image).unwrap();
    image
}

#[test]
fn a_failed_write_makes_the_filesystem_fail_stop_and_remount_recovers() {
    for kind in [OpKind::Write, OpKind::Flush] {
        let faulty = FaultDevice::new(
            mkfs_mem(8 << 20, 2),
            FaultConfig {
                seed: 5,
                ..Default::default()
            },
        );
        let faults = faulty.handle();
        let mut fs = Filesystem::mount(Box::new(faulty), MountOptions::default()).unwrap();
        let key = |i: u64| Key::new(256 + i, ItemKind::Test, 0);
        fs.insert_item(0, key(1), vec![1; 10]).unwrap();
        assert_eq!(fs.commit().unwrap(), 3);
        fs.insert_item(0, key(2), vec![2; 10]).unwrap();
        faults.fail_next(kind, 1);
        let err = fs.commit().unwrap_err();
        assert!(matches!(err, EngineError::Device(_)), "{kind}: {err}");
        assert!(
            matches!(
                fs.insert_item(0, key(3), vec![]),
                Err(EngineError::ReadOnly(_))
            ),
            "{kind}: not sticky"
        );
        assert!(matches!(fs.commit(), Err(EngineError::ReadOnly(_))));
        assert_eq!(fs.durable_generation(), 3);
        // A remount recovers the last durable generation: key 1, not key 2.
        let image = image_of(fs.into_device());
        let mut fs = Filesystem::mount(
            Box::new(MemDevice::from_image(&image, mem_config(8 << 20)).unwrap()),
            MountOptions::default(),
        )
        .unwrap();
        assert_eq!(fs.durable_generation(), 3, "{kind}");
        assert_eq!(fs.get_item(0, &key(1)).unwrap(), Some(vec![1; 10]));
        assert_eq!(fs.get_item(0, &key(2)).unwrap(), None);
        fs.check().unwrap();
    }
}

#[test]
fn a_full_device_gives_enospc_and_still_commits() {
    let mut fs =
        Filesystem::mount(Box::new(mkfs_mem(2 << 20, 1)), MountOptions::default()).unwrap();
    let mut inserted = 0u64;
    let err = loop {
        match fs.insert_item(0, Key::new(256 + inserted, ItemKind::Test, 0), vec![9; 900]) {
            Ok(_) => inserted += 1,
            Err(e) => break e,
        }
        if inserted % 50 == 0 {
            if let Err(e) = fs.commit() {
                break e;
            }
        }
    };
    assert_eq!(err, EngineError::NoSpace, "after {inserted} items");
    // The reserve lets the commit finish: everything inserted before ENOSPC is durable.
    let generation = fs.commit().unwrap();
    let dev = fs.unmount().unwrap();
    let mut fs = Filesystem::mount(dev, MountOptions::default()).unwrap();
    assert_eq!(fs.durable_generation(), generation);
    assert_eq!(
        fs.range_items(0, Key::new(256, ItemKind::Test, 0), Key::MAX)
            .unwrap()
            .len() as u64,
        inserted
    );
    // Deleting frees space once committed; new inserts then succeed.
    for i in 0..inserted / 2 {
        fs.remove_item(0, &Key::new(256 + i, ItemKind::Test, 0))
            .unwrap();
    }
    fs.commit().unwrap();
    for i in 0..20 {
        fs.insert_item(0, Key::new(100_000 + i, ItemKind::Test, 0), vec![1; 900])
            .unwrap();
    }
    fs.commit().unwrap();
    fs.check().unwrap();
}
