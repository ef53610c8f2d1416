//! `corefs bench show`: a saved suite result's tables, and its plots drawn again.

use corefs_bench::suite::{self, results::SuiteResults};
use std::path::PathBuf;

/// Prints the tables and redraws the plots of a results.json.
#[derive(clap::Args)]
pub struct Args {
    results: PathBuf,
    /// Where to write the plots (default: beside the file).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), String> {
    let r = SuiteResults::load(&args.results)?;
    print!("{}{}", suite::side_by_side(&r), suite::details(&r));
    let dir = args.out.unwrap_or_else(|| {
        args.results
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."))
    });
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let files = suite::plot::write_plots(&r, &dir)?;
    println!("{} plots in {}", files.len(), dir.display());
    Ok(())
}
