//! A storage server in this process, on a fresh in-memory filesystem, for the service's C ABI
//! tests: started listening, connected to through `corefs_connect`, stopped cleanly (the
//! server must exit without error). Included with `#[path]` by the tests that need it.

use corefs::abi::*;
use std::ffi::CString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct InProcessServer {
    _dir: tempfile::TempDir,
    pub socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<std::io::Result<corefs::service::server::Served>>>,
}

impl InProcessServer {
    /// A server of a new 128 MiB in-memory filesystem, listening when this returns.
    pub fn start() -> InProcessServer {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s.sock");
        let runtime = reactor::Runtime::start(reactor::Config {
            device: "mem:128MiB".into(),
            mkfs: Some(Default::default()),
            ..reactor::Config::default()
        })
        .expect("start the reactors");
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (socket, stop) = (socket.clone(), stop.clone());
            std::thread::spawn(move || {
                corefs::service::server::serve(runtime, &socket, &stop, &Default::default())
            })
        };
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(!thread.is_finished(), "the server ended before it listened");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        InProcessServer {
            _dir: dir,
            socket,
            stop,
            thread: Some(thread),
        }
    }

    /// A new connection through the C ABI (`corefs_connect`).
    pub fn connect(&self) -> corefs_fs {
        let c_socket = CString::new(self.socket.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path; no options.
        let fs = unsafe { corefs_connect(c_socket.as_ptr(), std::ptr::null()) };
        assert!(fs > 0, "connect: {}", last_error());
        fs
    }

    /// Stops the server as SIGTERM would; it must exit cleanly.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.take().expect("stopped once");
        thread.join().unwrap().expect("the server stops cleanly");
    }
}

pub fn last_error() -> String {
    // SAFETY: corefs_last_error returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(corefs_last_error()) }
        .to_string_lossy()
        .into_owned()
}
