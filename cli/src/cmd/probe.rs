//! `corefs probe`: the kernel features corefs uses, as `nvme::probe` finds them.

/// Report the kernel features corefs uses and what to do about missing ones.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> Result<(), String> {
    print!("{}", nvme::probe::probe());
    Ok(())
}
