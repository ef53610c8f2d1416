//! Reference tracking for debug builds: who holds each tracked engine object, reported at
//! unmount if anything is still held (a leak), with the source location that took it.
//!
//! In release builds [`Tracker`] is a zero-sized type whose methods compile to nothing: the
//! engine pays no time and no struct size for it (checked at compile time below).

#[cfg(debug_assertions)]
#[derive(Default)]
pub struct Tracker {
    held: std::collections::HashMap<
        (u64, u64),
        (&'static str, &'static std::panic::Location<'static>),
    >,
}

#[cfg(not(debug_assertions))]
#[derive(Default)]
pub struct Tracker;

#[cfg(not(debug_assertions))]
const _: () = assert!(std::mem::size_of::<Tracker>() == 0);

impl Tracker {
    /// Records that `id` is now held, by `what`, taken at the caller's location.
    #[track_caller]
    #[inline(always)]
    pub fn acquire(&mut self, id: (u64, u64), what: &'static str) {
        #[cfg(debug_assertions)]
        {
            let previous = self.held.insert(id, (what, std::panic::Location::caller()));
            assert!(previous.is_none(), "{what} {id:?} acquired twice");
        }
        #[cfg(not(debug_assertions))]
        let _ = (id, what);
    }

    /// Records that `id` was released.
    #[inline(always)]
    pub fn release(&mut self, id: (u64, u64)) {
        #[cfg(debug_assertions)]
        assert!(
            self.held.remove(&id).is_some(),
            "releasing {id:?}, which is not held"
        );
        #[cfg(not(debug_assertions))]
        let _ = id;
    }

    /// What is still held, with its holders; `None` when nothing is (always in release).
    pub fn report(&self) -> Option<String> {
        #[cfg(debug_assertions)]
        {
            if self.held.is_empty() {
                return None;
            }
            let mut lines: Vec<String> = self
                .held
                .iter()
                .map(|(id, (what, at))| {
                    format!("{what} {id:?} held since {}:{}", at.file(), at.line())
                })
                .collect();
            lines.sort();
            Some(format!(
                "{} references leaked:\n  {}",
                lines.len(),
                lines.join("\n  ")
            ))
        }
        #[cfg(not(debug_assertions))]
        None
    }
}

#[cfg(all(test, debug_assertions))]
mod tests {
    use super::*;

    #[test]
    fn a_leak_is_reported_with_its_holder() {
        let mut tracker = Tracker::default();
        tracker.acquire((1, 2), "delayed index item");
        tracker.acquire((1, 3), "delayed index item");
        tracker.release((1, 2));
        let report = tracker.report().expect("one item is still held");
        assert!(
            report.contains("1 references leaked")
                && report.contains("(1, 3)")
                && report.contains("refs.rs"),
            "{report}"
        );
        tracker.release((1, 3));
        assert_eq!(tracker.report(), None);
    }

    #[test]
    #[should_panic(expected = "not held")]
    fn releasing_twice_is_caught() {
        let mut tracker = Tracker::default();
        tracker.acquire((5, 5), "x");
        tracker.release((5, 5));
        tracker.release((5, 5));
    }
}
