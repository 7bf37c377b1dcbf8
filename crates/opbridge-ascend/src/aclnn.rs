//! CANN's operator library (aclnn), resolved at run time like the runtime: the tensor
//! descriptors of `libnnopbase.so` and the two-phase operators of `libopapi.so` (or the split
//! `libopapi_math.so` / `libopapi_nn.so` of newer CANN). Prototypes from `aclnn/acl_meta.h` and
//! the `aclnnop/aclnn_*.h` headers (`shared/notes/ascend-acl.md` §1.9-1.10).
//!
//! Every operator runs in two phases: `aclnnXxxGetWorkspaceSize` checks the call and returns an
//! executor and a workspace size; `aclnnXxx(workspace, size, executor, stream)` enqueues it and
//! consumes the executor. `Aclnn::run` does both, with the workspace from the call's pool.
#![allow(unsafe_code, non_snake_case)]

use std::ffi::{c_int, c_void};
use std::fmt;
use std::path::{Path, PathBuf};

use libloading::Library;
use opbridge_runtime::{DType, DeviceId, Error, Result, Tensor};

use crate::result::driver_error;
use crate::sys::{Acl, AclStatus, RawStream};

/// Opaque aclnn objects.
pub type AclTensor = c_void;
pub type AclScalar = c_void;
pub type Executor = c_void;

/// `aclFormat`: plain row-major (strides say the rest).
const ACL_FORMAT_ND: c_int = 2;

/// `aclDataType` of each of our dtypes.
pub fn acl_dtype(dtype: DType) -> c_int {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::I32 => 3,
        DType::I64 => 9,
        DType::F64 => 11,
    }
}

/// Phase 2 of every operator.
pub type Phase2 =
    unsafe extern "C" fn(workspace: *mut c_void, size: u64, executor: *mut Executor, stream: RawStream) -> AclStatus;
/// Phase 1's out-pointers: the workspace size and the executor.
pub type WorkspaceOut = (*mut u64, *mut *mut Executor);
/// `aclnnXxxGetWorkspaceSize` of binary operators with an `alpha` (Add, Sub).
pub type BinaryAlphaPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    b: *const AclTensor,
    alpha: *const AclScalar,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnXxxGetWorkspaceSize` of binary operators (Mul, Div, Maximum, Minimum, PowTensorTensor).
pub type BinaryPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    b: *const AclTensor,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
pub type CastPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    dtype: c_int,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
pub type CopyPhase1 = unsafe extern "C" fn(
    dst: *mut AclTensor,
    src: *const AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
pub type MatmulPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    b: *const AclTensor,
    out: *mut AclTensor,
    cube_math_type: i8,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;

type CreateTensor = unsafe extern "C" fn(
    view_dims: *const i64,
    view_dims_num: u64,
    dtype: c_int,
    strides: *const i64,
    offset: i64,
    format: c_int,
    storage_dims: *const i64,
    storage_dims_num: u64,
    data: *mut c_void,
) -> *mut AclTensor;
type DestroyTensor = unsafe extern "C" fn(tensor: *const AclTensor) -> AclStatus;
type CreateScalar = unsafe extern "C" fn(value: *mut c_void, dtype: c_int) -> *mut AclScalar;
type DestroyScalar = unsafe extern "C" fn(scalar: *const AclScalar) -> AclStatus;
type ExecutorFn = unsafe extern "C" fn(executor: *mut Executor) -> AclStatus;

/// An operator's two phases.
#[derive(Debug, Clone, Copy)]
pub struct TwoPhase<P> {
    pub name: &'static str,
    pub phase1: P,
    pub phase2: Phase2,
}

/// The resolved aclnn libraries. Operators missing from them are `None` (that operator then
/// has no Ascend kernel on this installation).
pub struct Aclnn {
    _libraries: Vec<Library>,
    pub paths: Vec<PathBuf>,
    create_tensor: CreateTensor,
    destroy_tensor: DestroyTensor,
    create_scalar: CreateScalar,
    destroy_scalar: DestroyScalar,
    /// `aclSetAclOpExecutorRepeatable` and `aclDestroyAclOpExecutor`: how an executor whose
    /// phase 2 will not run (its workspace could not be had) is given back.
    set_repeatable: Option<ExecutorFn>,
    destroy_executor: Option<ExecutorFn>,
    pub add: Option<TwoPhase<BinaryAlphaPhase1>>,
    pub sub: Option<TwoPhase<BinaryAlphaPhase1>>,
    pub mul: Option<TwoPhase<BinaryPhase1>>,
    pub div: Option<TwoPhase<BinaryPhase1>>,
    pub maximum: Option<TwoPhase<BinaryPhase1>>,
    pub minimum: Option<TwoPhase<BinaryPhase1>>,
    pub pow: Option<TwoPhase<BinaryPhase1>>,
    pub cast: Option<TwoPhase<CastPhase1>>,
    pub copy: Option<TwoPhase<CopyPhase1>>,
    pub matmul: Option<TwoPhase<MatmulPhase1>>,
}

impl fmt::Debug for Aclnn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aclnn").field("paths", &self.paths).finish_non_exhaustive()
    }
}

/// Opens `name` from `folder` when it is there, else through the system loader.
fn open(folder: Option<&Path>, name: &str, tried: &mut Vec<String>) -> Option<(Library, PathBuf)> {
    let candidates: Vec<PathBuf> =
        folder.map(|f| f.join(name)).filter(|p| p.exists()).into_iter().chain([PathBuf::from(name)]).collect();
    for path in candidates {
        // SAFETY: loading runs the library's initializers; these are CANN's aclnn libraries
        // (or the test double's), found next to the ACL runtime that was chosen.
        match unsafe { Library::new(&path) } {
            Ok(library) => return Some((library, path)),
            Err(e) => tried.push(format!(
                "{}: {}",
                path.display(),
                std::error::Error::source(&e).map_or(e.to_string(), |c| c.to_string())
            )),
        }
    }
    None
}

/// One symbol of `libraries`, read as `T` (the prototype the caller names).
///
/// # Safety
/// `T` must be the function pointer type of the symbol's C prototype.
unsafe fn symbol<T: Copy>(libraries: &[Library], name: &str) -> Option<T> {
    let name = format!("{name}\0");
    // SAFETY: the caller guarantees `T`; the libraries stay loaded for the process.
    libraries.iter().find_map(|library| unsafe { library.get::<T>(name.as_bytes()) }.ok().map(|s| *s))
}

impl Aclnn {
    /// Loads `libnnopbase.so` and the operator libraries, looking first in the folder of the
    /// ACL runtime that was loaded (one CANN installation, or one double, per process).
    pub fn load(acl: &Acl) -> std::result::Result<Aclnn, String> {
        let folder = acl.path.parent().filter(|p| !p.as_os_str().is_empty());
        let mut tried = Vec::new();
        let mut libraries = Vec::new();
        let mut paths = Vec::new();
        let Some((base, path)) = open(folder, "libnnopbase.so", &mut tried) else {
            return Err(format!("libnnopbase.so not found; tried {}", tried.join(", ")));
        };
        libraries.push(base);
        paths.push(path);
        // One combined library (older CANN, op-plugin's choice), else the split ones.
        let combined = open(folder, "libopapi.so", &mut tried);
        let names: &[&str] = if combined.is_some() { &[] } else { &["libopapi_math.so", "libopapi_nn.so"] };
        for (library, path) in combined.into_iter().chain(names.iter().filter_map(|n| open(folder, n, &mut tried))) {
            libraries.push(library);
            paths.push(path);
        }
        if libraries.len() == 1 {
            return Err(format!(
                "no aclnn operator library (libopapi.so, libopapi_math.so) found; tried {}",
                tried.join(", ")
            ));
        }
        macro_rules! two_phase {
            ($name:literal, $phase1:ty) => {
                // SAFETY: the prototypes of `aclnnop/aclnn_*.h` (the aliases above).
                unsafe {
                    match (
                        symbol::<$phase1>(&libraries, concat!($name, "GetWorkspaceSize")),
                        symbol::<Phase2>(&libraries, $name),
                    ) {
                        (Some(phase1), Some(phase2)) => Some(TwoPhase { name: $name, phase1, phase2 }),
                        _ => None,
                    }
                }
            };
        }
        // SAFETY: the prototypes of `aclnn/acl_meta.h` (the aliases above).
        let (create_tensor, destroy_tensor, create_scalar, destroy_scalar) = unsafe {
            (
                symbol::<CreateTensor>(&libraries, "aclCreateTensor"),
                symbol::<DestroyTensor>(&libraries, "aclDestroyTensor"),
                symbol::<CreateScalar>(&libraries, "aclCreateScalar"),
                symbol::<DestroyScalar>(&libraries, "aclDestroyScalar"),
            )
        };
        let (Some(create_tensor), Some(destroy_tensor), Some(create_scalar), Some(destroy_scalar)) =
            (create_tensor, destroy_tensor, create_scalar, destroy_scalar)
        else {
            return Err(format!("{} lacks aclCreateTensor / aclCreateScalar", paths[0].display()));
        };
        // SAFETY: the prototypes of `aclnn/acl_meta.h`.
        let (set_repeatable, destroy_executor) = unsafe {
            (
                symbol::<ExecutorFn>(&libraries, "aclSetAclOpExecutorRepeatable"),
                symbol::<ExecutorFn>(&libraries, "aclDestroyAclOpExecutor"),
            )
        };
        Ok(Aclnn {
            set_repeatable,
            destroy_executor,
            add: two_phase!("aclnnAdd", BinaryAlphaPhase1),
            sub: two_phase!("aclnnSub", BinaryAlphaPhase1),
            mul: two_phase!("aclnnMul", BinaryPhase1),
            div: two_phase!("aclnnDiv", BinaryPhase1),
            maximum: two_phase!("aclnnMaximum", BinaryPhase1),
            minimum: two_phase!("aclnnMinimum", BinaryPhase1),
            pow: two_phase!("aclnnPowTensorTensor", BinaryPhase1),
            cast: two_phase!("aclnnCast", CastPhase1),
            copy: two_phase!("aclnnInplaceCopy", CopyPhase1),
            matmul: two_phase!("aclnnMatmul", MatmulPhase1),
            _libraries: libraries,
            paths,
            create_tensor,
            destroy_tensor,
            create_scalar,
            destroy_scalar,
        })
    }

    /// An `aclTensor` describing `tensor` (its storage, view shape, strides and offset in
    /// elements), destroyed when the descriptor drops.
    pub fn describe<'a>(&'a self, acl: &Acl, tensor: &Tensor) -> Result<Descriptor<'a>> {
        let item = tensor.dtype().size();
        let dims: Vec<i64> = tensor.shape().iter().map(|&d| d as i64).collect();
        let strides: Vec<i64> = tensor.strides().iter().map(|&s| s as i64).collect();
        let storage = [(tensor.storage().len() / item) as i64];
        let offset = (tensor.byte_offset() / item) as i64;
        // SAFETY: the arrays live across the call (ACL copies them); the data pointer is the
        // storage base of a live device tensor, 64-byte aligned (the pool's blocks).
        let raw = unsafe {
            (self.create_tensor)(
                dims.as_ptr(),
                dims.len() as u64,
                acl_dtype(tensor.dtype()),
                strides.as_ptr(),
                offset,
                ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                tensor.storage().ptr().0 as *mut c_void,
            )
        };
        if raw.is_null() {
            let why = acl.recent_message().unwrap_or_else(|| "no reason given".into());
            return Err(Error::Device { device: tensor.device(), message: format!("aclCreateTensor failed: {why}") });
        }
        Ok(Descriptor { aclnn: self, raw })
    }

    /// An `aclScalar` holding 1 in `dtype` (the `alpha` of Add and Sub).
    pub fn one(&self, dtype: DType) -> Scalar<'_> {
        let mut value: [u8; 8] = match dtype {
            DType::F16 => u64::from(half::f16::ONE.to_bits()).to_ne_bytes(),
            DType::F32 => u64::from(1f32.to_bits()).to_ne_bytes(),
            DType::F64 => 1f64.to_ne_bytes(),
            DType::I32 => u64::from(1u32).to_ne_bytes(),
            DType::I64 => 1i64.to_ne_bytes(),
        };
        // SAFETY: `value` holds the dtype's bit pattern at its start (little-endian hosts: the
        // low bytes come first); ACL copies it.
        let raw = unsafe { (self.create_scalar)(value.as_mut_ptr().cast(), acl_dtype(dtype)) };
        Scalar { aclnn: self, raw }
    }

    /// Runs both phases of an operator on `stream`: `phase1` is called with the workspace size
    /// and executor out-pointers; the workspace comes from `workspace` (the call's pool, for
    /// the stream, so it can be freed as soon as the work is enqueued).
    pub(crate) fn run(
        &self,
        acl: &Acl,
        device: DeviceId,
        (name, phase2): (&'static str, Phase2),
        stream: RawStream,
        phase1: impl FnOnce(WorkspaceOut) -> AclStatus,
        workspace: impl FnOnce(usize) -> Result<Option<opbridge_runtime::Buffer>>,
    ) -> Result<()> {
        let mut size = 0u64;
        let mut executor: *mut Executor = std::ptr::null_mut();
        let code = phase1((&mut size, &mut executor));
        if code != 0 {
            return Err(driver_error(acl, device, phase1_name(name), code));
        }
        let block = match workspace(size as usize) {
            Ok(block) => block,
            Err(error) => {
                // Phase 2 will not run to consume the executor: made repeatable (right after
                // phase 1, as documented), it may be destroyed by us instead of leaking.
                if let (Some(repeatable), Some(destroy)) = (self.set_repeatable, self.destroy_executor) {
                    // SAFETY: the live executor phase 1 just made, never handed to phase 2.
                    unsafe {
                        if repeatable(executor) == 0 {
                            destroy(executor);
                        }
                    }
                }
                return Err(error);
            }
        };
        let (ptr, len) = block.as_ref().map_or((std::ptr::null_mut(), 0), |b| (b.ptr().0 as *mut c_void, size));
        // SAFETY: the executor phase 1 just made; the workspace is device memory of at least
        // `size` bytes, kept by the pool until the stream has passed this work.
        let code = unsafe { phase2(ptr, len, executor, stream) };
        drop(block);
        if code != 0 {
            return Err(driver_error(acl, device, name, code));
        }
        Ok(())
    }
}

/// `aclnnAddGetWorkspaceSize` for `aclnnAdd` (a static name for errors).
fn phase1_name(name: &'static str) -> &'static str {
    match name {
        "aclnnAdd" => "aclnnAddGetWorkspaceSize",
        "aclnnSub" => "aclnnSubGetWorkspaceSize",
        "aclnnMul" => "aclnnMulGetWorkspaceSize",
        "aclnnDiv" => "aclnnDivGetWorkspaceSize",
        "aclnnMaximum" => "aclnnMaximumGetWorkspaceSize",
        "aclnnMinimum" => "aclnnMinimumGetWorkspaceSize",
        "aclnnPowTensorTensor" => "aclnnPowTensorTensorGetWorkspaceSize",
        "aclnnCast" => "aclnnCastGetWorkspaceSize",
        "aclnnInplaceCopy" => "aclnnInplaceCopyGetWorkspaceSize",
        "aclnnMatmul" => "aclnnMatmulGetWorkspaceSize",
        _ => "aclnn GetWorkspaceSize",
    }
}

/// An `aclTensor`, destroyed on drop.
#[derive(Debug)]
pub struct Descriptor<'a> {
    aclnn: &'a Aclnn,
    raw: *mut AclTensor,
}

impl Descriptor<'_> {
    pub fn raw(&self) -> *mut AclTensor {
        self.raw
    }
}

impl Drop for Descriptor<'_> {
    fn drop(&mut self) {
        // SAFETY: made by aclCreateTensor and destroyed once.
        unsafe { (self.aclnn.destroy_tensor)(self.raw) };
    }
}

/// An `aclScalar`, destroyed on drop.
#[derive(Debug)]
pub struct Scalar<'a> {
    aclnn: &'a Aclnn,
    raw: *mut AclScalar,
}

impl Scalar<'_> {
    pub fn raw(&self) -> *mut AclScalar {
        self.raw
    }
}

impl Drop for Scalar<'_> {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: made by aclCreateScalar and destroyed once.
            unsafe { (self.aclnn.destroy_scalar)(self.raw) };
        }
    }
}
