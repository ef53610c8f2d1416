//! The crash tester with running reactors: the same workloads and oracle, applied through the
//! client API of a runtime with several reactors on a recording device (every reactor's queue
//! and the coordinator's record into one write log), so the crash states cover partitions,
//! their separate log streams, spans and coordinated commits.

use crate::workload::Step;
use crate::{
    base_point, check_points, config, run_ops, run_ops_committing, unchecked_prelude, Base, Live,
    Outcome, PRELUDE,
};
use engine::{DirEntry, EngineError, FallocateMode, RenameFlags, Stat, XattrFlags};
use nvme::backend::mem::MemDevice;
use nvme::wrap::RecordingDevice;
use reactor::{Client, Config, Op, Reply, Runtime};

/// A reactor client seen as the engine.
struct Clients(Client);

impl Clients {
    fn call(&mut self, op: Op) -> Result<Reply, EngineError> {
        self.0.call(op)
    }
    fn done(&mut self, op: Op) -> Result<(), EngineError> {
        self.call(op).map(drop)
    }
    fn stat_of(&mut self, op: Op) -> Result<Stat, EngineError> {
        match self.call(op)? {
            Reply::Stat(s) => Ok(s),
            other => Err(EngineError::Invalid(format!(
                "expected a stat, got {other:?}"
            ))),
        }
    }
    fn data_of(&mut self, op: Op) -> Result<Vec<u8>, EngineError> {
        match self.call(op)? {
            Reply::Data(d) => Ok(d),
            other => Err(EngineError::Invalid(format!(
                "expected data, got {other:?}"
            ))),
        }
    }
}

impl Live for Clients {
    fn resolve(&mut self, path: &str) -> Result<u64, EngineError> {
        self.stat_of(Op::resolve(path)).map(|s| s.ino)
    }
    fn root(&self) -> u64 {
        engine::inode::ROOT_INO
    }
    fn stat(&mut self, ino: u64) -> Result<Stat, EngineError> {
        self.stat_of(Op::Stat { ino })
    }
    fn create(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Create {
            dir,
            name: name.to_vec(),
            mode: 0o644,
            owner: reactor::Owner::ROOT,
        })
    }
    fn mkdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Mkdir {
            dir,
            name: name.to_vec(),
            mode: 0o755,
            owner: reactor::Owner::ROOT,
        })
    }
    fn symlink(&mut self, dir: u64, name: &[u8], target: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Symlink {
            dir,
            name: name.to_vec(),
            target: target.to_vec(),
            owner: reactor::Owner::ROOT,
        })
    }
    fn fallocate(
        &mut self,
        ino: u64,
        mode: FallocateMode,
        offset: u64,
        len: u64,
    ) -> Result<(), EngineError> {
        self.done(Op::Fallocate {
            ino,
            mode,
            offset,
            len,
        })
    }
    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Write {
            ino,
            offset,
            data: data.to_vec().into(),
        })
    }
    fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Link {
            ino,
            dir,
            name: name.to_vec(),
        })
    }
    fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Unlink {
            dir,
            name: name.to_vec(),
        })
    }
    fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Rmdir {
            dir,
            name: name.to_vec(),
        })
    }
    fn rename(&mut self, src: u64, from: &[u8], dst: u64, to: &[u8]) -> Result<(), EngineError> {
        self.done(Op::Rename {
            from_dir: src,
            from: from.to_vec(),
            to_dir: dst,
            to: to.to_vec(),
            flags: RenameFlags::default(),
        })
    }
    fn setxattr(&mut self, ino: u64, name: &[u8], value: &[u8]) -> Result<(), EngineError> {
        self.done(Op::SetXattr {
            ino,
            name: name.to_vec(),
            value: value.to_vec(),
            flags: XattrFlags::Any,
        })
    }
    fn removexattr(&mut self, ino: u64, name: &[u8]) -> Result<(), EngineError> {
        self.done(Op::RemoveXattr {
            ino,
            name: name.to_vec(),
        })
    }
    fn truncate(&mut self, ino: u64, size: u64) -> Result<(), EngineError> {
        self.done(Op::Truncate { ino, size })
    }
    fn fsync(&mut self, ino: u64) -> Result<(), EngineError> {
        self.done(Op::Fsync { ino })
    }
    fn fdatasync(&mut self, ino: u64) -> Result<(), EngineError> {
        self.done(Op::Fdatasync { ino })
    }
    fn sync(&mut self) -> Result<(), EngineError> {
        self.done(Op::Sync)
    }
    fn listxattr(&mut self, ino: u64) -> Result<Vec<Vec<u8>>, EngineError> {
        match self.call(Op::ListXattr { ino })? {
            Reply::Names(n) => Ok(n),
            other => Err(EngineError::Invalid(format!(
                "expected names, got {other:?}"
            ))),
        }
    }
    fn getxattr(&mut self, ino: u64, name: &[u8]) -> Result<Vec<u8>, EngineError> {
        self.data_of(Op::GetXattr {
            ino,
            name: name.to_vec(),
        })
    }
    fn readdir(&mut self, ino: u64) -> Result<Vec<DirEntry>, EngineError> {
        let mut out: Vec<DirEntry> = Vec::new();
        loop {
            let cookie = out.last().map_or(0, |e| e.cookie);
            match self.call(Op::Readdir {
                dir: ino,
                cookie,
                max: 256,
            })? {
                Reply::Entries(e) if e.is_empty() => return Ok(out),
                Reply::Entries(e) => out.extend(e),
                other => {
                    return Err(EngineError::Invalid(format!(
                        "expected entries, got {other:?}"
                    )))
                }
            }
        }
    }
    fn readlink(&mut self, ino: u64) -> Result<Vec<u8>, EngineError> {
        self.data_of(Op::Readlink { ino })
    }
    fn read(&mut self, ino: u64, offset: u64, len: usize) -> Result<Vec<u8>, EngineError> {
        self.data_of(Op::Read { ino, offset, len })
    }
}

/// Runs one workload through `reactors` reactors and checks every crash state.
pub fn run_on_reactors(
    base: &Base,
    ops: &[Step],
    seed: u64,
    reactors: usize,
) -> Result<Outcome, String> {
    let dev = MemDevice::from_image(&base.image, config()).map_err(|e| e.to_string())?;
    let recording = RecordingDevice::new(dev);
    let log = recording.log();
    let runtime = Runtime::start_with_device(
        Config {
            device: "recorded mem".into(),
            reactors,
            queue_capacity: 64,
            mount: crate::mount_options(),
            ..Default::default()
        },
        Box::new(recording),
    )
    .map_err(|e| format!("starting {reactors} reactors: {e}"))?;
    let mounted = log.len();
    let mut live = Clients(runtime.client(4));
    let mut points = vec![base_point(&mut live, base)?];
    points.extend(run_ops(&mut live, &PRELUDE, &log)?);
    let from = log.len();
    // With several reactors a directory rename commits before it returns (docs/reactors.md):
    // a promise of the whole tree, like a sync.
    points.extend(run_ops_committing(&mut live, ops, &log, |fs, op| {
        reactors > 1
            && match op {
                Step::Rename(_, to) => fs
                    .resolve(to)
                    .and_then(|ino| fs.stat(ino))
                    .is_ok_and(|s| s.is_dir()),
                _ => false,
            }
    })?);
    drop(live);
    let stats = runtime.shutdown().map_err(|e| format!("shutdown: {e}"))?;
    let outcome = Outcome {
        runs: 1,
        ..Default::default()
    }
    .with_log(&stats.log);
    // The prelude's cuts are the same for every workload: not checked.
    let prelude = unchecked_prelude(base, mounted, from);
    check_points(
        &base.image,
        &log.snapshot(),
        &log.submissions(),
        &points,
        std::slice::from_ref(&prelude),
        seed,
        outcome,
    )
}
