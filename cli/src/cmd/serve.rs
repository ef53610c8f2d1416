//! `corefs serve`: the filesystem as a storage service other processes connect to
//! (`corefs_connect`, the device string `serve:PATH`): `corefs::service::server` does the
//! serving; this command starts the reactors, installs the stop signals and reports.

use super::mount::Reactors;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

/// Serve a filesystem to other processes over a Unix socket until SIGTERM or SIGINT: they
/// use it through libcorefs (`corefs_connect`, or `serve:SOCKET` as the device string) at
/// shared-memory speed, each as its own user (the server checks permissions as the kernel
/// does). The socket's mode decides who may connect (it is made under the process's umask:
/// `umask 000` lets everyone). On a stop signal: no new client, what is in flight finishes,
/// every client's open files are released, the filesystem is committed and unmounted.
#[derive(clap::Args)]
pub struct Args {
    /// Device string: file:PATH, nvme:/dev/ngXnY.
    device: String,
    /// Where to listen (a path; a socket file left by a killed server is replaced).
    #[arg(long)]
    socket: PathBuf,
    #[command(flatten)]
    reactors: Reactors,
}

/// Set by SIGTERM and SIGINT: the serve loop stops at its next look (within 100 ms).
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::Release);
}

fn install_stop_signals() -> Result<(), String> {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a handler that only stores an atomic.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_stop_signal as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(format!(
                "installing the stop signal: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

pub fn run(args: Args) -> Result<(), String> {
    let Args {
        device,
        socket,
        reactors,
    } = args;
    install_stop_signals()?;
    let runtime = reactors.start(&device, engine::MountOptions::default())?;
    eprintln!(
        "corefs: serving {device} at {} (stop with SIGTERM or SIGINT)",
        socket.display()
    );
    let reactor_cores = match reactors.core {
        Some(c) => (c..c + reactors.reactors.max(1)).collect(),
        None => Vec::new(),
    };
    let options = corefs::service::server::ServeOptions {
        reactor_cores,
        busy_poll: reactors.busy_poll,
    };
    let served = corefs::service::server::serve(runtime, &socket, &STOP, &options)
        .map_err(|e| format!("serving at {}: {e}", socket.display()))?;
    eprintln!(
        "corefs: stopped: {} connections, {} open files released for clients that went \
         without closing them; {device} committed and unmounted",
        served.connections, served.holds_released_for_gone_clients
    );
    Ok(())
}
