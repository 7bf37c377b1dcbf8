//! ACL events: points in a stream's work, for ordering, waiting and timing. Made with
//! `ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE`, so one event can be waited on by another stream and
//! timed.
#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use opbridge_runtime::device::EventBackend;
use opbridge_runtime::{DeviceId, Error, Result};

use crate::device::{ascend, Runtime};
use crate::result::check;
use crate::sys::{self, RawEvent};

/// An `aclrtEvent` of one device.
#[derive(Debug)]
pub struct AscendEvent {
    runtime: Arc<Runtime>,
    index: usize,
    raw: RawEvent,
    /// Recorded at least once: ACL answers "complete" for a never-recorded event, but timing one
    /// is an error we report ourselves, with a clearer message.
    recorded: AtomicBool,
    /// A stream was made to wait for it: never reused (see [`Spares`]).
    waited: AtomicBool,
}

/// Events kept for reuse. Many events (the ends of tensors' epochs, see the runtime's `Mark`)
/// die unwaited by any stream, often before the device got there; making and destroying each
/// costs two driver calls. A dropped event that no stream ever waited on is kept instead (ACL's events
/// are flags: a stream's pending wait could see a later record, so waited-on ones are
/// destroyed), and the oldest kept one is reused once the driver says it has completed. Kept
/// events are destroyed before `aclFinalize`.
#[derive(Debug, Default)]
pub struct Spares(Mutex<std::collections::VecDeque<(usize, SpareEvent)>>);

/// A kept `aclrtEvent`: no handle of ours refers to it.
#[derive(Debug)]
pub(crate) struct SpareEvent(RawEvent);

// SAFETY: an unused event handle; whoever takes it binds its device before using it.
unsafe impl Send for SpareEvent {}

/// How many events are kept per runtime.
const SPARE_EVENTS: usize = 64;

impl Spares {
    /// The oldest kept event of device `index` if it has completed (the device is current).
    fn take(&self, runtime: &Runtime, index: usize) -> Option<RawEvent> {
        let (_, spare) = {
            let mut spares = self.0.lock().unwrap_or_else(|p| p.into_inner());
            let at = spares.iter().position(|(i, _)| *i == index)?;
            spares.remove(at)?
        };
        // The driver is asked outside the lock, so other threads' launches do not wait on it.
        if completed(runtime, spare.0) {
            return Some(spare.0);
        }
        // Still pending: kept again, first in line (the cap may be passed by as many as take
        // spares at once).
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push_front((index, spare));
        None
    }

    /// Keeps `raw`; false when full (the caller destroys it).
    fn keep(&self, index: usize, raw: RawEvent) -> bool {
        let mut spares = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if spares.len() >= SPARE_EVENTS {
            return false;
        }
        spares.push_back((index, SpareEvent(raw)));
        true
    }

    /// Destroys every kept event (before `aclFinalize`).
    pub(crate) fn destroy_all(&self, runtime: &Runtime) {
        let spares = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        for (index, SpareEvent(raw)) in spares {
            if runtime.bind(index).is_ok() {
                // SAFETY: an unused event of ours, destroyed once.
                unsafe { (runtime.acl.aclrtDestroyEvent)(raw) };
            }
        }
    }
}

/// Whether the driver says the last record of `raw` has completed (a never-recorded event has).
fn completed(runtime: &Runtime, raw: RawEvent) -> bool {
    let acl = &runtime.acl;
    let mut status: c_int = 0;
    if let Some(query) = acl.aclrtQueryEventStatus {
        // SAFETY: a live event of the current device and a valid out-pointer.
        let code = unsafe { query(raw, &mut status) };
        if code != sys::ACL_SUCCESS {
            acl.recent_message(); // read and cleared: not left for the next error
        }
        return code == sys::ACL_SUCCESS && status == sys::ACL_EVENT_RECORDED_STATUS_COMPLETE;
    }
    if let Some(query) = acl.aclrtQueryEvent {
        // SAFETY: as above. The deprecated API's enum is the other way round.
        let code = unsafe { query(raw, &mut status) };
        return code == sys::ACL_SUCCESS && status == sys::ACL_EVENT_STATUS_COMPLETE;
    }
    false
}

// SAFETY: an `aclrtEvent` is an opaque handle that ACL lets any thread use once that thread has
// the event's device current, which every method ensures (`Runtime::bind`).
unsafe impl Send for AscendEvent {}
// SAFETY: as for `Send`; ACL serializes concurrent calls on one event internally.
unsafe impl Sync for AscendEvent {}

impl AscendEvent {
    pub(crate) fn create(runtime: Arc<Runtime>, index: usize) -> Result<AscendEvent> {
        runtime.bind(index)?;
        if let Some(raw) = runtime.spare_events.take(&runtime, index) {
            return Ok(AscendEvent {
                runtime,
                index,
                raw,
                recorded: AtomicBool::new(false),
                waited: AtomicBool::new(false),
            });
        }
        let mut raw: RawEvent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the device is current on this thread.
        let code =
            unsafe { (runtime.acl.aclrtCreateEventWithFlag)(&mut raw, sys::ACL_EVENT_SYNC | sys::ACL_EVENT_TIME_LINE) };
        check(&runtime.acl, ascend(index), "aclrtCreateEventWithFlag", code)?;
        Ok(AscendEvent { runtime, index, raw, recorded: AtomicBool::new(false), waited: AtomicBool::new(false) })
    }

    pub(crate) fn raw(&self) -> RawEvent {
        self.raw
    }

    pub(crate) fn device(&self) -> DeviceId {
        ascend(self.index)
    }

    /// Called by the stream that records it.
    pub(crate) fn mark_recorded(&self) {
        self.recorded.store(true, Ordering::Release);
    }

    /// Called by a stream made to wait for it.
    pub(crate) fn mark_waited(&self) {
        self.waited.store(true, Ordering::Release);
    }

    fn check(&self, api: &'static str, code: c_int) -> Result<()> {
        check(&self.runtime.acl, self.device(), api, code)
    }
}

impl EventBackend for AscendEvent {
    fn synchronize(&self) -> Result<()> {
        if !self.recorded.load(Ordering::Acquire) {
            return Ok(());
        }
        self.runtime.bind(self.index)?;
        // SAFETY: a live event of this device, current on this thread.
        let code = unsafe { (self.runtime.acl.aclrtSynchronizeEvent)(self.raw) };
        self.check("aclrtSynchronizeEvent", code)
    }

    fn query(&self) -> bool {
        if !self.recorded.load(Ordering::Acquire) || self.runtime.bind(self.index).is_err() {
            return true;
        }
        let acl = &self.runtime.acl;
        if acl.aclrtQueryEventStatus.is_none() && acl.aclrtQueryEvent.is_none() {
            // No way to poll: only a finished wait says "complete".
            return EventBackend::synchronize(self).is_ok();
        }
        completed(&self.runtime, self.raw)
    }

    fn elapsed_ms(&self, end: &dyn EventBackend) -> Result<f64> {
        let end = end.as_any().downcast_ref::<AscendEvent>().filter(|e| e.index == self.index).ok_or_else(|| {
            Error::Device { device: self.device(), message: "elapsed time between events of different devices".into() }
        })?;
        if !self.recorded.load(Ordering::Acquire) || !end.recorded.load(Ordering::Acquire) {
            return Err(Error::Device {
                device: self.device(),
                message: "elapsed time of an event never recorded".into(),
            });
        }
        self.runtime.bind(self.index)?;
        let mut ms = 0f32;
        // SAFETY: two live events of this device and a valid out-pointer.
        let code = unsafe { (self.runtime.acl.aclrtEventElapsedTime)(&mut ms, self.raw, end.raw) };
        self.check("aclrtEventElapsedTime", code)?;
        Ok(f64::from(ms))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for AscendEvent {
    fn drop(&mut self) {
        if self.runtime.bind(self.index).is_ok() {
            if !self.waited.load(Ordering::Acquire) && self.runtime.spare_events.keep(self.index, self.raw) {
                return;
            }
            // SAFETY: the event is ours and no longer used (this is its last handle). A failure
            // cannot be reported from drop; the driver's leak report would show it.
            unsafe { (self.runtime.acl.aclrtDestroyEvent)(self.raw) };
        }
    }
}
