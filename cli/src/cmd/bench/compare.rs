//! `corefs bench compare`: two suite results side by side (`corefs_bench::suite::compare`).

use corefs_bench::suite::results::SuiteResults;
use std::path::PathBuf;

/// Lines up two suite results (baseline, current): mean and stdev over repeats, percent
/// difference, `*` where it exceeds two baseline stdevs.
#[derive(clap::Args)]
pub struct Args {
    baseline: PathBuf,
    current: PathBuf,
}

pub fn run(args: Args) -> Result<(), String> {
    let base = SuiteResults::load(&args.baseline)?;
    let current = SuiteResults::load(&args.current)?;
    print!("{}", corefs_bench::suite::compare::report(&base, &current));
    Ok(())
}
