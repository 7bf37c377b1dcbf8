//! The ACL runtime of the process ([`Runtime`]: loaded and `aclInit`-ed once) and its devices
//! ([`AscendDevice`], the runtime's [`Device`] trait over ACL).
//!
//! ACL's current device is per host thread, and most calls fail (107002) on a thread that never
//! set one. Users must never have to: every call here first makes the device current on the
//! calling thread ([`Runtime::bind`]), which costs a thread-local compare when it already is.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use opbridge_runtime::backend::{Backend, DeviceReport};
use opbridge_runtime::device::{EventBackend, StreamBackend};
use opbridge_runtime::{Device, DeviceId, DeviceKind, DevicePtr, Error, Result, ALIGNMENT};

use crate::event::AscendEvent;
use crate::report::ReportThreads;
use crate::result::{check, code_name};
use crate::stream::AscendStream;
use crate::sys::{self, Acl};

/// Bumped by every `aclInit` of this process, so threads re-set their device after an
/// `aclFinalize` (which forgets every thread's current device).
static GENERATION: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// `(generation, device index)` current on this thread, as far as ACL knows.
    static CURRENT: Cell<(u64, i32)> = const { Cell::new((0, -1)) };
}

/// The loaded and initialized ACL runtime.
#[derive(Debug)]
pub struct Runtime {
    pub acl: Acl,
    pub device_count: usize,
    pub soc: Option<String>,
    generation: u64,
    /// Set by [`crate::shutdown`] before `aclFinalize`: from then on nothing calls ACL (handles
    /// dropped later, by thread-local destructors, are left to the finalized driver).
    finalized: std::sync::atomic::AtomicBool,
    /// The process that initialized ACL: a child made by `fork()` has none of the driver's
    /// threads, so ACL is refused there (a clear error, never a hang).
    fork_generation: u64,
    /// Whether our `aclInit` did the initialization (100002: someone else in the process did,
    /// e.g. torch_npu; then we must not finalize it under them).
    owns_init: bool,
    /// The aclnn operator libraries, loaded on the first operator call.
    aclnn: std::sync::OnceLock<std::result::Result<crate::aclnn::Aclnn, String>>,
    /// Events kept for reuse (see [`crate::event::Spares`]).
    pub(crate) spare_events: crate::event::Spares,
}

impl Runtime {
    /// Loads the library, `aclInit`s it and counts the devices. A stub library (CANN's
    /// no-driver build, every call answering 100039) is an error, not a device.
    fn start() -> std::result::Result<Runtime, String> {
        opbridge_runtime::fork::register(); // so a child made by fork() is told apart
        let acl = sys::load().map_err(|e| e.to_string())?;
        let path = acl.path.display().to_string();
        // SAFETY: NULL is the documented "no configuration file" argument.
        let code = unsafe { (acl.aclInit)(std::ptr::null()) };
        let owns_init = code == sys::ACL_SUCCESS;
        match code {
            sys::ACL_SUCCESS | sys::ACL_ERROR_REPEAT_INITIALIZE => {}
            sys::ACL_ERROR_COMPILING_STUB_MODE => {
                return Err(format!("{path} is CANN's stub library (stub: no driver): aclInit answered 100039"))
            }
            code => {
                let text = acl.recent_message().unwrap_or_default();
                return Err(format!("aclInit failed in {path} with error {code} ({}) {text}", code_name(code)));
            }
        }
        let mut count = 0u32;
        // SAFETY: a valid out-pointer.
        let code = unsafe { (acl.aclrtGetDeviceCount)(&mut count) };
        if code != sys::ACL_SUCCESS {
            let text = acl.recent_message().unwrap_or_default();
            return Err(format!("aclrtGetDeviceCount failed in {path} with error {code} ({}) {text}", code_name(code)));
        }
        let soc = acl.soc_name();
        let generation = GENERATION.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Runtime {
            acl,
            device_count: count as usize,
            soc,
            generation,
            finalized: Default::default(),
            fork_generation: opbridge_runtime::fork::generation(),
            owns_init,
            aclnn: Default::default(),
            spare_events: Default::default(),
        })
    }

    /// Makes device `index` current on the calling thread (`aclrtSetDevice` once per thread and
    /// device change).
    pub fn bind(&self, index: usize) -> Result<()> {
        let wanted = (self.generation, index as i32);
        if CURRENT.with(Cell::get) == wanted && !self.is_finalized() && !self.forked() {
            return Ok(());
        }
        if self.is_finalized() {
            return Err(Error::Unavailable {
                device: ascend(index),
                reason: "ACL was finalized (the process is ending)".into(),
            });
        }
        if self.forked() {
            return Err(Error::Unavailable {
                device: ascend(index),
                reason: "ACL cannot be used in a child made by fork() after the parent used it (the driver's \
                         threads are not in the child); use the 'spawn' start method"
                    .into(),
            });
        }
        // SAFETY: plain integer argument; ACL checks the range.
        let code = unsafe { (self.acl.aclrtSetDevice)(index as i32) };
        check(&self.acl, DeviceId { kind: DeviceKind::Ascend, index }, "aclrtSetDevice", code)?;
        CURRENT.with(|c| c.set(wanted));
        Ok(())
    }

    /// The aclnn libraries (loaded once, next to the runtime library).
    pub fn aclnn(&self) -> std::result::Result<&crate::aclnn::Aclnn, &str> {
        self.aclnn.get_or_init(|| crate::aclnn::Aclnn::load(&self.acl)).as_ref().map_err(String::as_str)
    }

    pub fn is_finalized(&self) -> bool {
        self.finalized.load(Ordering::Acquire)
    }

    /// `aclFinalize`, once; ACL is not called again by this process.
    /// True in a child made by `fork()` after ACL was initialized.
    pub fn forked(&self) -> bool {
        opbridge_runtime::fork::generation() != self.fork_generation
    }

    fn finalize(&self) -> Result<()> {
        // A fork's child, or an ACL someone else initialized: not ours to finalize.
        if self.finalized.swap(true, Ordering::AcqRel) || self.forked() || !self.owns_init {
            return Ok(());
        }
        // SAFETY: no arguments; every handle this crate holds is released or never used again.
        let code = unsafe { (self.acl.aclFinalize)() };
        check(&self.acl, ascend(0), "aclFinalize", code)
    }

    /// `(free, total)` bytes of device `index`'s HBM.
    fn memory_info(&self, index: usize) -> Result<(usize, usize)> {
        self.bind(index)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the device is current on this thread.
        let code = unsafe { (self.acl.aclrtGetMemInfo)(sys::ACL_HBM_MEM, &mut free, &mut total) };
        check(&self.acl, ascend(index), "aclrtGetMemInfo", code)?;
        Ok((free, total))
    }
}

/// `ascend:<index>`.
pub(crate) fn ascend(index: usize) -> DeviceId {
    DeviceId { kind: DeviceKind::Ascend, index }
}

/// The Ascend backend: registered with the runtime by [`crate::register`].
#[derive(Debug, Default)]
pub struct AscendBackend {
    /// The runtime once started. A failed start is retried on the next use (a library that
    /// appears later is then found); the last failure is kept for reports.
    runtime: Mutex<Option<Arc<Runtime>>>,
    /// Opened devices, by index (one per device for the process).
    opened: Mutex<Vec<Arc<AscendDevice>>>,
}

impl AscendBackend {
    /// The started runtime, starting it if needed.
    pub fn runtime(&self) -> std::result::Result<Arc<Runtime>, String> {
        let mut runtime = self.runtime.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(started) = runtime.as_ref() {
            return Ok(Arc::clone(started));
        }
        let started = Arc::new(Runtime::start()?);
        *runtime = Some(Arc::clone(&started));
        Ok(started)
    }
}

impl AscendBackend {
    /// Releases what the runtime holds on every opened device, stops the report threads and
    /// finalizes ACL (see [`crate::shutdown`]).
    pub fn shutdown(&self) -> Result<()> {
        let Some(runtime) = self.runtime.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Ok(());
        };
        if runtime.forked() {
            return Ok(()); // nothing of the parent's driver state is usable here
        }
        crate::executors::clear(); // every thread's, while ACL can still destroy them
        let opened: Vec<Arc<AscendDevice>> = self.opened.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut first = Ok(());
        for device in &opened {
            let released = opbridge_runtime::DeviceContext::get(device.id()).and_then(|ctx| ctx.release());
            device.reports.stop();
            if first.is_ok() {
                first = released;
            }
        }
        runtime.spare_events.destroy_all(&runtime); // last: releasing the devices drops events
        let finalized = runtime.finalize();
        first.and(finalized)
    }
}

impl Backend for AscendBackend {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Ascend
    }

    fn devices(&self) -> Vec<DeviceReport> {
        let unavailable = |reason: String, library: Option<String>| DeviceReport {
            kind: DeviceKind::Ascend,
            index: None,
            available: false,
            reason: Some(reason),
            soc: None,
            memory_bytes: None,
            library,
            driver_version: None,
        };
        let runtime = match self.runtime() {
            Ok(runtime) => runtime,
            Err(reason) => return vec![unavailable(reason, None)],
        };
        let library = Some(runtime.acl.path.display().to_string());
        if runtime.device_count == 0 {
            return vec![unavailable("the driver reports no Ascend device".into(), library)];
        }
        (0..runtime.device_count)
            .map(|index| {
                let memory = runtime.memory_info(index);
                DeviceReport {
                    kind: DeviceKind::Ascend,
                    index: Some(index),
                    available: memory.is_ok(),
                    reason: memory.as_ref().err().map(ToString::to_string),
                    soc: runtime.soc.clone(),
                    memory_bytes: memory.ok().map(|(_, total)| total as u64),
                    library: library.clone(),
                    driver_version: runtime.acl.version(),
                }
            })
            .collect()
    }

    fn open(&self, index: usize) -> Result<Arc<dyn Device>> {
        let id = ascend(index);
        let runtime = self.runtime().map_err(|reason| Error::Unavailable { device: id, reason })?;
        if index >= runtime.device_count {
            return Err(Error::Unavailable {
                device: id,
                reason: format!("the driver reports {} Ascend device(s)", runtime.device_count),
            });
        }
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(device) = opened.iter().find(|d| d.index == index) {
            return Ok(Arc::clone(device) as Arc<dyn Device>);
        }
        runtime.bind(index)?;
        let device =
            Arc::new(AscendDevice { reports: ReportThreads::new(Arc::clone(&runtime), index), runtime, index });
        opened.push(Arc::clone(&device));
        Ok(device)
    }
}

/// One Ascend device: memory from `aclrtMalloc` (the caching pool's segments), pinned host
/// memory from `aclrtMallocHost`, ACL streams and events.
#[derive(Debug)]
pub struct AscendDevice {
    runtime: Arc<Runtime>,
    index: usize,
    /// The threads that run host functions of this device's streams.
    reports: Arc<ReportThreads>,
}

impl AscendDevice {
    fn acl(&self) -> &Acl {
        &self.runtime.acl
    }

    fn check(&self, api: &'static str, code: i32) -> Result<()> {
        check(self.acl(), self.id(), api, code)
    }
}

impl Device for AscendDevice {
    fn id(&self) -> DeviceId {
        ascend(self.index)
    }

    fn host_accessible(&self) -> bool {
        false
    }

    fn padded_size(&self, bytes: usize) -> Option<usize> {
        acl_padded_size(bytes)
    }

    fn allocate_raw(&self, bytes: usize) -> Result<DevicePtr> {
        self.runtime.bind(self.index)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the device is current on this thread.
        let code = unsafe { (self.acl().aclrtMalloc)(&mut ptr, bytes, sys::ACL_MEM_MALLOC_HUGE_FIRST) };
        self.check("aclrtMalloc", code)?;
        // The pool's blocks start at multiples of ALIGNMENT from a segment's start: the
        // segment itself must be aligned so, as `aclrtMalloc` documents (64 bytes).
        debug_assert_eq!(ptr as usize % ALIGNMENT, 0, "aclrtMalloc returned an unaligned segment");
        Ok(DevicePtr(ptr as usize))
    }

    fn free_raw(&self, ptr: DevicePtr, _bytes: usize) -> Result<()> {
        self.runtime.bind(self.index)?;
        // SAFETY: `ptr` came from `aclrtMalloc` on this device (the pool frees only its own
        // segments, after synchronizing the device).
        let code = unsafe { (self.acl().aclrtFree)(ptr.0 as *mut c_void) };
        self.check("aclrtFree", code)
    }

    fn allocate_pinned(&self, bytes: usize) -> Result<DevicePtr> {
        self.runtime.bind(self.index)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let code = unsafe { (self.acl().aclrtMallocHost)(&mut ptr, bytes) };
        self.check("aclrtMallocHost", code)?;
        debug_assert_eq!(ptr as usize % ALIGNMENT, 0, "aclrtMallocHost returned an unaligned segment");
        Ok(DevicePtr(ptr as usize))
    }

    fn free_pinned(&self, ptr: DevicePtr, _bytes: usize) -> Result<()> {
        self.runtime.bind(self.index)?;
        // SAFETY: `ptr` came from `aclrtMallocHost` (the pinned pool's own segment).
        let code = unsafe { (self.acl().aclrtFreeHost)(ptr.0 as *mut c_void) };
        self.check("aclrtFreeHost", code)
    }

    fn create_stream(&self) -> Result<Arc<dyn StreamBackend>> {
        Ok(Arc::new(AscendStream::create(Arc::clone(&self.runtime), self.index, Arc::clone(&self.reports))?))
    }

    fn create_event(&self) -> Result<Arc<dyn EventBackend>> {
        Ok(Arc::new(AscendEvent::create(Arc::clone(&self.runtime), self.index)?))
    }
}

/// `aclrtMalloc`'s documented layout for `bytes`: ALIGN_UP(bytes, 32) + 32 (`None` on overflow).
fn acl_padded_size(bytes: usize) -> Option<usize> {
    bytes.checked_add(31).map(|b| b & !31)?.checked_add(32)
}

#[cfg(test)]
mod tests {
    use super::acl_padded_size as padded;

    #[test]
    fn padding_follows_acl() {
        assert_eq!(padded(1), Some(64));
        assert_eq!(padded(32), Some(64));
        assert_eq!(padded(33), Some(96));
        assert_eq!(padded(512), Some(544));
        assert_eq!(padded(usize::MAX - 10), None);
    }
}
