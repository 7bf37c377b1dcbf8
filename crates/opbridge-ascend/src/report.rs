//! Host functions on ACL streams run through `aclrtLaunchCallback`, which delivers each callback
//! to a *report thread*: a host thread subscribed to the stream (`aclrtSubscribeReport`) that
//! calls `aclrtProcessReport` in a loop. A few such threads per device serve every stream (a
//! stream is subscribed to the least loaded one the first time it needs a host function); never
//! one thread per stream.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use opbridge_runtime::{Error, Result};

use crate::device::{ascend, Runtime};
use crate::result::check;
use crate::sys::{self, RawStream};

/// Report threads per device.
const THREADS_PER_DEVICE: usize = 2;
/// How long one `aclrtProcessReport` waits before the thread checks whether to stop.
const POLL_MS: i32 = 100;

/// The report threads of one device, started on first use.
#[derive(Debug)]
pub struct ReportThreads {
    runtime: Arc<Runtime>,
    index: usize,
    threads: Mutex<Vec<Arc<ReportThread>>>,
}

/// One report thread: its id as ACL knows it, and how many streams it serves.
#[derive(Debug)]
pub struct ReportThread {
    /// `pthread_self()` of the thread, the id `aclrtSubscribeReport` takes.
    id: u64,
    streams: Mutex<usize>,
    changed: Condvar,
    stop: AtomicBool,
}

impl ReportThreads {
    pub fn new(runtime: Arc<Runtime>, index: usize) -> Arc<ReportThreads> {
        Arc::new(ReportThreads { runtime, index, threads: Mutex::new(Vec::new()) })
    }

    /// Subscribes `stream` to a report thread (the least loaded; a new one while there are
    /// fewer than [`THREADS_PER_DEVICE`]).
    pub(crate) fn subscribe(&self, stream: RawStream) -> Result<Arc<ReportThread>> {
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        let idle = threads.iter().find(|t| *t.lock() == 0).cloned();
        let thread = match idle {
            Some(thread) => thread,
            None if threads.len() < THREADS_PER_DEVICE => {
                let thread = self.start()?;
                threads.push(Arc::clone(&thread));
                thread
            }
            None => threads.iter().min_by_key(|t| *t.lock()).cloned().expect("at least one report thread"),
        };
        drop(threads);
        // SAFETY: a live stream of this device (current on this thread) and a report thread id.
        let code = unsafe { (self.runtime.acl.aclrtSubscribeReport)(thread.id, stream) };
        check(&self.runtime.acl, ascend(self.index), "aclrtSubscribeReport", code)?;
        *thread.lock() += 1;
        thread.changed.notify_all();
        Ok(thread)
    }

    /// Ends `stream`'s subscription (before the stream is destroyed).
    pub(crate) fn unsubscribe(&self, thread: &ReportThread, stream: RawStream) {
        // SAFETY: the stream is live and subscribed to this thread. A failure leaves the
        // subscription to the driver's teardown; nothing else depends on it.
        unsafe { (self.runtime.acl.aclrtUnSubscribeReport)(thread.id, stream) };
        *thread.lock() -= 1;
    }

    /// Stops every report thread (at shutdown, after the streams' work is done).
    pub fn stop(&self) {
        for thread in self.threads.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            thread.stop();
        }
    }

    fn start(&self) -> Result<Arc<ReportThread>> {
        let (runtime, index) = (Arc::clone(&self.runtime), self.index);
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("opbridge-ascend{index}-report"))
            .spawn(move || {
                // SAFETY: pthread_self has no preconditions.
                let id = unsafe { libc::pthread_self() } as u64;
                let thread = Arc::new(ReportThread {
                    id,
                    streams: Mutex::new(0),
                    changed: Condvar::new(),
                    stop: AtomicBool::new(false),
                });
                let bound = runtime.bind(index);
                let failed = bound.is_err();
                if sender.send(bound.map(|()| Arc::clone(&thread))).is_err() || failed {
                    return;
                }
                thread.serve(&runtime);
            })
            .map_err(|e| Error::Device {
                device: ascend(index),
                message: format!("cannot start a report thread: {e}"),
            })?;
        receiver.recv().map_err(|_| Error::Device {
            device: ascend(index),
            message: "the report thread ended before it started".into(),
        })?
    }
}

impl ReportThread {
    fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Delivers callbacks while any stream is subscribed; sleeps while none is.
    fn serve(&self, runtime: &Runtime) {
        loop {
            let mut streams = self.lock();
            while *streams == 0 && !self.stop.load(Ordering::Acquire) {
                streams = self.changed.wait(streams).unwrap_or_else(|p| p.into_inner());
            }
            drop(streams);
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            // SAFETY: called on the subscribed thread, as ACL requires.
            let code = unsafe { (runtime.acl.aclrtProcessReport)(POLL_MS) };
            if code != sys::ACL_SUCCESS && code != sys::ACL_ERROR_RT_REPORT_TIMEOUT {
                // E.g. the last stream unsubscribed between the check and the call.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Asks the thread to end after its current poll.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.changed.notify_all();
    }
}
