//! Each model version's bounded queue and its compute workers: kernels never run on the async
//! runtime's threads. A worker owns a stream on the model's device and runs one request at a
//! time on it; a full queue is refused at once (503 / UNAVAILABLE), as Triton's
//! `max_queue_size` is.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use opbridge_runtime::{DeviceContext, Stream};

use crate::error::{Result, ServeError};

/// A request's work, run on a compute worker with its stream.
pub type Job = Box<dyn FnOnce(&Stream) + Send>;

/// A bounded queue feeding compute workers.
#[derive(Debug)]
pub struct Executor {
    label: String,
    queue: Mutex<Option<SyncSender<Job>>>,
    /// Jobs queued and not yet started (the `nv_inference_pending_request_count` gauge).
    pending: Arc<AtomicUsize>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Executor {
    /// `workers` threads, each with a stream of its own on `ctx`'s device, fed by a queue of
    /// `capacity` jobs.
    pub fn start(label: &str, ctx: &'static Arc<DeviceContext>, workers: usize, capacity: usize) -> Result<Executor> {
        let (queue, jobs) = mpsc::sync_channel::<Job>(capacity.max(1));
        let jobs = Arc::new(Mutex::new(jobs));
        let pending = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::new();
        for i in 0..workers.max(1) {
            let stream = Stream::new(ctx)?;
            let jobs = Arc::clone(&jobs);
            let pending = Arc::clone(&pending);
            let handle = std::thread::Builder::new()
                .name(format!("opbridge-serve-{i}"))
                .spawn(move || {
                    lower_priority();
                    loop {
                        let next = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok(job) = next else { return };
                        pending.fetch_sub(1, Ordering::Relaxed);
                        job(&stream);
                    }
                })
                .map_err(|e| ServeError::internal(format!("cannot start a compute worker: {e}")))?;
            handles.push(handle);
        }
        Ok(Executor { label: label.into(), queue: Mutex::new(Some(queue)), pending, workers: Mutex::new(handles) })
    }

    /// Queues `job`, or refuses at once when the queue is full or closed.
    pub fn submit(&self, job: Job) -> Result<()> {
        let queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let Some(queue) = queue.as_ref() else {
            return Err(ServeError::unavailable(format!("{} is unloading", self.label)));
        };
        self.pending.fetch_add(1, Ordering::Relaxed);
        queue.try_send(job).map_err(|e| {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            match e {
                TrySendError::Full(_) => ServeError::unavailable(format!("{}: exceeds maximum queue size", self.label)),
                TrySendError::Disconnected(_) => ServeError::unavailable(format!("{} is unloading", self.label)),
            }
        })
    }

    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    /// Refuses new jobs, lets the workers finish the queued ones, and waits for them (blocking:
    /// call it off the async runtime).
    pub fn drain(&self) {
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).take();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for worker in workers {
            let _ = worker.join();
        }
    }
}

/// How many nice levels below the process the compute workers run (`--compute-nice`).
static COMPUTE_NICE: AtomicI32 = AtomicI32::new(DEFAULT_COMPUTE_NICE);

/// The default of `--compute-nice`.
pub const DEFAULT_COMPUTE_NICE: i32 = 5;

/// Sets how many nice levels below the process the compute workers started from now on run
/// (0: the same as the I/O threads).
pub fn set_compute_nice(levels: i32) {
    COMPUTE_NICE.store(levels.clamp(0, 19), Ordering::Relaxed);
}

/// Lowers the calling compute worker's priority a few nice levels below the process's.
///
/// Why: a request hands its job from an I/O thread to a worker and back. At the same priority
/// the woken worker preempts the I/O thread at once, one request at a time: two context
/// switches per request while the I/O thread still has other connections' requests to read.
/// A few levels lower, the I/O thread reads and queues what is ready first, and the worker then
/// runs the queued jobs back to back (measured: 8 connections of n=4 on one CPU, about 20 %
/// less server CPU per request and 20-25 % more requests/s; at 19 levels it is worse again).
/// When the I/O threads are idle the worker has the CPU to itself: one request alone is not
/// slowed. Best effort: where the system refuses, the worker keeps the process's priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{getpriority_process, setpriority_process};
        let levels = COMPUTE_NICE.load(Ordering::Relaxed);
        if levels == 0 {
            return;
        }
        let tid = rustix::thread::gettid();
        if let Ok(nice) = getpriority_process(Some(tid)) {
            let _ = setpriority_process(Some(tid), (nice + levels).min(19));
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // Closing the queue is enough: the workers finish what was queued and exit.
        self.queue.get_mut().unwrap_or_else(|p| p.into_inner()).take();
    }
}
