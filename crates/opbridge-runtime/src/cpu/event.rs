//! A CPU event. Each `record` makes a new completion point that the recording stream's worker
//! completes; waits and queries use the point current when they are called, so re-recording an
//! event on another stream never releases work that waited for the earlier record.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use super::stream::Target;
use crate::device::EventBackend;
use crate::error::{Error, Result};

/// One recorded point: done once the stream reaches it, with the time it did.
#[derive(Debug)]
pub(super) struct Point {
    /// The fork generation it was recorded in: a later generation has no worker to reach it.
    generation: u64,
    reached: Mutex<Option<Instant>>,
    done: Condvar,
    /// Threads blocked in `wait`: completing wakes them (a system call) only when there are any.
    waiters: std::sync::atomic::AtomicUsize,
    /// Where it is: the recording job of its stream (what a deadlock check follows).
    pub(super) at: Target,
}

impl Point {
    pub(super) fn new(at: Target) -> Point {
        Point {
            generation: crate::fork::generation(),
            reached: Mutex::new(None),
            done: Condvar::new(),
            waiters: Default::default(),
            at,
        }
    }

    /// Takes the lock: on a point that may be orphaned, ask [`Point::orphaned`] first.
    pub(super) fn is_reached(&self) -> bool {
        self.lock().is_some()
    }

    /// Recorded before a `fork()` and not reached then: the worker that would reach it stayed
    /// in the parent, so it never completes here. Its lock may have been held by that worker at
    /// the fork, so it is only tried.
    pub(super) fn orphaned(&self) -> bool {
        self.generation != crate::fork::generation()
            && self.reached.try_lock().map_or(true, |reached| reached.is_none())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.reached.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn complete(&self) {
        let mut reached = self.lock();
        reached.get_or_insert_with(Instant::now);
        // Waiters register under the lock, so none can be missed between this check and sleep.
        let wake = self.waiters.load(std::sync::atomic::Ordering::Relaxed) > 0;
        drop(reached);
        if wake {
            self.done.notify_all();
        }
    }

    /// Blocks until the point is reached, unchecked: what a stream's `wait` job does (the user
    /// ordered the streams; a cycle there hangs on every device, as it does in CUDA).
    pub(super) fn wait(&self) {
        let mut reached = self.lock();
        if reached.is_some() {
            return;
        }
        self.waiters.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        while reached.is_none() {
            reached = self.done.wait(reached).unwrap_or_else(|p| p.into_inner());
        }
        self.waiters.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn time(&self) -> Option<Instant> {
        *self.lock()
    }
}

#[derive(Debug, Default)]
pub struct CpuEvent {
    /// The last recorded point; `None` until the first record (a never-recorded event counts
    /// as complete, as in CUDA).
    current: Mutex<Option<Arc<Point>>>,
}

impl CpuEvent {
    fn current(&self) -> Option<Arc<Point>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A new point at `at`, made current; the recording stream completes it.
    pub(super) fn begin_record(&self, at: Target) -> Arc<Point> {
        let point = Arc::new(Point::new(at));
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&point));
        point
    }

    /// The point a wait enqueued now must wait for.
    pub(super) fn wait_point(&self) -> Option<Arc<Point>> {
        self.current()
    }
}

impl EventBackend for CpuEvent {
    fn synchronize(&self) -> Result<()> {
        match self.current() {
            // Before anything takes the point's lock, which the parent's worker may have held.
            Some(point) if point.orphaned() => Err(Error::Device {
                device: crate::device::DeviceId::CPU,
                message: crate::fork::orphaned_message("the work this event waits for"),
            }),
            // From a stream's worker (a host function) the wait is checked: one that could only
            // end after the running work returns is refused instead of hanging.
            Some(point) if !point.is_reached() => super::stream::blocking_wait(&point.at, "an event", || point.wait()),
            _ => Ok(()),
        }
    }

    fn query(&self) -> bool {
        self.current().is_none_or(|p| !p.orphaned() && p.time().is_some())
    }

    fn elapsed_ms(&self, end: &dyn EventBackend) -> Result<f64> {
        let not_ready = |what: &str| Error::Device {
            device: crate::device::DeviceId::CPU,
            message: format!("elapsed_time: the {what} event has not been recorded and completed"),
        };
        let end = end.as_any().downcast_ref::<CpuEvent>().ok_or_else(|| Error::Device {
            device: crate::device::DeviceId::CPU,
            message: "elapsed_time: events belong to different devices".into(),
        })?;
        let start_at = self.current().and_then(|p| p.time()).ok_or_else(|| not_ready("start"))?;
        let end_at = end.current().and_then(|p| p.time()).ok_or_else(|| not_ready("end"))?;
        // Signed like CUDA's cudaEventElapsedTime: negative when `end` completed first.
        Ok(if end_at >= start_at {
            end_at.duration_since(start_at).as_secs_f64() * 1e3
        } else {
            -(start_at.duration_since(end_at).as_secs_f64() * 1e3)
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
