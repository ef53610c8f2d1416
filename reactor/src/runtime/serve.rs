//! A reactor thread's life once its engine is mounted ([`serve`]): the loop
//! ([`super::run_loop`]) under `catch_unwind`, then the unmount; after a panic, the failed
//! reactor's service ([`serve_failed`]).
//!
//! # Fault model
//! A panic (a bug: a broken invariant in memory) never leaves a reactor thread. Each runs
//! its loop under `catch_unwind`; one that panics logs the message (`tracing::error!`) and
//! fails the whole runtime ([`Router::fail`]) with [`EngineError::Internal`] (EIO). Every
//! reactor then becomes a *failed reactor*: it answers every request it owes (the batch it
//! was running, fsync and commit waiters: [`crate::owed`]), every request queued and every
//! later one with that error, commits nothing more, and exits when shut down; shutdown
//! returns the error. The whole runtime fails, not only the reactor that panicked, because
//! no later change could become durable (a commit needs every reactor's half, and a span
//! every reactor's shards) and the panic may have left shards lent or half changed; the
//! filesystem is fail-stop: its durable generation and acknowledged fsyncs (in the logs)
//! are intact for the next mount, as after a device error.

use super::run_loop::{park_for_control, run, Ran};
use super::{Config, Reactor, ReactorExit};
use crate::delivery::deliver_failed;
use crate::multi::Router;
use crate::queue::Shared;
use engine::EngineError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What a reactor thread does once its engine is mounted: the loop, under `catch_unwind`;
/// after a panic (its own, or another thread's that failed the runtime), the failed
/// reactor's service ([`serve_failed`]). Never unwinds.
pub(super) fn serve(
    mut reactor: Reactor,
    shared: &Shared,
    router: &Router,
    config: &Config,
    index: usize,
) -> Result<ReactorExit, EngineError> {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        reactor.panic_next = shared.panic_next.clone();
    }
    let ran = catch_unwind(AssertUnwindSafe(|| {
        run(&mut reactor, shared, router, config)
    }));
    match ran {
        Ok(Ran::Stopped(exit)) => {
            let (stats, hist) = *exit;
            let multi = reactor.multi.is_some();
            let unmounted = catch_unwind(AssertUnwindSafe(move || {
                if multi {
                    // The coordinator made the last commit; this queue only goes away.
                    Ok(reactor.fs.into_device())
                } else {
                    reactor.fs.unmount()
                }
            }));
            match unmounted {
                Ok(Ok(dev)) => Ok(ReactorExit { stats, hist, dev }),
                Ok(Err(e)) => Err(e),
                Err(panic) => Err(panicked(router, index, &*panic)),
            }
        }
        Ok(Ran::Failed) => serve_failed(reactor, shared, router),
        Err(panic) => {
            panicked(router, index, &*panic);
            serve_failed(reactor, shared, router)
        }
    }
}

/// Logs reactor `index`'s panic and fails the runtime with it; returns the runtime's
/// failure (the first one, if another thread failed it first).
fn panicked(router: &Router, index: usize, panic: &(dyn std::any::Any + Send)) -> EngineError {
    let why = crate::panic_message(panic);
    tracing::error!(reactor = index, "reactor {index} panicked: {why}");
    router.fail(EngineError::Internal(format!(
        "reactor {index} panicked: {why}"
    )))
}

/// The failed reactor: answers what it owes, what is queued and what comes later with the
/// runtime's failure until it is shut down; then drops its engine (committing nothing) and
/// returns the failure. The engine may be half-changed, so none of its code runs again: the
/// device's own drop lets the I/O in flight finish (bounded) before its buffers go.
fn serve_failed(
    mut reactor: Reactor,
    shared: &Shared,
    router: &Router,
) -> Result<ReactorExit, EngineError> {
    let failure = router
        .failure()
        .cloned()
        .expect("a failed reactor's runtime has failed");
    // The ledger holds the requests of the batch that was running and of the fsync groups
    // and commit waiters; the deferred ones (shards lent) never reached a batch.
    let mut owed = reactor.owed.take_all();
    reactor.pending.clear();
    reactor.commit_waiters.clear();
    if let Some(m) = reactor.multi.as_mut() {
        owed.extend(m.deferred.drain(..).map(|r| (r.reply, r.token)));
    }
    deliver_failed(owed, &failure);
    loop {
        let mut queued = Vec::new();
        while let Some(r) = shared.requests.pop() {
            queued.push((r.reply, r.token));
        }
        deliver_failed(queued, &failure);
        if let Some(m) = reactor.multi.as_ref() {
            // Control messages are moot now (lent shards coming back are dropped); taking
            // them keeps the count a parked reactor checks true.
            while m.control.try_recv().is_ok() {
                shared.control_pending.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if shared.stopping.load(Ordering::Acquire) && shared.requests.is_empty() {
            break;
        }
        let _ = park_for_control(shared, Duration::from_millis(100));
    }
    let _ = catch_unwind(AssertUnwindSafe(move || drop(reactor)));
    Err(failure)
}
