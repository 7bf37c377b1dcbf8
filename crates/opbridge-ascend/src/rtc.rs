//! The Ascend runtime compiler (`aclrtc` in `libacl_rtc.so`, CANN 8.5 and later; notes §1.12),
//! loaded at run time from the folder of the ACL runtime in use (or the system loader path):
//! Ascend C source in, a kernel binary out (what [`crate::kernel::AscendKernel::from_binary`]
//! loads). The Python package keeps the binaries in its JIT cache.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use libloading::Library;

type Status = c_int;
type Prog = *mut std::ffi::c_void;

/// A failed compile: the compiler's code and its log (the source's errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileError {
    pub code: i32,
    pub message: String,
    pub log: String,
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)?;
        if !self.log.trim().is_empty() {
            write!(f, ":\n{}", self.log.trim_end())?;
        }
        Ok(())
    }
}

/// The resolved runtime compiler.
struct Rtc {
    _library: Library,
    path: PathBuf,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Status,
    bin_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    bin: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Prog) -> Status,
}

/// The name of an aclrtc error code.
fn code_name(code: Status) -> &'static str {
    match code {
        176000 => "ACL_ERROR_RTC_INVALID_PROG",
        176001 => "ACL_ERROR_RTC_INVALID_INPUT",
        176002 => "ACL_ERROR_RTC_INVALID_OPTION",
        176003 => "ACL_ERROR_RTC_COMPILATION",
        176004 => "ACL_ERROR_RTC_LINKING",
        276001 => "ACL_ERROR_RTC_OUT_OF_MEMORY",
        576000 => "ACL_ERROR_RTC_FAILURE",
        _ => "aclrtc error",
    }
}

fn load() -> Result<Rtc, String> {
    // Where the ACL runtime is looked for (no driver start needed to compile), then, unless a
    // folder was named explicitly, the system loader's own search.
    let mut tried = Vec::new();
    let mut candidates = Vec::new();
    for (folder, source) in crate::sys::search_folders() {
        let path = folder.join("libacl_rtc.so");
        if path.exists() {
            candidates.push(path);
        } else {
            tried.push(format!("{} (from {source}): not found", path.display()));
        }
    }
    if !crate::sys::explicit_folder() {
        candidates.push(PathBuf::from("libacl_rtc.so"));
    }
    for path in candidates {
        // SAFETY: loading runs the library's initializers: CANN's runtime compiler (or the
        // double's), next to the ACL runtime that was chosen.
        match unsafe { Library::new(&path) } {
            Ok(library) => {
                macro_rules! get {
                    ($name:literal) => {
                        // SAFETY: the prototypes of acl/acl_rt_compile.h (the field types above).
                        *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                            .map_err(|e| format!("{} lacks {}: {e}", path.display(), $name))?
                    };
                }
                return Ok(Rtc {
                    create: get!("aclrtcCreateProg"),
                    compile: get!("aclrtcCompileProg"),
                    bin_size: get!("aclrtcGetBinDataSize"),
                    bin: get!("aclrtcGetBinData"),
                    log_size: get!("aclrtcGetCompileLogSize"),
                    log: get!("aclrtcGetCompileLog"),
                    destroy: get!("aclrtcDestroyProg"),
                    path,
                    _library: library,
                });
            }
            Err(e) => tried.push(format!("{}: {e}", path.display())),
        }
    }
    Err(format!(
        "the Ascend runtime compiler libacl_rtc.so was not found (CANN 8.5 or later); tried {}",
        tried.join(", ")
    ))
}

fn rtc() -> Result<&'static Rtc, String> {
    static RTC: OnceLock<Result<Rtc, String>> = OnceLock::new();
    RTC.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Where the runtime compiler was loaded from (part of a JIT cache key).
pub fn library() -> Result<PathBuf, String> {
    rtc().map(|r| r.path.clone())
}

/// Compiles `source` (program `name`) with `options` (e.g. `--npu-arch=dav-2201`); the kernel
/// binary's bytes, or the compiler's code and log.
pub fn compile(source: &str, name: &str, options: &[String]) -> Result<Vec<u8>, CompileError> {
    let rtc = rtc().map_err(|message| CompileError { code: -1, message, log: String::new() })?;
    let text = |what: &str| {
        CString::new(what).map_err(|_| CompileError {
            code: 176001,
            message: "the source, name or an option contains a NUL byte".into(),
            log: String::new(),
        })
    };
    let (source, name) = (text(source)?, text(name)?);
    let options: Vec<CString> = options.iter().map(|o| text(o)).collect::<Result<_, _>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let failed = |code: Status, what: &str, log: String| CompileError {
        code,
        message: format!("{what} failed with error {code} ({})", code_name(code)),
        log,
    };
    let mut prog: Prog = std::ptr::null_mut();
    // SAFETY: NUL-terminated strings alive across the call; no headers (documented: 0, NULL).
    let code =
        unsafe { (rtc.create)(&mut prog, source.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) };
    if code != 0 {
        return Err(failed(code, "aclrtcCreateProg", String::new()));
    }
    // SAFETY: a live program; `option_ptrs` holds `options.len()` NUL-terminated strings.
    let code = unsafe { (rtc.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
    let log = read(prog, rtc.log_size, rtc.log)
        .map(|bytes| String::from_utf8_lossy(bytes.split(|&b| b == 0).next().unwrap_or_default()).into_owned());
    let outcome = if code != 0 {
        Err(failed(code, "aclrtcCompileProg", log.unwrap_or_default()))
    } else {
        read(prog, rtc.bin_size, rtc.bin).map_err(|code| failed(code, "aclrtcGetBinData", String::new()))
    };
    // SAFETY: the live program, destroyed once.
    unsafe { (rtc.destroy)(&mut prog) };
    outcome
}

/// A program's buffer of the size `size` says, filled by `fill`.
fn read(
    prog: Prog,
    size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    fill: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
) -> Result<Vec<u8>, Status> {
    let mut n = 0usize;
    // SAFETY: a live program and a valid out-pointer.
    let code = unsafe { size(prog, &mut n) };
    if code != 0 {
        return Err(code);
    }
    let mut buffer = vec![0u8; n];
    // SAFETY: `buffer` holds the `n` bytes the size call asked for.
    let code = unsafe { fill(prog, buffer.as_mut_ptr().cast()) };
    if code != 0 {
        return Err(code);
    }
    Ok(buffer)
}
