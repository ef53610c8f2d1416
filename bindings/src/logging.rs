//! `COREFS_LOG`: the library's log, on request. When the environment variable is set at the
//! first `corefs_mount` of a process, libcorefs installs a `tracing` subscriber writing to
//! stderr, filtered by the variable's value (an `EnvFilter` directive: `warn`,
//! `corefs_engine=debug,info`, ...). A C program has no other way to see the engine's
//! warnings (a shard failing, a slow commit) short of a Rust host of its own.
//!
//! # Invariants
//! - At most one attempt per process, at the first mount (later mounts, and a variable set
//!   later, change nothing); without `COREFS_LOG` nothing is installed.
//! - A subscriber the host already installed stays: the global default is set only if none
//!   is, and the `log` crate's logger is left alone (no `LogTracer`), so a host logging
//!   through `log` keeps its logger too.
//! - Never panics and never exits (a library): a directive that does not parse is reported
//!   once on stderr and logging stays off.

use std::io::{IsTerminal, Write};
use std::sync::Once;
use tracing_subscriber::EnvFilter;

static INIT: Once = Once::new();

/// Installs the stderr subscriber if `COREFS_LOG` asks for one (first call only).
pub(crate) fn init_from_env() {
    INIT.call_once(|| {
        // A panic here would poison `INIT`, and every later mount would panic on it.
        let _ = std::panic::catch_unwind(install);
    });
}

fn install() {
    let Some(spec) = std::env::var_os("COREFS_LOG") else {
        return;
    };
    let spec = spec.to_string_lossy();
    let filter = match EnvFilter::try_new(spec.as_ref()) {
        Ok(filter) => filter,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "libcorefs: COREFS_LOG={spec:?} is not a filter ({e}); logging stays off"
            );
            return;
        }
    };
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .finish();
    // Err: the host installed one first, which stays.
    let _ = tracing::subscriber::set_global_default(subscriber);
}
