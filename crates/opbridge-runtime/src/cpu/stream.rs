//! A CPU stream: a FIFO of host work served by one dedicated worker thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};

use super::{memory, CpuEvent};
use crate::device::{CopyKind, EventBackend, HostFn, StreamBackend};
use crate::error::{AsyncError, Error, ErrorKind, Result};
use crate::ids::{DeviceId, DevicePtr};

static NEXT_WORKER: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// On a stream's worker thread: that stream's number (0 elsewhere). A worker waiting for its
    /// own queue would wait forever, so such waits are refused instead.
    static SERVING: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Progress shared by the stream handle and its worker.
#[derive(Debug, Default)]
struct Progress {
    /// Jobs handed to the worker (only the handle increments it).
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
}

/// Handle of a CPU stream. Dropping it lets the worker finish the queued work and exit.
#[derive(Debug)]
pub struct CpuStream {
    number: u64,
    /// The fork generation its worker was started in (`crate::fork`).
    generation: u64,
    name: String,
    jobs: Sender<HostFn>,
    progress: Arc<Progress>,
}

impl CpuStream {
    pub(super) fn spawn() -> Result<CpuStream> {
        let generation = crate::fork::generation();
        let number = NEXT_WORKER.fetch_add(1, Ordering::Relaxed);
        let name = format!("opbridge-cpu-stream-{number}");
        let (jobs, queue) = mpsc::channel::<HostFn>();
        let progress = Arc::new(Progress::default());
        let worker_progress = Arc::clone(&progress);
        std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                SERVING.with(|s| s.set(number));
                for job in queue {
                    // A panicking kernel must not kill the stream: it becomes the stream's error.
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job))
                        .unwrap_or_else(|_| Err(AsyncError::new(ErrorKind::Internal, "kernel panicked")));
                    let mut state = worker_progress.state.lock().unwrap_or_else(|p| p.into_inner());
                    state.count += 1;
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
        Ok(CpuStream { number, generation, name, jobs, progress })
    }

    /// The error for a stream whose worker stayed in the parent process of a `fork()`.
    fn refuse_orphaned(&self) -> Result<()> {
        if self.orphaned() {
            return Err(Error::Device {
                device: DeviceId::CPU,
                message: crate::fork::orphaned_message(&format!("stream {}", self.name)),
            });
        }
        Ok(())
    }

    fn enqueue(&self, job: HostFn) -> Result<()> {
        self.refuse_orphaned()?;
        self.progress.submitted.fetch_add(1, Ordering::SeqCst);
        self.jobs.send(job).map_err(|_| {
            self.progress.submitted.fetch_sub(1, Ordering::SeqCst);
            Error::Device { device: DeviceId::CPU, message: format!("{} has stopped", self.name) }
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

    fn record(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let cpu = event.as_any().downcast_ref::<CpuEvent>().ok_or_else(|| Error::Device {
            device: DeviceId::CPU,
            message: "cannot record an event of another device on a CPU stream".into(),
        })?;
        // Before the new point: a point no worker will complete must never become current.
        self.refuse_orphaned()?;
        let point = cpu.begin_record();
        self.enqueue(Box::new(move || {
            point.complete();
            Ok(())
        }))
    }

    fn wait(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let point =
            event.as_any().downcast_ref::<CpuEvent>().map(CpuEvent::wait_point).ok_or_else(|| Error::Device {
                device: DeviceId::CPU,
                message: "cannot wait on an event of another device on a CPU stream".into(),
            })?;
        match point {
            Some(point) if point.orphaned() => Err(Error::Device {
                device: DeviceId::CPU,
                message: crate::fork::orphaned_message("the work this event waits for"),
            }),
            Some(point) => self.enqueue(Box::new(move || {
                point.wait();
                Ok(())
            })),
            None => Ok(()), // never recorded: nothing to wait for
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.drain()?;
        // `drain` refused an orphaned stream, so the worker of this process owns the lock.
        let mut state = self.progress.state.lock().unwrap_or_else(|p| p.into_inner());
        match state.error.take() {
            Some(error) => Err(Error::Async { stream: self.name.clone(), error }),
            None => Ok(()),
        }
    }

    fn drain(&self) -> Result<()> {
        self.refuse_orphaned()?;
        if SERVING.with(|s| s.get()) == self.number {
            return Err(Error::Device {
                device: DeviceId::CPU,
                message: format!("cannot wait for {} from work running on it (a host function)", self.name),
            });
        }
        let target = self.progress.submitted.load(Ordering::SeqCst);
        let mut state = self.progress.state.lock().unwrap_or_else(|p| p.into_inner());
        state.waiters += 1;
        while state.count < target {
            state = self.progress.done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.waiters -= 1;
        Ok(())
    }

    fn query(&self) -> bool {
        if self.orphaned() {
            // Nothing queued on it will ever run here: it is as done as it will get. (Its lock
            // may have been held by the parent's worker at the fork: never taken here.)
            return true;
        }
        let target = self.progress.submitted.load(Ordering::SeqCst);
        self.progress.state.lock().unwrap_or_else(|p| p.into_inner()).count >= target
    }

    fn orphaned(&self) -> bool {
        self.generation != crate::fork::generation()
    }
}
