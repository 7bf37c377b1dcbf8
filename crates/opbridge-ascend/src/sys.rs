//! The ACL runtime functions, resolved at run time with libloading: nothing links against CANN,
//! so the crate builds, imports and runs on machines without it. The prototypes are written from
//! the ACL headers (`acl_rt.h`, `acl_base_rt.h`; see `shared/notes/ascend-acl.md` §1).
//!
//! Where the library is looked for, in order (every path tried is remembered for the error
//! message and for `opbridge doctor`):
//! 1. `$OPBRIDGE_ASCEND_LIB_DIR` (how the test double is chosen: never a silent fallback),
//! 2. `$ASCEND_HOME_PATH/lib64`, `$ASCEND_TOOLKIT_HOME/lib64`, then CANN's default install roots,
//! 3. the system loader path.
//!
//! In each place `libacl_rt.so` (the current name) is tried before `libascendcl.so` (the
//! compatibility name older CANN ships).
#![allow(unsafe_code, non_snake_case)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::path::PathBuf;

use libloading::Library;

/// `aclError`: 0 is success.
pub type AclStatus = c_int;
/// `aclrtStream`, `aclrtEvent`: opaque handles.
pub type RawStream = *mut c_void;
pub type RawEvent = *mut c_void;
/// `aclrtBinHandle`, `aclrtFuncHandle`: a loaded kernel binary and a kernel in it.
pub type RawBinary = *mut c_void;
pub type RawFunction = *mut c_void;
/// `aclrtCallback`.
pub type Callback = unsafe extern "C" fn(user_data: *mut c_void);

pub const ACL_SUCCESS: AclStatus = 0;
pub const ACL_ERROR_REPEAT_INITIALIZE: AclStatus = 100002;
pub const ACL_ERROR_COMPILING_STUB_MODE: AclStatus = 100039;
pub const ACL_ERROR_RT_MEMORY_ALLOCATION: AclStatus = 207001;
/// `aclrtProcessReport` found nothing to do before its timeout.
pub const ACL_ERROR_RT_REPORT_TIMEOUT: AclStatus = 507012;

/// `aclrtMemcpyKind`.
pub const ACL_MEMCPY_HOST_TO_DEVICE: c_int = 1;
pub const ACL_MEMCPY_DEVICE_TO_HOST: c_int = 2;
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `aclrtMemMallocPolicy`: huge pages first, normal pages when none are left.
pub const ACL_MEM_MALLOC_HUGE_FIRST: c_int = 0;
/// `aclrtMemAttr`: the HBM totals (what torch_npu's allocator queries).
pub const ACL_HBM_MEM: c_int = 1;
/// `aclrtCallbackBlockType`: the stream waits for the callback before its next work.
pub const ACL_CALLBACK_BLOCK: c_int = 1;
/// `aclrtStreamStatus` / `aclrtEventRecordedStatus`.
pub const ACL_STREAM_STATUS_COMPLETE: c_int = 0;
pub const ACL_EVENT_RECORDED_STATUS_COMPLETE: c_int = 1;
/// The deprecated `aclrtEventStatus` of `aclrtQueryEvent`: its values are the other way round.
pub const ACL_EVENT_STATUS_COMPLETE: c_int = 0;
/// Event flags: usable by `aclrtStreamWaitEvent`, and timestamped.
pub const ACL_EVENT_SYNC: u32 = 0x1;
pub const ACL_EVENT_TIME_LINE: u32 = 0x8;
/// `aclrtSetStreamFailureMode`: later work on a stream still runs after one task failed.
pub const ACL_CONTINUE_ON_FAILURE: u64 = 0;

macro_rules! acl_functions {
    (
        required { $( fn $name:ident ( $( $arg:ident : $ty:ty ),* ) -> $ret:ty; )* }
        optional { $( fn $oname:ident ( $( $oarg:ident : $oty:ty ),* ) -> $oret:ty; )* }
    ) => {
        /// The resolved ACL runtime: one function pointer per API used, valid while `_library`
        /// is loaded (for the life of the process: the table is never dropped).
        pub struct Acl {
            _library: Library,
            /// The file that was loaded.
            pub path: PathBuf,
            $( pub $name: unsafe extern "C" fn( $( $ty ),* ) -> $ret, )*
            $( pub $oname: Option<unsafe extern "C" fn( $( $oty ),* ) -> $oret>, )*
        }

        impl Acl {
            /// Resolves every function; a missing required one names itself (a CANN too old).
            fn resolve(library: Library, path: PathBuf) -> Result<Acl, String> {
                // SAFETY: each symbol is read with the prototype of the ACL header it comes from
                // (the macro's table above); the pointers stay valid because the library is
                // moved into the table and never unloaded.
                unsafe {
                    $(
                        let $name = *library
                            .get::<unsafe extern "C" fn( $( $ty ),* ) -> $ret>(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| format!("{} lacks {}: {e}", path.display(), stringify!($name)))?;
                    )*
                    $(
                        let $oname = library
                            .get::<unsafe extern "C" fn( $( $oty ),* ) -> $oret>(concat!(stringify!($oname), "\0").as_bytes())
                            .ok()
                            .map(|symbol| *symbol);
                    )*
                    Ok(Acl { _library: library, path, $( $name, )* $( $oname, )* })
                }
            }
        }
    };
}

acl_functions! {
    required {
        fn aclInit(config_path: *const c_char) -> AclStatus;
        fn aclFinalize() -> AclStatus;
        fn aclGetRecentErrMsg() -> *const c_char;
        fn aclrtGetSocName() -> *const c_char;
        fn aclrtGetDeviceCount(count: *mut u32) -> AclStatus;
        fn aclrtSetDevice(device: i32) -> AclStatus;
        fn aclrtSynchronizeDevice() -> AclStatus;
        fn aclrtGetMemInfo(attr: c_int, free: *mut usize, total: *mut usize) -> AclStatus;
        fn aclrtCreateStream(stream: *mut RawStream) -> AclStatus;
        fn aclrtDestroyStream(stream: RawStream) -> AclStatus;
        fn aclrtSynchronizeStream(stream: RawStream) -> AclStatus;
        fn aclrtStreamWaitEvent(stream: RawStream, event: RawEvent) -> AclStatus;
        fn aclrtCreateEventWithFlag(event: *mut RawEvent, flag: u32) -> AclStatus;
        fn aclrtRecordEvent(event: RawEvent, stream: RawStream) -> AclStatus;
        fn aclrtSynchronizeEvent(event: RawEvent) -> AclStatus;
        fn aclrtEventElapsedTime(ms: *mut f32, start: RawEvent, end: RawEvent) -> AclStatus;
        fn aclrtDestroyEvent(event: RawEvent) -> AclStatus;
        fn aclrtMalloc(ptr: *mut *mut c_void, size: usize, policy: c_int) -> AclStatus;
        fn aclrtFree(ptr: *mut c_void) -> AclStatus;
        fn aclrtMallocHost(ptr: *mut *mut c_void, size: usize) -> AclStatus;
        fn aclrtFreeHost(ptr: *mut c_void) -> AclStatus;
        fn aclrtMemcpyAsync(
            dst: *mut c_void,
            dest_max: usize,
            src: *const c_void,
            count: usize,
            kind: c_int,
            stream: RawStream
        ) -> AclStatus;
        fn aclrtMemsetAsync(dst: *mut c_void, max: usize, value: i32, count: usize, stream: RawStream) -> AclStatus;
        fn aclrtSubscribeReport(thread_id: u64, stream: RawStream) -> AclStatus;
        fn aclrtUnSubscribeReport(thread_id: u64, stream: RawStream) -> AclStatus;
        fn aclrtProcessReport(timeout_ms: i32) -> AclStatus;
        fn aclrtLaunchCallback(callback: Callback, user_data: *mut c_void, block: c_int, stream: RawStream) -> AclStatus;
    }
    optional {
        fn aclrtCreateStreamWithConfig(stream: *mut RawStream, priority: u32, flag: u32) -> AclStatus;
        fn aclrtStreamQuery(stream: RawStream, status: *mut c_int) -> AclStatus;
        fn aclrtQueryEventStatus(event: RawEvent, status: *mut c_int) -> AclStatus;
        fn aclrtQueryEvent(event: RawEvent, status: *mut c_int) -> AclStatus;
        fn aclrtSetStreamFailureMode(stream: RawStream, mode: u64) -> AclStatus;
        fn aclrtGetVersion(major: *mut i32, minor: *mut i32, patch: *mut i32) -> AclStatus;
        // Kernel binaries (CANN 8.2 and later; notes §1.11).
        fn aclrtBinaryLoadFromFile(path: *const c_char, options: *mut c_void, binary: *mut RawBinary) -> AclStatus;
        fn aclrtBinaryLoadFromData(
            data: *const c_void,
            length: usize,
            options: *const c_void,
            binary: *mut RawBinary
        ) -> AclStatus;
        fn aclrtBinaryGetFunction(binary: RawBinary, name: *const c_char, function: *mut RawFunction) -> AclStatus;
        fn aclrtBinaryUnLoad(binary: RawBinary) -> AclStatus;
        fn aclrtLaunchKernelWithHostArgs(
            function: RawFunction,
            blocks: u32,
            stream: RawStream,
            config: *mut c_void,
            args: *mut c_void,
            args_size: usize,
            placeholders: *mut c_void,
            placeholder_count: usize
        ) -> AclStatus;
    }
}

impl fmt::Debug for Acl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acl").field("path", &self.path).finish_non_exhaustive()
    }
}

impl Acl {
    /// `aclGetRecentErrMsg()`: the driver's text for the calling thread's last failure (read
    /// and cleared), if any.
    pub fn recent_message(&self) -> Option<String> {
        // SAFETY: the function takes no arguments and returns NULL or a NUL-terminated string
        // owned by ACL (thread-local), which is copied before any other ACL call.
        let text = unsafe { (self.aclGetRecentErrMsg)() };
        // SAFETY: non-null: a valid C string per the ACL contract above.
        (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_string_lossy().trim().to_string())
    }

    /// `major.minor.patch` from `aclrtGetVersion`, where the library has it.
    pub fn version(&self) -> Option<String> {
        let get = self.aclrtGetVersion?;
        let (mut major, mut minor, mut patch) = (0, 0, 0);
        // SAFETY: valid out-pointers, the prototype of acl_rt.h.
        let code = unsafe { get(&mut major, &mut minor, &mut patch) };
        if code != ACL_SUCCESS {
            self.recent_message(); // read and cleared: not left for the next error
            return None;
        }
        Some(format!("{major}.{minor}.{patch}"))
    }

    /// `aclrtGetSocName()` (`Ascend910B1`), if the driver says.
    pub fn soc_name(&self) -> Option<String> {
        // SAFETY: as for `recent_message`: NULL or a static string owned by ACL.
        let name = unsafe { (self.aclrtGetSocName)() };
        // SAFETY: non-null: a valid C string.
        (!name.is_null()).then(|| unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned())
    }
}

/// The names of the ACL runtime library, current first.
const LIBRARY_NAMES: [&str; 2] = ["libacl_rt.so", "libascendcl.so"];

/// Whether `OPBRIDGE_ASCEND_LIB_DIR` names the one folder to use.
pub(crate) fn explicit_folder() -> bool {
    std::env::var_os("OPBRIDGE_ASCEND_LIB_DIR").is_some_and(|d| !d.is_empty())
}

/// Folders to look in, in order, each with where it came from.
pub(crate) fn search_folders() -> Vec<(PathBuf, &'static str)> {
    let mut folders = Vec::new();
    if let Some(dir) = std::env::var_os("OPBRIDGE_ASCEND_LIB_DIR").filter(|d| !d.is_empty()) {
        // An explicit choice (the test double, or one CANN of several): that folder only, so
        // a wrong path is an error, never a silent fallback to another installation.
        folders.push((PathBuf::from(dir), "OPBRIDGE_ASCEND_LIB_DIR"));
        return folders;
    }
    for variable in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(home) = std::env::var_os(variable).filter(|d| !d.is_empty()) {
            folders.push((PathBuf::from(home).join("lib64"), variable));
        }
    }
    for root in ["/usr/local/Ascend/cann/lib64", "/usr/local/Ascend/ascend-toolkit/latest/lib64"] {
        folders.push((PathBuf::from(root), "CANN's default install"));
    }
    folders
}

/// Why no ACL runtime could be used: one line per place tried.
#[derive(Debug, Clone)]
pub struct NotLoaded {
    pub reason: String,
    pub tried: Vec<String>,
}

impl fmt::Display for NotLoaded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; tried {}", self.reason, self.tried.join(", "))
    }
}

/// Finds, opens and resolves the ACL runtime.
pub fn load() -> Result<Acl, NotLoaded> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    for (folder, source) in search_folders() {
        for name in LIBRARY_NAMES {
            let path = folder.join(name);
            if path.exists() {
                candidates.push(path);
            } else {
                tried.push(format!("{} (from {source}): not found", path.display()));
            }
        }
    }
    // Last, the bare names: the system loader's own search (LD_LIBRARY_PATH, ld.so.cache),
    // unless a folder was named explicitly.
    let explicit = explicit_folder();
    // Files that exist but fail to load are "could not be loaded", not "not found".
    let found = !candidates.is_empty();
    if !explicit {
        candidates.extend(LIBRARY_NAMES.iter().map(PathBuf::from));
    }
    for path in candidates {
        // SAFETY: loading runs the library's initializers; an ACL runtime library (or the test
        // double, chosen explicitly) is what these paths name.
        let library = match unsafe { Library::new(&path) } {
            Ok(library) => library,
            Err(e) => {
                // libloading keeps dlerror()'s text as the error's source.
                let text = match std::error::Error::source(&e) {
                    Some(cause) => cause.to_string(),
                    None => e.to_string(),
                };
                // dlopen's own message starts with the name it was given: don't say it twice.
                tried.push(if text.contains(&*path.to_string_lossy()) {
                    text
                } else {
                    format!("{}: {text}", path.display())
                });
                continue;
            }
        };
        match Acl::resolve(library, path.clone()) {
            Ok(acl) => return Ok(acl),
            Err(reason) => tried.push(reason),
        }
    }
    let reason = match (found, explicit) {
        (true, _) => format!("{} could not be loaded", LIBRARY_NAMES.join(" or ")),
        (false, true) => format!("{} not found in OPBRIDGE_ASCEND_LIB_DIR", LIBRARY_NAMES.join(" or ")),
        (false, false) => format!("{} not found", LIBRARY_NAMES.join(" or ")),
    };
    Err(NotLoaded { reason, tried })
}
