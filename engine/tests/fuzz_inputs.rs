//! The fuzz targets' harnesses (`engine::fuzz_harness`, also driven by `fuzz/` under cargo
//! fuzz) on seeded random inputs, so every test run tries a few hundred damaged images and log
//! areas: none may panic. Seeds print; `COREFS_SEED=N` replays.

use engine::fuzz_harness::{log_record, mount_image, structured_image, template, IMAGE_BYTES};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

fn seed() -> u64 {
    nvme::wrap::seed_from_env()
}

/// Patches in the harness's format: (block u16, offset u16, len u8, bytes).
fn patches(rng: &mut Xoshiro256PlusPlus, blocks: &[u16]) -> Vec<u8> {
    let mut out = vec![1u8]; // mode: patch the template
    for _ in 0..rng.random_range(1..6) {
        let block = blocks[rng.random_range(0..blocks.len())];
        out.extend_from_slice(&block.to_le_bytes());
        out.extend_from_slice(&rng.random_range(0..4096u16).to_le_bytes());
        let len = rng.random_range(1..24u8);
        out.push(len);
        out.extend((0..len).map(|_| rng.random::<u8>()));
    }
    out
}

#[test]
fn damaged_images_never_panic() {
    let seed = seed();
    eprintln!("seed {seed}");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // The blocks the template uses: damage there reaches the engine's decoders.
    let used: Vec<u16> = template()
        .chunks(4096)
        .enumerate()
        .filter(|(_, b)| b.iter().any(|&x| x != 0))
        .map(|(i, _)| i as u16)
        .collect();
    assert!(used.len() > 8, "the template has content");
    for i in 0..1500 {
        let input = if i % 10 == 0 {
            // Raw bytes as the whole image.
            let mut v = vec![0u8];
            v.extend((0..rng.random_range(1..512)).map(|_| rng.random::<u8>()));
            v
        } else {
            patches(&mut rng, &used)
        };
        mount_image(&input);
    }
    assert_eq!(IMAGE_BYTES % 4096, 0);
}

#[test]
fn damaged_log_records_never_panic() {
    let seed = seed();
    eprintln!("seed {seed}");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let sb = engine::inspect::superblocks(
        &mut nvme::backend::mem::MemDevice::from_image(
            template(),
            nvme::backend::mem::MemConfig {
                capacity_bytes: IMAGE_BYTES as u64,
                lba_size_bytes: 4096,
                queue_depth: 32,
                buf_bytes: 128 << 10,
                buf_count: 32,
            },
        )
        .unwrap(),
    )
    .into_iter()
    .filter_map(|(_, s)| s.ok())
    .max_by_key(|s| s.generation)
    .unwrap();
    // The template's real log area of shard 0, mutated.
    let start = sb.region_start(0) as usize * 4096;
    let area = &template()[start..start + 3 * 4096];
    for _ in 0..800 {
        let mut bytes = area.to_vec();
        for _ in 0..rng.random_range(1..8) {
            let at = rng.random_range(0..bytes.len());
            bytes[at] = rng.random();
        }
        let cut = rng.random_range(1..bytes.len());
        log_record(&bytes[..cut]);
    }
    for _ in 0..200 {
        let random: Vec<u8> = (0..rng.random_range(0..9000))
            .map(|_| rng.random())
            .collect();
        log_record(&random);
    }
}

/// Inputs the structure-aware harness reads (see `engine::fuzz_harness::structured_image`):
/// a selector byte, then mutations, each a few bytes.
fn structured_input(rng: &mut Xoshiro256PlusPlus) -> Vec<u8> {
    (0..rng.random_range(1..64)).map(|_| rng.random()).collect()
}

/// 300 seeded inputs for the structure-aware harness. Before the decoders checked structure,
/// about 7% of them panicked: double frees (a child reachable twice, a bitmap bit moved off a
/// node, extents sharing a node's block), an inode counter in another shard's residue class,
/// overflows of a generation, an extent's end and `blocks × 8`, out-of-region frees.
#[test]
fn structurally_damaged_images_never_panic() {
    let seed = seed();
    eprintln!("seed {seed}");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for i in 0..300 {
        let input = structured_input(&mut rng);
        let outcome = std::panic::catch_unwind(|| structured_image(&input));
        if let Err(panic) = outcome {
            eprintln!("seed {seed}, input {i} panicked: {input:02x?}");
            std::panic::resume_unwind(panic);
        }
    }
}

/// Inputs that once panicked (fuzz/regressions/structured_image/, one per bug, named after
/// it). They are read by the harness as it is now: a change to the harness's template or
/// input format turns them into ordinary inputs, still run.
#[test]
fn structured_regressions_never_panic() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions/structured_image");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).expect("the regression inputs") {
        let path = entry.unwrap().path();
        let input = std::fs::read(&path).unwrap();
        eprintln!("{}", path.display());
        structured_image(&input);
        count += 1;
    }
    assert!(count >= 8, "{count} regression inputs in {}", dir.display());
}
