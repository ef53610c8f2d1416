//! What a workload runs on ([`Live`]): the engine's synchronous calls, or, under the
//! `callers` schedule, the calls a client runs on an engine its reactor lent it (writes
//! staged by the caller, fsync records written beside the queue), or clients of running
//! reactors ([`crate::reactors`]).

use engine::{EngineError, FallocateMode, Filesystem, RenameFlags, XattrFlags};

/// What a workload runs on and the oracle reads: the engine itself, or clients of running
/// reactors ([`reactors`]). The methods are the engine's.
pub trait Live {
    fn resolve(&mut self, path: &str) -> Result<u64, EngineError>;
    fn root(&self) -> u64;
    fn stat(&mut self, ino: u64) -> Result<engine::Stat, EngineError>;
    fn create(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn mkdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn symlink(&mut self, dir: u64, name: &[u8], target: &[u8]) -> Result<(), EngineError>;
    fn fallocate(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError>;
    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<(), EngineError>;
    fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError>;
    fn rename(&mut self, src: u64, from: &[u8], dst: u64, to: &[u8]) -> Result<(), EngineError>;
    fn setxattr(&mut self, ino: u64, name: &[u8], value: &[u8]) -> Result<(), EngineError>;
    fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<(), EngineError>;
    fn truncate(&mut self, ino: u64, size: u64) -> Result<(), EngineError>;
    fn fsync(&mut self, ino: u64) -> Result<(), EngineError>;
    fn fdatasync(&mut self, ino: u64) -> Result<(), EngineError>;
    fn sync(&mut self) -> Result<(), EngineError>;
    fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>, EngineError>;
    fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>, EngineError>;
    fn readdir(&mut self, ino: u64) -> Result<Vec<engine::DirEntry>, EngineError>;
    fn readlink(&mut self, ino: u64) -> Result<Vec<u8>, EngineError>;
    fn read(&mut self, ino: u64, offset: u64, len: usize) -> Result<Vec<u8>, EngineError>;
}

impl Live for Filesystem {
    fn resolve(&mut self, path: &str) -> Result<u64, EngineError> {
        Filesystem::resolve(self, path)
    }
    fn root(&self) -> u64 {
        Filesystem::root(self)
    }
    fn stat(&mut self, ino: u64) -> Result<engine::Stat, EngineError> {
        Filesystem::stat(self, ino)
    }
    fn create(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::create(self, dir, name, 0o644, 0, 0).map(drop)
    }
    fn mkdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::mkdir(self, dir, name, 0o755, 0, 0).map(drop)
    }
    fn symlink(&mut self, dir: u64, name: &[u8], target: &[u8]) -> Result<(), EngineError> {
        Filesystem::symlink(self, dir, name, target, 0, 0).map(drop)
    }
    fn fallocate(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        Filesystem::fallocate(self, ino, mode, offset, len)
    }
    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<(), EngineError> {
        if callers::on() {
            let data_shared = engine::Staged::copy_of(data);
            if let Some(written) = self.write_lent_reading_edges(ino, offset, data_shared) {
                return written.map(drop);
            }
        }
        Filesystem::write(self, ino, offset, data).map(drop)
    }
    fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::link(self, ino, dir, name).map(drop)
    }
    fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::unlink(self, dir, name)
    }
    fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::rmdir(self, dir, name)
    }
    fn rename(&mut self, src: u64, from: &[u8], dst: u64, to: &[u8]) -> Result<(), EngineError> {
        Filesystem::rename(self, src, from, dst, to, RenameFlags::default())
    }
    fn setxattr(&mut self, ino: u64, name: &[u8], value: &[u8]) -> Result<(), EngineError> {
        Filesystem::setxattr(self, ino, name, value, XattrFlags::Any)
    }
    fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<(), EngineError> {
        Filesystem::removexattr(self, ino, name)
    }
    fn truncate(&mut self, ino: u64, size: u64) -> Result<(), EngineError> {
        Filesystem::truncate(self, ino, size)
    }
    fn fsync(&mut self, ino: u64) -> Result<(), EngineError> {
        if callers::on() {
            if let Some(done) = callers::fsync(self, ino, false) {
                return done;
            }
        }
        Filesystem::fsync(self, ino)
    }
    fn fdatasync(&mut self, ino: u64) -> Result<(), EngineError> {
        if callers::on() {
            if let Some(done) = callers::fsync(self, ino, true) {
                return done;
            }
        }
        Filesystem::fdatasync(self, ino)
    }
    fn sync(&mut self) -> Result<(), EngineError> {
        Filesystem::sync(self)
    }
    fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>, EngineError> {
        Filesystem::listxattr(self, ino)
    }
    fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>, EngineError> {
        Filesystem::getxattr(self, ino, name)
    }
    fn readdir(&mut self, ino: u64) -> Result<Vec<engine::DirEntry>, EngineError> {
        Filesystem::readdir(self, ino, 0, usize::MAX)
    }
    fn readlink(&mut self, ino: u64) -> Result<Vec<u8>, EngineError> {
        Filesystem::readlink(self, ino)
    }
    fn read(&mut self, ino: u64, offset: u64, len: usize) -> Result<Vec<u8>, EngineError> {
        Filesystem::read(self, ino, offset, len)
    }
}

/// The [`Schedule::Callers`] switch: while on (in this thread), the engine's synchronous
/// writes and fsyncs run as a client runs them on an engine its reactor lent it
/// ([`Filesystem::write_lent`], [`Filesystem::fsync_beside`]: records written and flushed
/// beside the queue), falling back to the owner's calls where those decline.
pub(crate) mod callers {
    use std::cell::Cell;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
    }

    pub(crate) fn on() -> bool {
        ON.with(Cell::get)
    }

    /// An fsync as a client runs it ([`Filesystem::fsync_beside`]): the record built, the
    /// engine given back, its writes made beside the queue. `None`: declined, the owner's.
    pub(crate) fn fsync(
        fs: &mut engine::Filesystem,
        ino: u64,
        datasync: bool,
    ) -> Option<Result<(), engine::EngineError>> {
        let mut io = fs.side_io()?;
        Some(match fs.fsync_beside(&[(ino, datasync)])? {
            Ok(Some(record)) => record.run(io.as_mut()).0,
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        })
    }

    /// On until the guard drops.
    pub(crate) struct Guard;

    impl Guard {
        pub(crate) fn set(on: bool) -> Guard {
            ON.with(|c| c.set(on));
            Guard
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            ON.with(|c| c.set(false));
        }
    }
}
