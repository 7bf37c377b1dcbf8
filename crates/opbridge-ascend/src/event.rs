//! ACL events: points in a stream's work, for ordering, waiting and timing. Made with
//! `ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE`, so one event can be waited on by another stream and
//! timed.
#![allow(unsafe_code)]

use std::any::Any;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
}

// SAFETY: an `aclrtEvent` is an opaque handle that ACL lets any thread use once that thread has
// the event's device current, which every method ensures (`Runtime::bind`).
unsafe impl Send for AscendEvent {}
// SAFETY: as for `Send`; ACL serializes concurrent calls on one event internally.
unsafe impl Sync for AscendEvent {}

impl AscendEvent {
    pub(crate) fn create(runtime: Arc<Runtime>, index: usize) -> Result<AscendEvent> {
        runtime.bind(index)?;
        let mut raw: RawEvent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the device is current on this thread.
        let code =
            unsafe { (runtime.acl.aclrtCreateEventWithFlag)(&mut raw, sys::ACL_EVENT_SYNC | sys::ACL_EVENT_TIME_LINE) };
        check(&runtime.acl, ascend(index), "aclrtCreateEventWithFlag", code)?;
        Ok(AscendEvent { runtime, index, raw, recorded: AtomicBool::new(false) })
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
        let mut status: c_int = 0;
        if let Some(query) = acl.aclrtQueryEventStatus {
            // SAFETY: a live event and a valid out-pointer.
            let code = unsafe { query(self.raw, &mut status) };
            if code != sys::ACL_SUCCESS {
                acl.recent_message(); // read and cleared: not left for the next error
            }
            return code == sys::ACL_SUCCESS && status == sys::ACL_EVENT_RECORDED_STATUS_COMPLETE;
        }
        if let Some(query) = acl.aclrtQueryEvent {
            // SAFETY: as above. The deprecated API's enum is the other way round.
            let code = unsafe { query(self.raw, &mut status) };
            return code == sys::ACL_SUCCESS && status == sys::ACL_EVENT_STATUS_COMPLETE;
        }
        // No way to poll: only a finished wait says "complete".
        EventBackend::synchronize(self).is_ok()
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
            // SAFETY: the event is ours and no longer used (this is its last handle). A failure
            // cannot be reported from drop; the driver's leak report would show it.
            unsafe { (self.runtime.acl.aclrtDestroyEvent)(self.raw) };
        }
    }
}
