//! `corefs bench`: the suite (`suite`, `compare`, `show`) and the narrower benchmarks of one
//! layer each (`engine`, `clients`, `fsync`, `device`), all from `corefs_bench`. Each prints
//! its report; the narrower ones can also write it as JSON (`--json`).

mod clients;
mod compare;
mod device;
mod engine;
mod fsync;
mod show;
mod suite;

#[derive(clap::Subcommand)]
pub enum Bench {
    Suite(suite::Args),
    Compare(compare::Args),
    Show(show::Args),
    Engine(engine::Args),
    Clients(clients::Args),
    Fsync(fsync::Args),
    Device(device::Args),
}

pub fn run(bench: Bench) -> Result<(), String> {
    match bench {
        Bench::Suite(args) => suite::run(args),
        Bench::Compare(args) => compare::run(args),
        Bench::Show(args) => show::run(args),
        Bench::Engine(args) => engine::run(args),
        Bench::Clients(args) => clients::run(args),
        Bench::Fsync(args) => fsync::run(args),
        Bench::Device(args) => device::run(args),
    }
}
