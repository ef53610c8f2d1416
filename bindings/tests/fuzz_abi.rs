//! The C ABI under seeded random call programs (`corefs::fuzz_harness`, also the `c_abi`
//! cargo-fuzz target): no call may panic, crash or hang, and the filesystem closes cleanly.
//! Seeds print; `COREFS_SEED=N` replays.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

#[test]
fn random_call_programs_never_crash() {
    let seed = nvme::wrap::seed_from_env();
    eprintln!("seed {seed}");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for _ in 0..300 {
        let program: Vec<u8> = (0..rng.random_range(0..3000))
            .map(|_| rng.random())
            .collect();
        corefs::fuzz_harness::abi_calls(&program);
    }
}
