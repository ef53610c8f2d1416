//! What several reactor test binaries share: CPU-bound neighbour processes.

/// Spinning processes (`while :; do :; done`, unpinned), killed when dropped: a failing test
/// must not leave them behind to slow down (and mislead) everything that runs after it.
pub struct Hogs(Vec<std::process::Child>);

impl Drop for Hogs {
    fn drop(&mut self) {
        for n in &mut self.0 {
            let _ = n.kill();
            let _ = n.wait();
        }
    }
}

/// Starts `count` spinning processes.
pub fn hogs(count: usize) -> Hogs {
    Hogs(
        (0..count)
            .map(|_| {
                std::process::Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .expect("sh")
            })
            .collect(),
    )
}
