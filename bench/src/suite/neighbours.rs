//! CPU-bound neighbours: processes that spin for the whole run beside the benchmark, as a
//! compaction thread, a query executor or a co-tenant does on a user's machine
//! (`corefs bench suite --neighbours N`). Each is `sh -c 'while :; do :; done'`, unpinned
//! (the scheduler moves it where it likes) or pinned one per core (`--neighbours-pinned`),
//! at the default priority.
//!
//! # Invariants
//! - They live exactly as long as the [`Neighbours`] value: dropping it kills and reaps each,
//!   also when the suite fails or panics (no spinner outlives its benchmark).

use std::process::{Child, Command};

pub struct Neighbours {
    children: Vec<Child>,
}

impl Neighbours {
    /// Starts `count` spinners; `pinned`: spinner `i` on core `i % cores`.
    pub fn start(count: usize, pinned: bool) -> Result<Neighbours, String> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut out = Neighbours {
            children: Vec::with_capacity(count),
        };
        for i in 0..count {
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "while :; do :; done"]);
            if pinned {
                let core = i % cores;
                use std::os::unix::process::CommandExt;
                // SAFETY: between fork and exec the closure calls only async-signal-safe
                // functions (sched_setaffinity on a stack-local set) and allocates nothing.
                unsafe {
                    cmd.pre_exec(move || {
                        let mut set: libc::cpu_set_t = std::mem::zeroed();
                        libc::CPU_SET(core, &mut set);
                        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
                            != 0
                        {
                            return Err(std::io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
            }
            let child = cmd
                .spawn()
                .map_err(|e| format!("starting CPU-bound neighbour {i} (sh): {e}"))?;
            out.children.push(child);
        }
        Ok(out)
    }

    pub fn count(&self) -> usize {
        self.children.len()
    }
}

impl Drop for Neighbours {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spinners run while the value lives and are gone (reaped) once it is dropped.
    #[test]
    fn neighbours_spin_until_dropped() {
        let n = Neighbours::start(2, true).unwrap();
        let pids: Vec<u32> = n.children.iter().map(|c| c.id()).collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        for pid in &pids {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let state = stat
                .rsplit(')')
                .next()
                .unwrap()
                .split_whitespace()
                .next()
                .unwrap();
            assert!(
                state == "R" || state == "S",
                "neighbour {pid} in state {state}"
            );
        }
        drop(n);
        for pid in pids {
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "neighbour {pid} outlived its benchmark"
            );
        }
    }
}
