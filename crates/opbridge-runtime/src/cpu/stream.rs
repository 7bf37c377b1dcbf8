//! A CPU stream: a FIFO of host work served by one dedicated worker thread.
//!
//! Every job gets a number (1, 2, ... in queue order), so a point in a stream's work is
//! `(stream, job)`: reached once the worker has finished that many jobs. A wait issued from a
//! worker (a host function that synchronizes something) is checked before it blocks: if what it
//! waits for can only be reached after the worker gets past the job it is running, directly or
//! through `wait` jobs of other streams and other workers blocked the same way, the wait fails
//! with a `Device` error instead of hanging. Threads that are not workers never pay for the check.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::event::Point;
use super::{memory, CpuEvent};
use crate::device::{CopyKind, EventBackend, HostFn, StreamBackend};
use crate::error::{AsyncError, Error, ErrorKind, Result};
use crate::ids::{DeviceId, DevicePtr};

static NEXT_WORKER: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// On a stream's worker thread: that stream's progress (unset elsewhere). What the deadlock
    /// check of a blocking wait starts from.
    static SERVING: std::cell::OnceCell<Arc<Progress>> = const { std::cell::OnceCell::new() };
}

/// The progress of the stream whose worker is the calling thread, if it is one.
fn serving() -> Option<Arc<Progress>> {
    SERVING.try_with(|s| s.get().cloned()).ok().flatten()
}

/// True on a CPU stream's worker thread (inside a kernel or host function).
pub(crate) fn on_worker() -> bool {
    SERVING.try_with(|s| s.get().is_some()).unwrap_or(false)
}

/// A point in a stream's work: reached once `stream` has finished `job` jobs.
#[derive(Debug, Clone)]
pub(super) struct Target {
    stream: Arc<Progress>,
    job: u64,
}

/// Progress shared by the stream handle, its worker and the points recorded on it.
#[derive(Debug)]
pub(super) struct Progress {
    name: String,
    /// Jobs handed to the worker (only the handle increments it, under `jobs`' lock).
    submitted: AtomicU64,
    state: Mutex<Completed>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct Completed {
    count: u64,
    /// First error since the last synchronize (CUDA reports async errors once, at the next sync).
    error: Option<AsyncError>,
    /// Threads blocked in `drain`: the worker wakes them (a system call) only when there are any.
    waiters: usize,
    /// Queued `wait` jobs not yet finished, in job order: `(job, point waited for)`.
    waits: VecDeque<(u64, Arc<Point>)>,
    /// What the worker is blocked on inside its running job (a host function's checked wait).
    blocked_on: Option<Target>,
    /// Events recorded after the stream was closed (no job can carry them): `(job, point)`,
    /// completed by the worker once it has finished `job` jobs.
    closed_records: Vec<(u64, Arc<Point>)>,
}

impl Progress {
    fn lock(&self) -> MutexGuard<'_, Completed> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether reaching `target` needs the worker of `serving` to get past the job it is running
/// (the caller is that worker, so `serving` has finished exactly the jobs before it).
fn needs_serving(target: &Target, serving: &Arc<Progress>) -> bool {
    let mut todo = vec![target.clone()];
    let mut seen: Vec<(*const Progress, u64)> = Vec::new();
    while let Some(target) = todo.pop() {
        let key = (Arc::as_ptr(&target.stream), target.job);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        let state = target.stream.lock();
        if state.count >= target.job {
            continue; // reached
        }
        if Arc::ptr_eq(&target.stream, serving) {
            return true; // at or after the running job
        }
        // The stream still has to run jobs `count + 1 ..= job`: the `wait` jobs among them, and
        // whatever its worker is blocked on inside the running one, must be reached first.
        for (_, point) in state.waits.iter().take_while(|(job, _)| *job <= target.job) {
            if !point.is_reached() {
                todo.push(point.at.clone());
            }
        }
        todo.extend(state.blocked_on.clone());
    }
    false
}

/// Runs `wait` (a blocking wait for `target`) on behalf of the calling thread. On a stream's
/// worker it first checks that `target` can be reached while the worker is blocked; if not, it
/// returns a `Device` error naming `what` instead of blocking forever.
pub(super) fn blocking_wait(target: &Target, what: &str, wait: impl FnOnce()) -> Result<()> {
    let Some(serving) = serving() else {
        wait();
        return Ok(());
    };
    // Published before the check: of two workers starting to wait for each other at the same
    // time, the second to take the other's lock sees the first one's wait.
    serving.lock().blocked_on = Some(target.clone());
    if needs_serving(target, &serving) {
        serving.lock().blocked_on = None;
        let message = if Arc::ptr_eq(&target.stream, &serving) && what == target.stream.name {
            format!("cannot wait for {} from work running on it (a host function)", serving.name)
        } else {
            format!(
                "cannot wait for {what} from work running on {} (a host function): it comes after \
                 that work, directly or through other streams, so the wait would never end",
                serving.name
            )
        };
        return Err(Error::Device { device: DeviceId::CPU, message });
    }
    wait();
    serving.lock().blocked_on = None;
    Ok(())
}

/// Handle of a CPU stream. Dropping or closing it lets the worker finish the queued work and
/// exit.
#[derive(Debug)]
pub struct CpuStream {
    /// The queue; its lock makes a job's number its place in the queue. `None` once closed:
    /// the worker then ends after the last queued job, whoever still holds this handle.
    jobs: Mutex<Option<Sender<HostFn>>>,
    /// The fork generation its worker was started in (`crate::fork`).
    generation: u64,
    progress: Arc<Progress>,
}

impl CpuStream {
    pub(super) fn spawn() -> Result<CpuStream> {
        let generation = crate::fork::generation();
        let number = NEXT_WORKER.fetch_add(1, Ordering::Relaxed);
        let name = format!("opbridge-cpu-stream-{number}");
        let (jobs, queue) = mpsc::channel::<HostFn>();
        let progress = Arc::new(Progress {
            name: name.clone(),
            submitted: AtomicU64::new(0),
            state: Mutex::default(),
            done: Condvar::new(),
        });
        let worker_progress = Arc::clone(&progress);
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                SERVING.with(|s| s.set(Arc::clone(&worker_progress))).ok();
                for job in queue {
                    // A panicking kernel must not kill the stream: it becomes the stream's error.
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                        .unwrap_or_else(|_| Err(AsyncError::new(ErrorKind::Internal, "kernel panicked")));
                    let mut state = worker_progress.lock();
                    state.count += 1;
                    let count = state.count;
                    while state.waits.front().is_some_and(|(job, _)| *job <= count) {
                        state.waits.pop_front();
                    }
                    if !state.closed_records.is_empty() {
                        state.closed_records.retain(|(job, point)| {
                            if *job <= count {
                                point.complete();
                            }
                            *job > count
                        });
                    }
                    if let Err(error) = outcome {
                        state.error.get_or_insert(error);
                    }
                    let wake = state.waiters > 0;
                    drop(state);
                    if wake {
                        worker_progress.done.notify_all();
                    }
                }
            })
            .map_err(|e| Error::Device {
                device: DeviceId::CPU,
                message: format!("cannot start stream worker: {e}"),
            })?;
        Ok(CpuStream { jobs: Mutex::new(Some(jobs)), generation, progress })
    }

    /// The error for a stream whose worker stayed in the parent process of a `fork()`. Checked
    /// before any of the stream's locks is taken: the parent's worker (or a thread enqueuing
    /// there) may have held one at the fork, and nothing in this process would release it.
    fn refuse_orphaned(&self) -> Result<()> {
        if self.orphaned() {
            return Err(Error::Device {
                device: DeviceId::CPU,
                message: crate::fork::orphaned_message(&format!("stream {}", self.progress.name)),
            });
        }
        Ok(())
    }

    fn enqueue(&self, job: HostFn) -> Result<()> {
        self.enqueue_numbered(|_| job)
    }

    /// Enqueues the job `make` builds from its number (its place in the queue). An orphaned
    /// stream is refused before `make` runs, so it never makes an event point current.
    fn enqueue_numbered(&self, make: impl FnOnce(u64) -> HostFn) -> Result<()> {
        self.refuse_orphaned()?;
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let stopped =
            || Error::Device { device: DeviceId::CPU, message: format!("{} has stopped", self.progress.name) };
        let jobs = jobs.as_ref().ok_or_else(stopped)?;
        let number = self.progress.submitted.fetch_add(1, Ordering::SeqCst) + 1;
        jobs.send(make(number)).map_err(|_| {
            self.progress.submitted.fetch_sub(1, Ordering::SeqCst);
            Error::Device { device: DeviceId::CPU, message: format!("{} has stopped", self.progress.name) }
        })
    }
}

impl StreamBackend for CpuStream {
    fn launch(&self, kernel: HostFn) -> Result<()> {
        self.enqueue(kernel)
    }

    fn launch_host_func(&self, func: HostFn) -> Result<()> {
        self.enqueue(func)
    }

    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, _kind: CopyKind) -> Result<()> {
        // Host and device memory are the same memory on the CPU: every direction is a memcpy.
        self.enqueue(Box::new(move || {
            memory::copy(dst, src, bytes);
            Ok(())
        }))
    }

    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
        self.enqueue(Box::new(move || {
            memory::fill(dst, value, bytes);
            Ok(())
        }))
    }

    fn record(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let cpu = event.as_any().downcast_ref::<CpuEvent>().ok_or_else(|| Error::Device {
            device: DeviceId::CPU,
            message: "cannot record an event of another device on a CPU stream".into(),
        })?;
        // An orphaned stream is refused before the new point is made: a point no worker will
        // complete must never become current.
        self.refuse_orphaned()?;
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let Some(sender) = jobs.as_ref() else {
            // Closed: nothing more is queued, so the end of the stream is its last job. The
            // worker completes the point when it gets there (or it is reached already).
            let job = self.progress.submitted.load(Ordering::SeqCst);
            let point = cpu.begin_record(Target { stream: Arc::clone(&self.progress), job });
            let mut state = self.progress.lock();
            if state.count >= job {
                drop(state);
                point.complete();
            } else {
                state.closed_records.push((job, point));
            }
            return Ok(());
        };
        let job = self.progress.submitted.fetch_add(1, Ordering::SeqCst) + 1;
        let point = cpu.begin_record(Target { stream: Arc::clone(&self.progress), job });
        let completion = Arc::clone(&point);
        sender
            .send(Box::new(move || {
                completion.complete();
                Ok(())
            }))
            .map_err(|_| {
                // The worker is gone (it panicked outside a job): the point never completes.
                self.progress.submitted.fetch_sub(1, Ordering::SeqCst);
                Error::Device { device: DeviceId::CPU, message: format!("{} has stopped", self.progress.name) }
            })
    }

    fn wait(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let point =
            event.as_any().downcast_ref::<CpuEvent>().map(CpuEvent::wait_point).ok_or_else(|| Error::Device {
                device: DeviceId::CPU,
                message: "cannot wait on an event of another device on a CPU stream".into(),
            })?;
        match point {
            // Asked first: `is_reached` takes the point's lock, which the parent's worker may
            // have held at the fork.
            Some(point) if point.orphaned() => Err(Error::Device {
                device: DeviceId::CPU,
                message: crate::fork::orphaned_message("the work this event waits for"),
            }),
            Some(point) if !point.is_reached() => self.enqueue_numbered(|job| {
                // Listed until the job has run, for the deadlock checks of blocking waits.
                self.progress.lock().waits.push_back((job, Arc::clone(&point)));
                Box::new(move || {
                    point.wait();
                    Ok(())
                })
            }),
            // Reached already: nothing to wait for, but an orphaned stream still refuses.
            Some(_) => self.refuse_orphaned(),
            None => Ok(()), // never recorded: nothing to wait for
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.drain()?;
        // `drain` refused an orphaned stream, so the worker of this process owns the lock.
        match self.progress.lock().error.take() {
            Some(error) => Err(Error::Async { stream: self.progress.name.clone(), error }),
            None => Ok(()),
        }
    }

    fn drain(&self) -> Result<()> {
        self.refuse_orphaned()?;
        let target = Target { stream: Arc::clone(&self.progress), job: self.progress.submitted.load(Ordering::SeqCst) };
        if self.progress.lock().count >= target.job {
            return Ok(());
        }
        blocking_wait(&target, &self.progress.name, || {
            let mut state = self.progress.lock();
            state.waiters += 1;
            while state.count < target.job {
                state = self.progress.done.wait(state).unwrap_or_else(|p| p.into_inner());
            }
            state.waiters -= 1;
        })
    }

    fn query(&self) -> bool {
        if self.orphaned() {
            // Nothing queued on it will ever run here: it is as done as it will get. (Its lock
            // may have been held by the parent's worker at the fork: never taken here.)
            return true;
        }
        let target = self.progress.submitted.load(Ordering::SeqCst);
        self.progress.lock().count >= target
    }

    fn orphaned(&self) -> bool {
        self.generation != crate::fork::generation()
    }

    fn close(&self) {
        // Dropping the only sender ends the worker's loop once the queue is empty. In the child
        // of a fork the lock may have been held by a parent thread: the worker is not here anyway.
        if self.orphaned() {
            return;
        }
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}
