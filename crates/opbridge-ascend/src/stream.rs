//! ACL streams: in-order queues of device work (copies, memsets, vendor kernels), events and
//! host functions. Everything here enqueues and returns, except the waits.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use opbridge_runtime::device::{EventBackend, StreamBackend};
use opbridge_runtime::{AsyncError, CopyKind, DeviceId, DevicePtr, Error, ErrorKind, HostFn, Result};

use crate::device::{ascend, Runtime};
use crate::event::AscendEvent;
use crate::report::{ReportThread, ReportThreads};
use crate::result::{async_error, check};
use crate::sys::{self, RawStream};

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// Where a stream's asynchronous errors wait for the next synchronize: a host function's
/// failure (ACL does not know of it), or a driver error that a drain saw but must not eat.
type Pending = Arc<Mutex<Option<AsyncError>>>;

/// An `aclrtStream` of one device.
#[derive(Debug)]
pub struct AscendStream {
    runtime: Arc<Runtime>,
    index: usize,
    raw: RawStream,
    name: String,
    pending: Pending,
    reports: Arc<ReportThreads>,
    /// The report thread this stream is subscribed to, from its first host function on.
    report: OnceLock<Arc<ReportThread>>,
    subscribing: Mutex<()>,
}

// SAFETY: an `aclrtStream` is an opaque handle that ACL lets any thread use once that thread has
// the stream's device current, which every method ensures (`Runtime::bind`).
unsafe impl Send for AscendStream {}
// SAFETY: as for `Send`; ACL serializes concurrent submissions to one stream internally.
unsafe impl Sync for AscendStream {}

/// A host function on its way to the report thread.
struct Callback {
    func: HostFn,
    pending: Pending,
}

/// Runs on the report thread when the stream reaches the callback.
unsafe extern "C" fn run_callback(user_data: *mut c_void) {
    // SAFETY: `user_data` is the `Box<Callback>` leaked by `launch_host_func`, delivered once.
    let callback = unsafe { Box::from_raw(user_data.cast::<Callback>()) };
    let Callback { func, pending } = *callback;
    // A panicking host function must not unwind into ACL's thread: it becomes the stream's error.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(func))
        .unwrap_or_else(|_| Err(AsyncError::new(ErrorKind::Internal, "host function panicked")));
    if let Err(error) = outcome {
        pending.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(error);
    }
}

impl AscendStream {
    pub(crate) fn create(runtime: Arc<Runtime>, index: usize, reports: Arc<ReportThreads>) -> Result<AscendStream> {
        runtime.bind(index)?;
        let mut raw: RawStream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the device is current on this thread.
        let code = unsafe { (runtime.acl.aclrtCreateStream)(&mut raw) };
        check(&runtime.acl, ascend(index), "aclrtCreateStream", code)?;
        let name = format!("ascend:{index} stream {}", NEXT_STREAM.fetch_add(1, Ordering::Relaxed));
        Ok(AscendStream {
            runtime,
            index,
            raw,
            name,
            pending: Pending::default(),
            reports,
            report: OnceLock::new(),
            subscribing: Mutex::new(()),
        })
    }

    fn device(&self) -> DeviceId {
        ascend(self.index)
    }

    fn check(&self, api: &'static str, code: c_int) -> Result<()> {
        check(&self.runtime.acl, self.device(), api, code)
    }

    /// Waits for the stream; a driver error (a failed task) is returned, not kept.
    fn wait(&self) -> Result<()> {
        self.runtime.bind(self.index)?;
        // SAFETY: a live stream of this device, current on this thread.
        let code = unsafe { (self.runtime.acl.aclrtSynchronizeStream)(self.raw) };
        self.check("aclrtSynchronizeStream", code)
    }

    fn take_pending(&self) -> Option<AsyncError> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn report_thread(&self) -> Result<&Arc<ReportThread>> {
        if let Some(thread) = self.report.get() {
            return Ok(thread);
        }
        let _one = self.subscribing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(thread) = self.report.get() {
            return Ok(thread);
        }
        let thread = self.reports.subscribe(self.raw)?;
        Ok(self.report.get_or_init(|| thread))
    }

    fn event<'a>(&self, event: &'a Arc<dyn EventBackend>) -> Result<&'a AscendEvent> {
        event.as_any().downcast_ref::<AscendEvent>().filter(|e| e.device() == self.device()).ok_or_else(|| {
            Error::Device { device: self.device(), message: format!("{}: an event of another device", self.name) }
        })
    }
}

impl StreamBackend for AscendStream {
    fn launch(&self, _kernel: HostFn) -> Result<()> {
        Err(Error::Device {
            device: self.device(),
            message: "a host kernel cannot run on an Ascend stream: the device's memory is not host memory \
                      (the operator needs an Ascend kernel)"
                .into(),
        })
    }

    fn launch_host_func(&self, func: HostFn) -> Result<()> {
        self.runtime.bind(self.index)?;
        self.report_thread()?;
        let user_data = Box::into_raw(Box::new(Callback { func, pending: Arc::clone(&self.pending) }));
        // SAFETY: the trampoline matches `aclrtCallback`; `user_data` is a leaked box that the
        // trampoline takes back exactly once. BLOCK: later work on the stream waits for it, as a
        // host function's stream order promises.
        let code = unsafe {
            (self.runtime.acl.aclrtLaunchCallback)(run_callback, user_data.cast(), sys::ACL_CALLBACK_BLOCK, self.raw)
        };
        if code != sys::ACL_SUCCESS {
            // SAFETY: not enqueued, so the trampoline will never see it: ours to free.
            drop(unsafe { Box::from_raw(user_data) });
        }
        self.check("aclrtLaunchCallback", code)
    }

    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, kind: CopyKind) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.runtime.bind(self.index)?;
        let kind = match kind {
            CopyKind::HostToDevice => sys::ACL_MEMCPY_HOST_TO_DEVICE,
            CopyKind::DeviceToHost => sys::ACL_MEMCPY_DEVICE_TO_HOST,
            CopyKind::DeviceToDevice => sys::ACL_MEMCPY_DEVICE_TO_DEVICE,
        };
        // SAFETY: the caller owns both ranges until the stream has passed this point (stream
        // order, as for every copy); the host side is pinned memory (the pinned pool).
        let code = unsafe {
            (self.runtime.acl.aclrtMemcpyAsync)(
                dst.0 as *mut c_void,
                bytes,
                src.0 as *const c_void,
                bytes,
                kind,
                self.raw,
            )
        };
        self.check("aclrtMemcpyAsync", code)
    }

    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.runtime.bind(self.index)?;
        // SAFETY: device memory the caller owns until the stream has passed this point.
        let code = unsafe {
            (self.runtime.acl.aclrtMemsetAsync)(dst.0 as *mut c_void, bytes, i32::from(value), bytes, self.raw)
        };
        self.check("aclrtMemsetAsync", code)
    }

    fn native_handle(&self) -> *mut c_void {
        self.raw
    }

    fn bind_current(&self) -> Result<()> {
        self.runtime.bind(self.index)
    }

    fn record(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let event = self.event(event)?;
        self.runtime.bind(self.index)?;
        // SAFETY: a live event and stream of this device, current on this thread.
        let code = unsafe { (self.runtime.acl.aclrtRecordEvent)(event.raw(), self.raw) };
        self.check("aclrtRecordEvent", code)?;
        event.mark_recorded();
        Ok(())
    }

    fn wait(&self, event: &Arc<dyn EventBackend>) -> Result<()> {
        let event = self.event(event)?;
        self.runtime.bind(self.index)?;
        // Marked first: a wait the driver refuses might still have been queued.
        event.mark_waited();
        // SAFETY: as for `record`.
        let code = unsafe { (self.runtime.acl.aclrtStreamWaitEvent)(self.raw, event.raw()) };
        self.check("aclrtStreamWaitEvent", code)
    }

    fn synchronize(&self) -> Result<()> {
        let waited = self.wait();
        let first = self.take_pending().or_else(|| waited.err().map(async_error));
        match first {
            None => Ok(()),
            Some(error) => Err(Error::Async { stream: self.name.clone(), error }),
        }
    }

    fn drain(&self) -> Result<()> {
        match self.wait() {
            // A failed task (5xxxxx codes) is the stream's error: kept for its next synchronize.
            Err(error @ Error::Driver { code: 500_000.., .. }) => {
                self.pending.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(async_error(error));
                Ok(())
            }
            // The wait itself was refused (e.g. from inside a host function): the caller's error.
            other => other,
        }
    }

    fn orphaned(&self) -> bool {
        self.runtime.forked()
    }

    fn query(&self) -> bool {
        if self.runtime.bind(self.index).is_err() {
            return true;
        }
        let Some(query) = self.runtime.acl.aclrtStreamQuery else {
            return false;
        };
        let mut status: c_int = 0;
        // SAFETY: a live stream and a valid out-pointer.
        let code = unsafe { query(self.raw, &mut status) };
        if code != sys::ACL_SUCCESS {
            self.runtime.acl.recent_message(); // read and cleared: not left for the next error
            return false;
        }
        status == sys::ACL_STREAM_STATUS_COMPLETE
    }
}

impl Drop for AscendStream {
    fn drop(&mut self) {
        if self.runtime.bind(self.index).is_err() {
            return;
        }
        // The stream's work must finish before it goes (host functions still to be delivered
        // need the subscription); its errors have no one left to report to.
        let _ = self.wait();
        if let Some(thread) = self.report.get() {
            self.reports.unsubscribe(thread, self.raw);
        }
        // SAFETY: the last handle of a live stream of this device, current on this thread.
        unsafe { (self.runtime.acl.aclrtDestroyStream)(self.raw) };
    }
}
