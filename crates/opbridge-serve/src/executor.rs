//! Each model version's bounded queue and its compute workers: no kernel-sized work runs on the
//! async runtime's threads (a call small enough to cost less than handing it over, with nobody
//! queued, runs where it arrived: `infer::infer`). A worker owns a stream on the model's device
//! and runs what it takes from the queue on it (one request, or a batch of them); a full queue
//! is refused at once (503 / UNAVAILABLE), as Triton's `max_queue_size` is.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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

/// The queue between the I/O threads and the compute workers.
#[derive(Debug)]
pub struct Jobs<T> {
    /// Held by the worker that takes from the queue (see [`Jobs::take`]).
    gate: Mutex<()>,
    state: Mutex<State<T>>,
    /// Signalled when the worker waiting on the queue should look at it.
    changed: Condvar,
    /// Calls running now: those of the workers of a model without batching, and those run where
    /// they arrived ([`Executor::slot_here`]).
    running: AtomicUsize,
    /// The most calls the model runs at once: its worker count.
    slots: usize,
}

/// A call counted as running until it goes (see [`Jobs::running`], [`Executor::slot_here`]).
#[derive(Debug)]
pub struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<Queued<T>>,
    capacity: usize,
    /// No more items: workers finish the queued ones and exit.
    closed: bool,
    /// The server is shutting down: batches stop waiting for company.
    hurry: bool,
    /// How many items the waiting worker wants before it is woken (0: nobody waits). A worker
    /// waiting for its first item wants 1; a batching worker gathering a batch wants as many as
    /// would fill it, and is not woken by each arrival before that: one wake-up per batch, not
    /// per request (a thread wake-up costs more than a small request's kernel).
    wake_at: usize,
    /// Items the worker holding the queue took and has not started running (a batch being
    /// gathered): they still count against the capacity and as pending.
    held: usize,
}

impl<T> Jobs<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the queue: until the guard goes, this worker alone takes from it (a batching
    /// worker gathers a batch while the others run theirs).
    pub fn take(&self) -> Taken<'_, T> {
        Taken { _gate: self.gate.lock().unwrap_or_else(|p| p.into_inner()), jobs: self, holding: Cell::new(false) }
    }

    /// The next item for a worker that runs it at once (nothing is held, so the queue's lock
    /// is taken once per item), waiting for one; `None` once the queue is closed and empty.
    pub fn next_to_run(&self) -> Option<Queued<T>> {
        self.take().pop(false)
    }

    /// Counts a worker's call as running until the guard goes.
    pub fn running(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::SeqCst);
        Running(&self.running)
    }
}

/// The queue, taken by one worker (see [`Jobs::take`]).
#[derive(Debug)]
pub struct Taken<'a, T> {
    _gate: MutexGuard<'a, ()>,
    jobs: &'a Jobs<T>,
    /// Whether it took items it holds (counted in the queue's `held` until it goes).
    holding: Cell<bool>,
}

impl<T> Taken<'_, T> {
    /// The next item, held until this guard goes, waiting for one; `None` once the queue is
    /// closed and empty.
    pub fn next(&self) -> Option<Queued<T>> {
        self.pop(true)
    }

    fn pop(&self, hold: bool) -> Option<Queued<T>> {
        let mut state = self.jobs.lock();
        loop {
            if let Some(queued) = state.items.pop_front() {
                if hold {
                    state.held += 1;
                    self.holding.set(true);
                }
                return Some(queued);
            }
            if state.closed {
                return None;
            }
            state.wake_at = 1;
            state = self.jobs.changed.wait(state).unwrap_or_else(|p| p.into_inner());
            state.wake_at = 0;
        }
    }

    /// Up to `count` queued items, the oldest first, once `count` are queued or `deadline` has
    /// passed (or the queue is closed, hurried or full: nothing more can arrive), waiting until
    /// then: empty when the deadline passed with nothing queued. The rest stay queued (still
    /// bounded by the capacity).
    pub fn when(&self, count: usize, deadline: Instant) -> Vec<Queued<T>> {
        let count = count.max(1);
        let mut state = self.jobs.lock();
        while state.items.len() < count
            && state.items.len() + state.held < state.capacity
            && !state.closed
            && !state.hurry
        {
            let Some(wait) = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else { break };
            state.wake_at = count;
            state = self.jobs.changed.wait_timeout(state, wait).unwrap_or_else(|p| p.into_inner()).0;
            state.wake_at = 0;
        }
        let taken = count.min(state.items.len());
        state.held += taken;
        self.holding.set(self.holding.get() || taken > 0);
        state.items.drain(..taken).collect()
    }
}

impl<T> Drop for Taken<'_, T> {
    /// The held items are about to run (or were answered): no longer pending.
    fn drop(&mut self) {
        if self.holding.get() {
            self.jobs.lock().held = 0;
        }
    }
}

/// What a compute worker does each time round: take work from the queue and run it on the
/// worker's stream; `false` once the queue is closed and empty (the worker then exits).
pub type Work<T> = fn(&Stream, &Jobs<T>) -> bool;

/// A bounded queue of `T` feeding compute workers.
#[derive(Debug)]
pub struct Executor<T> {
    label: String,
    jobs: Arc<Jobs<T>>,
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
        let state = State {
            items: VecDeque::new(),
            capacity: capacity.max(1),
            closed: false,
            hurry: false,
            wake_at: 0,
            held: 0,
        };
        let jobs = Arc::new(Jobs {
            gate: Mutex::new(()),
            state: Mutex::new(state),
            changed: Condvar::new(),
            running: AtomicUsize::new(0),
            slots: workers.max(1),
        });
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
        Ok(Executor { label: label.into(), jobs, workers: Mutex::new(handles) })
    }

    /// Queues `item`, or refuses at once when the queue is full or closed.
    pub fn submit(&self, item: T) -> Result<()> {
        let mut state = self.jobs.lock();
        if state.closed {
            return Err(ServeError::unavailable(format!("{} is unloading", self.label)));
        }
        if state.items.len() + state.held >= state.capacity {
            return Err(ServeError::unavailable(format!("{}: exceeds maximum queue size", self.label)));
        }
        state.items.push_back(Queued { item, at: Instant::now() });
        // Also when the queue is now full: a gathering batch can expect no more.
        let full = state.items.len() + state.held >= state.capacity;
        let wake = state.wake_at != 0 && (state.items.len() >= state.wake_at || full);
        drop(state);
        if wake {
            self.jobs.changed.notify_one();
        }
        Ok(())
    }

    /// A slot for one call to run outside the workers, where it arrived: only while nothing
    /// is queued or held (it overtakes nobody), the queue is open, and fewer calls run than the
    /// model has workers (the worker count bounds its calls at once). A worker that takes a
    /// job meanwhile runs beside it: an overlap of at most one small call.
    pub fn slot_here(&self) -> Option<Running<'_>> {
        {
            let state = self.jobs.lock();
            if !state.items.is_empty() || state.held > 0 || state.closed {
                return None;
            }
        }
        let slots = self.jobs.slots;
        self.jobs.running.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < slots).then_some(n + 1)).ok()?;
        Some(Running(&self.jobs.running))
    }

    /// Items queued or held by a gathering batch, not yet running (the
    /// `nv_inference_pending_request_count` gauge).
    pub fn pending(&self) -> usize {
        let state = self.jobs.lock();
        state.items.len() + state.held
    }

    /// Refuses new jobs, lets the workers finish the queued ones, and waits for them (blocking:
    /// call it off the async runtime).
    pub fn drain(&self) {
        self.close();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for worker in workers {
            let _ = worker.join();
        }
    }
}

impl<T> Executor<T> {
    /// From now on a batch waits for no more requests than are queued: a shutdown's requests
    /// in flight are answered without sitting out `max_queue_delay_us`.
    pub fn hurry(&self) {
        self.jobs.lock().hurry = true;
        self.jobs.changed.notify_all();
    }

    fn close(&self) {
        self.jobs.lock().closed = true;
        self.jobs.changed.notify_all();
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
        self.close();
    }
}
