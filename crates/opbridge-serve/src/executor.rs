//! Each model version's bounded queue and its compute workers: kernels never run on the async
//! runtime's threads. A worker owns a stream on the model's device and runs what it takes from
//! the queue on it (one request, or a batch of them); a full queue is refused at once (503 /
//! UNAVAILABLE), as Triton's `max_queue_size` is.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use opbridge_runtime::{DeviceContext, Stream};

use crate::error::{Result, ServeError};

/// An item in the queue, with the time it was queued.
#[derive(Debug)]
pub struct Queued<T> {
    pub item: T,
    pub at: Instant,
}

/// The receiving end of an executor's queue, shared by its workers.
#[derive(Debug)]
pub struct Jobs<T> {
    queue: Mutex<Receiver<Queued<T>>>,
    pending: Arc<AtomicUsize>,
}

impl<T> Jobs<T> {
    /// Takes the queue: until the guard goes, this worker alone receives (a batching worker
    /// gathers a batch while the others run theirs).
    pub fn take(&self) -> Taken<'_, T> {
        Taken { queue: self.queue.lock().unwrap_or_else(|p| p.into_inner()), pending: &self.pending }
    }
}

/// The queue, taken by one worker (see [`Jobs::take`]).
#[derive(Debug)]
pub struct Taken<'a, T> {
    queue: MutexGuard<'a, Receiver<Queued<T>>>,
    pending: &'a AtomicUsize,
}

impl<T> Taken<'_, T> {
    /// The next item, waiting for one; `None` once the queue is closed and empty.
    pub fn next(&self) -> Option<Queued<T>> {
        let queued = self.queue.recv().ok()?;
        self.pending.fetch_sub(1, Ordering::Relaxed);
        Some(queued)
    }

    /// The next item if one comes before `deadline` (one already queued when it has passed).
    pub fn next_before(&self, deadline: Instant) -> Option<Queued<T>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let queued = match self.queue.recv_timeout(wait) {
            Ok(queued) => queued,
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return None,
        };
        self.pending.fetch_sub(1, Ordering::Relaxed);
        Some(queued)
    }
}

/// What a compute worker does each time round: take work from the queue and run it on the
/// worker's stream; `false` once the queue is closed and empty (the worker then exits).
pub type Work<T> = fn(&Stream, &Jobs<T>) -> bool;

/// A bounded queue of `T` feeding compute workers.
#[derive(Debug)]
pub struct Executor<T> {
    label: String,
    queue: Mutex<Option<SyncSender<Queued<T>>>>,
    /// Items queued and not yet taken (the `nv_inference_pending_request_count` gauge).
    pending: Arc<AtomicUsize>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl<T: Send + 'static> Executor<T> {
    /// `workers` threads, each with a stream of its own on `ctx`'s device, running `work` on a
    /// queue of `capacity` items.
    pub fn start(
        label: &str,
        ctx: &'static Arc<DeviceContext>,
        workers: usize,
        capacity: usize,
        work: Work<T>,
    ) -> Result<Executor<T>> {
        let (queue, receiver) = mpsc::sync_channel::<Queued<T>>(capacity.max(1));
        let pending = Arc::new(AtomicUsize::new(0));
        let jobs = Arc::new(Jobs { queue: Mutex::new(receiver), pending: Arc::clone(&pending) });
        let mut handles = Vec::new();
        for i in 0..workers.max(1) {
            let stream = Stream::new(ctx)?;
            let jobs = Arc::clone(&jobs);
            let handle = std::thread::Builder::new()
                .name(format!("opbridge-serve-{i}"))
                .spawn(move || {
                    lower_priority();
                    while work(&stream, &jobs) {}
                })
                .map_err(|e| ServeError::internal(format!("cannot start a compute worker: {e}")))?;
            handles.push(handle);
        }
        Ok(Executor { label: label.into(), queue: Mutex::new(Some(queue)), pending, workers: Mutex::new(handles) })
    }

    /// Queues `item`, or refuses at once when the queue is full or closed.
    pub fn submit(&self, item: T) -> Result<()> {
        let queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let Some(queue) = queue.as_ref() else {
            return Err(ServeError::unavailable(format!("{} is unloading", self.label)));
        };
        self.pending.fetch_add(1, Ordering::Relaxed);
        queue.try_send(Queued { item, at: Instant::now() }).map_err(|e| {
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

impl<T> Drop for Executor<T> {
    fn drop(&mut self) {
        // Closing the queue is enough: the workers finish what was queued and exit.
        self.queue.get_mut().unwrap_or_else(|p| p.into_inner()).take();
    }
}
