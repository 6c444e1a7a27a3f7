//! The thread that unmaps the old mappings of moved pages for a
//! [`CudaDevice`](super::CudaDevice) (Note [Unmaps off the allocating thread] in
//! `src/allocator/state/lending.rs`): jobs of ranges come in through a channel, run in order, and
//! their results wait for the allocator's next poll. Started on the first job, stopped and joined
//! when the device drops. May use: `backend::cuda`.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{CudaContext, result, sys};
use parking_lot::{Condvar, Mutex};

use super::{RelaxedCaptureMode, driver};
use crate::backend::call_times::{CallClock, CallKind};
use crate::backend::{BackendError, DeviceAddr, FinishedUnmaps};

/// One job: its ticket and the ranges to unmap, in order.
type Job = (u64, Vec<(DeviceAddr, usize)>);

/// What the thread and the device share: the jobs not finished, and results waiting to be
/// polled.
#[derive(Default)]
struct Shared {
    state: Mutex<Progress>,
    /// Signalled each time a job finishes.
    finished: Condvar,
}

#[derive(Default)]
struct Progress {
    /// The last ticket given out.
    last_ticket: u64,
    /// Tickets queued and not finished.
    outstanding: Vec<u64>,
    /// Finished jobs not yet polled.
    results: Vec<FinishedUnmaps>,
}

/// The helper of one device: started lazily, stopped when dropped.
///
/// A forked child inherits the struct but not the thread (and may inherit its locks held): every
/// method does nothing there, before it takes a lock (`pid`).
pub(super) struct UnmapHelper {
    running: Mutex<Option<Running>>,
    shared: Arc<Shared>,
    /// The process the helper belongs to.
    pid: u32,
}

impl Default for UnmapHelper {
    fn default() -> Self {
        UnmapHelper {
            running: Mutex::default(),
            shared: Arc::default(),
            pid: std::process::id(),
        }
    }
}

struct Running {
    jobs: Sender<Job>,
    thread: JoinHandle<()>,
}

impl UnmapHelper {
    /// Queues `ranges` on the thread (starting it first if need be) and returns the ticket.
    ///
    /// # Errors
    /// [`BackendError::Unsupported`] when the thread cannot be started or has stopped.
    ///
    /// # Safety
    /// `DeviceBackend::unmap_later`'s: every range is one live mapping of `ctx`'s device that no
    /// queued work uses, left alone (not mapped over, its handle not released) until the job is
    /// reported finished.
    pub(super) unsafe fn submit(
        &self,
        ctx: &Arc<CudaContext>,
        clock: &Arc<CallClock>,
        ranges: Vec<(DeviceAddr, usize)>,
    ) -> Result<u64, BackendError> {
        if self.forked() {
            return Err(BackendError::Unsupported(
                "unmaps on a helper thread (forked child)",
            ));
        }
        let mut running = self.running.lock();
        if running.as_ref().is_some_and(|r| r.thread.is_finished()) {
            // The thread died (it has no panicking path, but a lost job must not make `wait`
            // wait for ever): what it left undone is reported failed.
            self.abandon_outstanding();
        }
        if running.as_ref().is_none_or(|r| r.thread.is_finished()) {
            let (jobs, rx) = channel();
            let (ctx, clock, shared) =
                (Arc::clone(ctx), Arc::clone(clock), Arc::clone(&self.shared));
            let thread = std::thread::Builder::new()
                .name("cca-unmap".into())
                .spawn(move || run(&ctx, &clock, &shared, &rx))
                .map_err(|_| BackendError::Unsupported("unmaps on a helper thread (no thread)"))?;
            *running = Some(Running { jobs, thread });
        }
        let Some(r) = running.as_ref() else {
            return Err(BackendError::Unsupported("unmaps on a helper thread"));
        };
        let ticket = {
            let mut p = self.shared.state.lock();
            p.last_ticket += 1;
            let t = p.last_ticket;
            p.outstanding.push(t);
            t
        };
        if r.jobs.send((ticket, ranges)).is_err() {
            // The thread is gone; the job never ran. Not outstanding, so that `wait` does not
            // wait for it; the caller unmaps.
            self.shared
                .state
                .lock()
                .outstanding
                .retain(|&t| t != ticket);
            return Err(BackendError::Unsupported(
                "unmaps on a helper thread (stopped)",
            ));
        }
        Ok(ticket)
    }

    /// Whether this is a forked child of the process the helper belongs to.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// The finished jobs among `tickets`, each once (none in a forked child).
    pub(super) fn finished(&self, tickets: &[u64]) -> Vec<FinishedUnmaps> {
        if self.forked() {
            return Vec::new();
        }
        let mut p = self.shared.state.lock();
        if p.results.is_empty() {
            return Vec::new();
        }
        let (mine, others) = std::mem::take(&mut p.results)
            .into_iter()
            .partition(|f| tickets.contains(&f.ticket));
        p.results = others;
        mine
    }

    /// Blocks until every queued job finished (or the thread stopped; at once in a forked
    /// child, where no job runs).
    pub(super) fn wait(&self) {
        if self.forked() {
            return;
        }
        let mut p = self.shared.state.lock();
        while !p.outstanding.is_empty() {
            let stopped = self
                .running
                .try_lock()
                .is_some_and(|r| r.as_ref().is_none_or(|r| r.thread.is_finished()));
            if stopped {
                tracing::error!(target: "cuda_caching_allocator", jobs = p.outstanding.len(), "the unmap helper stopped with jobs queued");
                drop(p);
                self.abandon_outstanding();
                return;
            }
            self.shared
                .finished
                .wait_for(&mut p, Duration::from_millis(50));
        }
    }

    /// Reports every job the (dead) thread left undone as failed with nothing unmapped, so that
    /// the cache tries those ranges itself and nothing waits for them.
    fn abandon_outstanding(&self) {
        let mut p = self.shared.state.lock();
        for ticket in std::mem::take(&mut p.outstanding) {
            p.results.push(FinishedUnmaps {
                ticket,
                unmapped: 0,
                error: Some(BackendError::Unsupported(
                    "unmaps on a helper thread (it stopped before this job ran)",
                )),
            });
        }
        self.shared.finished.notify_all();
    }

    /// Stops the thread once it has run every queued job, and joins it (in a forked child,
    /// which has no such thread, forgets it).
    pub(super) fn stop(&self) {
        if self.forked() {
            return;
        }
        let Some(Running { jobs, thread }) = self.running.lock().take() else {
            return;
        };
        drop(jobs);
        if thread.join().is_err() {
            tracing::error!(target: "cuda_caching_allocator", "the unmap helper panicked");
        }
    }
}

impl Drop for UnmapHelper {
    fn drop(&mut self) {
        if self.forked() {
            // The thread is the parent's: neither join nor detach it, nor touch the channel it
            // may have been using at the fork.
            std::mem::forget(self.running.get_mut().take());
        } else {
            self.stop();
        }
    }
}

/// The thread's body: binds the context, turns its capture mode relaxed (its unmaps must not
/// invalidate another thread's capture), and runs the jobs until the channel closes.
fn run(ctx: &CudaContext, clock: &CallClock, shared: &Shared, jobs: &Receiver<Job>) {
    // SAFETY: `ctx` is a live context: the thread holds an `Arc` of it until it returns.
    let bound = unsafe { result::ctx::set_current(ctx.cu_ctx()) }.is_ok();
    let _relaxed = RelaxedCaptureMode::enter();
    while let Ok((ticket, ranges)) = jobs.recv() {
        let mut unmapped = 0;
        let mut error = (!bound).then_some(BackendError::Unsupported(
            "unmaps on a helper thread (its context could not be bound)",
        ));
        if error.is_none() {
            for (va, size) in ranges {
                let _timed = clock.start(CallKind::Unmap);
                // SAFETY: the submitter's obligations (`UnmapHelper::submit`): `va..va + size` is
                // one live mapping of this context's device, unused by queued work and left alone
                // until this job is reported finished.
                match unsafe { sys::cuMemUnmap(va.0, size) }.result() {
                    Ok(()) => unmapped += 1,
                    Err(e) => {
                        error = Some(driver("cuMemUnmap", e));
                        break;
                    }
                }
            }
        }
        let mut p = shared.state.lock();
        p.results.push(FinishedUnmaps {
            ticket,
            unmapped,
            error,
        });
        p.outstanding.retain(|&t| t != ticket);
        shared.finished.notify_all();
    }
}
