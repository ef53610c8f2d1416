//! The storage service as a target (`corefs-serve`, a [`ServerTarget`]): a `corefs serve`
//! process, and the workload's clients connected through libcorefs (`corefs_connect`), so
//! every call crosses processes through the shared-memory ring. It stops on SIGTERM.

use super::abi::CAbiMount;
use super::results::EngineFigures;
use super::server::{Kind, ServerTarget};
use super::session::{Session, R};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Child;

pub const LABEL: &str = "corefs-serve";

pub type ServeTarget = ServerTarget<Serve>;

pub struct Serve {
    socket: PathBuf,
    mount: Option<CAbiMount>,
}

impl Serve {
    /// The service listening in `dir`.
    pub fn new(dir: &Path) -> Serve {
        Serve {
            socket: dir.join("corefs-serve.sock"),
            mount: None,
        }
    }
}

impl Kind for Serve {
    fn label(&self) -> &'static str {
        LABEL
    }

    fn args(&self, device: &str) -> Vec<OsString> {
        vec![
            "serve".into(),
            device.into(),
            "--socket".into(),
            self.socket.clone().into(),
        ]
    }

    fn serving(&self) -> bool {
        std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
    }

    fn started(&mut self) -> R<()> {
        self.mount = Some(CAbiMount::connect(&self.socket)?);
        Ok(())
    }

    fn stop(&mut self, server: &mut Child) -> R<()> {
        if let Some(mount) = self.mount.take() {
            mount.close()?;
        }
        // SAFETY: a child of ours, not yet waited for.
        unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
        Ok(())
    }

    fn session(&mut self) -> R<Box<dyn Session>> {
        Ok(self
            .mount
            .as_ref()
            .ok_or("corefs-serve target not connected")?
            .session())
    }

    fn engine_figures(&mut self, data_cache: bool) -> R<Option<EngineFigures>> {
        let mount = self
            .mount
            .as_ref()
            .ok_or("corefs-serve target not connected")?;
        let stats = mount.stats().ok_or("statistics through the service")?;
        let cache = if data_cache {
            engine::writeback::CACHE_BLOCKS as u64
        } else {
            0
        };
        Ok(Some(super::target::figures_of(&stats, cache)))
    }
}
