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
use std::sync::Arc;

use libloading::Library;
use opbridge_runtime::{DType, DeviceId, Error, Result, Tensor};

use crate::device::Runtime;
use crate::executors;
use crate::result::driver_error;
use crate::sys::{Acl, AclStatus, RawStream};

/// Opaque aclnn objects.
pub type AclTensor = c_void;
pub type AclScalar = c_void;
pub type AclIntArray = c_void;
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
/// `aclnnNegGetWorkspaceSize` and the other unary operators: `(self, out, ...)`.
pub type UnaryPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnSoftmaxGetWorkspaceSize` / `aclnnLogSoftmaxGetWorkspaceSize`: `(self, dim, out, ...)`.
pub type DimPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    dim: i64,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnReduceSumGetWorkspaceSize` / `aclnnMeanGetWorkspaceSize`: `(self, dims, keepDims, dtype, out, ...)`.
pub type ReduceDtypePhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    dims: *const AclIntArray,
    keep_dims: bool,
    dtype: c_int,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnLayerNormGetWorkspaceSize`: `(input, normalizedShape, weight?, bias?, eps, out, meanOut?,
/// rstdOut?, ...)`.
pub type LayerNormPhase1 = unsafe extern "C" fn(
    input: *const AclTensor,
    normalized_shape: *const AclIntArray,
    weight: *const AclTensor,
    bias: *const AclTensor,
    eps: f64,
    out: *mut AclTensor,
    mean_out: *mut AclTensor,
    rstd_out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnRmsNormGetWorkspaceSize`: `(x, gamma, epsilon, yOut, rstdOut, ...)`.
pub type RmsNormPhase1 = unsafe extern "C" fn(
    x: *const AclTensor,
    gamma: *const AclTensor,
    epsilon: f64,
    y_out: *mut AclTensor,
    rstd_out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnEmbeddingBagGetWorkspaceSize`: `(weight, indices, offsets, scaleGradByFreq, mode, sparse,
/// perSampleWeights?, includeLastOffset, paddingIdx, output, offset2bag, bagSize, maxIndices, ...)`.
pub type EmbeddingBagPhase1 = unsafe extern "C" fn(
    weight: *const AclTensor,
    indices: *const AclTensor,
    offsets: *const AclTensor,
    scale_grad_by_freq: bool,
    mode: i64,
    sparse: bool,
    per_sample_weights: *const AclTensor,
    include_last_offset: bool,
    padding_idx: i64,
    output: *mut AclTensor,
    offset2bag: *mut AclTensor,
    bag_size: *mut AclTensor,
    max_indices: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnAmaxGetWorkspaceSize` / `aclnnAminGetWorkspaceSize`: `(self, dim, keepDim, out, ...)`.
pub type ReducePhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    dims: *const AclIntArray,
    keep_dims: bool,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
/// `aclnnArgMaxGetWorkspaceSize`: `(self, dim, keepdim, out, ...)`.
pub type ArgMaxPhase1 = unsafe extern "C" fn(
    a: *const AclTensor,
    dim: i64,
    keep_dims: bool,
    out: *mut AclTensor,
    size: *mut u64,
    executor: *mut *mut Executor,
) -> AclStatus;
type CreateIntArray = unsafe extern "C" fn(values: *const i64, size: u64) -> *mut AclIntArray;
type DestroyIntArray = unsafe extern "C" fn(array: *const AclIntArray) -> AclStatus;
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
/// `aclSetInputTensorAddr` / `aclSetOutputTensorAddr`: a repeatable executor's tensor `index`
/// (inputs and outputs counted apart) is pointed at new storage.
type SetTensorAddr =
    unsafe extern "C" fn(executor: *mut Executor, index: usize, tensor: *mut AclTensor, addr: *mut c_void) -> AclStatus;

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
    /// What reusing an executor takes besides the two above (older CANN lacks them: every
    /// call then runs both phases).
    set_input_addr: Option<SetTensorAddr>,
    set_output_addr: Option<SetTensorAddr>,
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
    pub reduce_sum: Option<TwoPhase<ReduceDtypePhase1>>,
    pub mean: Option<TwoPhase<ReduceDtypePhase1>>,
    pub amax: Option<TwoPhase<ReducePhase1>>,
    pub amin: Option<TwoPhase<ReducePhase1>>,
    pub argmax: Option<TwoPhase<ArgMaxPhase1>>,
    pub layer_norm: Option<TwoPhase<LayerNormPhase1>>,
    pub rms_norm: Option<TwoPhase<RmsNormPhase1>>,
    pub embedding_bag: Option<TwoPhase<EmbeddingBagPhase1>>,
    /// `(x, approximate, y)`: the shape of [`DimPhase1`].
    pub gelu: Option<TwoPhase<DimPhase1>>,
    create_int_array: Option<CreateIntArray>,
    destroy_int_array: Option<DestroyIntArray>,
    pub softmax: Option<TwoPhase<DimPhase1>>,
    pub log_softmax: Option<TwoPhase<DimPhase1>>,
    /// The unary operators by opbridge name (`neg` → `aclnnNeg`, ...), those present.
    pub unary: Vec<(&'static str, TwoPhase<UnaryPhase1>)>,
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
        let (set_repeatable, destroy_executor, set_input_addr, set_output_addr) = unsafe {
            (
                symbol::<ExecutorFn>(&libraries, "aclSetAclOpExecutorRepeatable"),
                symbol::<ExecutorFn>(&libraries, "aclDestroyAclOpExecutor"),
                symbol::<SetTensorAddr>(&libraries, "aclSetInputTensorAddr"),
                symbol::<SetTensorAddr>(&libraries, "aclSetOutputTensorAddr"),
            )
        };
        Ok(Aclnn {
            set_repeatable,
            destroy_executor,
            set_input_addr,
            set_output_addr,
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
            reduce_sum: two_phase!("aclnnReduceSum", ReduceDtypePhase1),
            mean: two_phase!("aclnnMean", ReduceDtypePhase1),
            amax: two_phase!("aclnnAmax", ReducePhase1),
            amin: two_phase!("aclnnAmin", ReducePhase1),
            argmax: two_phase!("aclnnArgMax", ArgMaxPhase1),
            layer_norm: two_phase!("aclnnLayerNorm", LayerNormPhase1),
            rms_norm: two_phase!("aclnnRmsNorm", RmsNormPhase1),
            embedding_bag: two_phase!("aclnnEmbeddingBag", EmbeddingBagPhase1),
            gelu: two_phase!("aclnnGeluV2", DimPhase1),
            // SAFETY: the prototypes of `aclnn/acl_meta.h`.
            create_int_array: unsafe { symbol::<CreateIntArray>(&libraries, "aclCreateIntArray") },
            // SAFETY: the prototype of `aclnn/acl_meta.h`.
            destroy_int_array: unsafe { symbol::<DestroyIntArray>(&libraries, "aclDestroyIntArray") },
            softmax: two_phase!("aclnnSoftmax", DimPhase1),
            log_softmax: two_phase!("aclnnLogSoftmax", DimPhase1),
            unary: [
                ("neg", two_phase!("aclnnNeg", UnaryPhase1)),
                ("abs", two_phase!("aclnnAbs", UnaryPhase1)),
                ("exp", two_phase!("aclnnExp", UnaryPhase1)),
                ("log", two_phase!("aclnnLog", UnaryPhase1)),
                ("sqrt", two_phase!("aclnnSqrt", UnaryPhase1)),
                ("relu", two_phase!("aclnnRelu", UnaryPhase1)),
                ("sigmoid", two_phase!("aclnnSigmoid", UnaryPhase1)),
                ("tanh", two_phase!("aclnnTanh", UnaryPhase1)),
                ("silu", two_phase!("aclnnSilu", UnaryPhase1)),
            ]
            .into_iter()
            .filter_map(|(op, found)| Some((op, found?)))
            .collect(),
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
        self.scalar(1.0, dtype)
    }

    /// An `aclScalar` holding `value` rounded to `dtype` (integers: truncated).
    pub fn scalar(&self, value: f64, dtype: DType) -> Scalar<'_> {
        let mut value: [u8; 8] = match dtype {
            DType::F16 => u64::from(half::f16::from_f64(value).to_bits()).to_ne_bytes(),
            DType::F32 => u64::from((value as f32).to_bits()).to_ne_bytes(),
            DType::F64 => value.to_ne_bytes(),
            DType::I32 => u64::from(value as i32 as u32).to_ne_bytes(),
            DType::I64 => (value as i64).to_ne_bytes(),
        };
        // SAFETY: `value` holds the dtype's bit pattern at its start (little-endian hosts: the
        // low bytes come first); ACL copies it.
        let raw = unsafe { (self.create_scalar)(value.as_mut_ptr().cast(), acl_dtype(dtype)) };
        Scalar { aclnn: self, raw }
    }

    /// Enqueues one operator call on `stream`: phase 1 (`phase1`, given the descriptors of
    /// `call.tensors` and the alpha scalar) and phase 2 with a workspace from `workspace` (the
    /// call's pool, for the stream, so it can be freed as soon as the work is enqueued). A call
    /// whose layout this thread ran before reuses that executor and runs phase 2 alone
    /// ([`crate::executors`]).
    pub(crate) fn launch(
        &self,
        runtime: &Arc<Runtime>,
        device: DeviceId,
        call: &OpCall<'_>,
        stream: RawStream,
        phase1: &mut dyn FnMut(&[*mut AclTensor], *mut AclScalar, WorkspaceOut) -> AclStatus,
        workspace: impl Fn(usize) -> Result<Option<opbridge_runtime::Buffer>>,
    ) -> Result<()> {
        let acl = &runtime.acl;
        let reusable = call.repeatable
            && executors::enabled()
            && self.set_repeatable.is_some()
            && self.destroy_executor.is_some()
            && self.set_input_addr.is_some()
            && self.set_output_addr.is_some();
        let key = executors::CallKey::new(call.name, device.index, call.extra, call.tensors);
        if reusable {
            if let Some(cached) = executors::find(&key) {
                // `None`: the driver refused the reuse (the executor was forgotten): both phases.
                if let Some(outcome) = self.rerun(acl, device, &cached, call, stream, &workspace) {
                    return outcome;
                }
            }
        }
        let descriptors: Vec<Descriptor<'_>> =
            call.tensors.iter().map(|t| self.describe(acl, t)).collect::<Result<_>>()?;
        let alpha = call.alpha.map(|dtype| self.one(dtype));
        let raw: Vec<*mut AclTensor> = descriptors.iter().map(Descriptor::raw).collect();
        let alpha_raw = alpha.as_ref().map_or(std::ptr::null_mut(), Scalar::raw);
        let mut size = 0u64;
        let mut executor: *mut Executor = std::ptr::null_mut();
        let code = phase1(&raw, alpha_raw, (&mut size, &mut executor));
        if code != 0 {
            return Err(driver_error(acl, device, phase1_name(call.name), code));
        }
        // Repeatable right after phase 1, as documented; an operator that refuses is run once.
        let repeatable = reusable
            && self.set_repeatable.is_some_and(|f| {
                // SAFETY: the live executor phase 1 just made.
                let code = unsafe { f(executor) };
                if code != 0 {
                    acl.recent_message(); // read and cleared: not left for the next error
                }
                code == 0
            });
        let block = match workspace(size as usize) {
            Ok(block) => block,
            Err(error) => {
                self.give_back(executor, repeatable);
                return Err(error);
            }
        };
        let (ptr, len) = block.as_ref().map_or((std::ptr::null_mut(), 0), |b| (b.ptr().0 as *mut c_void, size));
        // SAFETY: the executor phase 1 just made; the workspace is device memory of at least
        // `size` bytes, kept by the pool until the stream has passed this work.
        let code = unsafe { (call.phase2)(ptr, len, executor, stream) };
        drop(block);
        if code != 0 {
            if repeatable {
                self.give_back(executor, true); // a repeatable executor outlives a failed phase 2
            }
            return Err(driver_error(acl, device, call.name, code));
        }
        if repeatable {
            let tensors = descriptors.into_iter().map(Descriptor::into_raw).collect();
            let scalar = alpha.map_or(std::ptr::null_mut(), Scalar::into_raw);
            let cached = executors::Cached::new(Arc::clone(runtime), executor, tensors, scalar, call.phase2, size);
            executors::insert(&key, cached);
        }
        Ok(())
    }

    /// Phase 2 alone, on a cached executor pointed at this call's storage. `None` when the
    /// driver refuses to re-point it (it is forgotten; the caller runs both phases instead); an
    /// executor whose phase 2 fails is forgotten too.
    fn rerun(
        &self,
        acl: &Acl,
        device: DeviceId,
        cached: &Arc<executors::Cached>,
        call: &OpCall<'_>,
        stream: RawStream,
        workspace: &dyn Fn(usize) -> Result<Option<opbridge_runtime::Buffer>>,
    ) -> Option<Result<()>> {
        let (Some(set_input), Some(set_output)) = (self.set_input_addr, self.set_output_addr) else { return None };
        // The workspace first: an allocation failure leaves the executor as it was.
        let block = match workspace(cached.workspace as usize) {
            Ok(block) => block,
            Err(error) => return Some(Err(error)),
        };
        let last = call.tensors.len() - 1;
        for (index, tensor) in call.tensors.iter().enumerate() {
            let (setter, slot) = if index < last { (set_input, index) } else { (set_output, 0) };
            // SAFETY: a live repeatable executor and the descriptor it was made with (same
            // layout: the cache key); the storage base of a live device tensor.
            let code = unsafe {
                setter(cached.executor, slot, cached.tensors[index], tensor.storage().ptr().0 as *mut c_void)
            };
            if code != 0 {
                acl.recent_message(); // read and cleared: not left for the next error
                executors::remove(cached);
                return None;
            }
        }
        let (ptr, len) =
            block.as_ref().map_or((std::ptr::null_mut(), 0), |b| (b.ptr().0 as *mut c_void, cached.workspace));
        // SAFETY: a live repeatable executor pointed at this call's tensors; the workspace is
        // device memory of the size its phase 1 asked for, kept until the stream passes it.
        let code = unsafe { (cached.phase2)(ptr, len, cached.executor, stream) };
        drop(block);
        if code != 0 {
            let error = driver_error(acl, device, call.name, code);
            executors::remove(cached);
            return Some(Err(error));
        }
        Some(Ok(()))
    }

    /// Gives back an executor whose phase 2 will not run. A non-repeatable one is made
    /// repeatable first (allowed right after phase 1), so that it may be destroyed by us.
    fn give_back(&self, executor: *mut Executor, repeatable: bool) {
        let (Some(make_repeatable), Some(destroy)) = (self.set_repeatable, self.destroy_executor) else { return };
        // SAFETY: the live executor phase 1 made, not consumed by a phase 2.
        unsafe {
            if repeatable || make_repeatable(executor) == 0 {
                destroy(executor);
            }
        }
    }

    /// Destroys a cached executor, then the descriptors and scalar it was made with.
    ///
    /// # Safety
    /// Live handles made by this library, each destroyed once; the executor repeatable.
    pub(crate) unsafe fn destroy_cached(
        &self,
        executor: *mut Executor,
        tensors: &[*mut AclTensor],
        scalar: *mut AclScalar,
    ) {
        // SAFETY: the caller's guarantees.
        unsafe {
            if let Some(destroy) = self.destroy_executor {
                destroy(executor);
            }
            for &tensor in tensors {
                (self.destroy_tensor)(tensor);
            }
            if !scalar.is_null() {
                (self.destroy_scalar)(scalar);
            }
        }
    }
}

/// One operator call, for [`Aclnn::launch`].
pub(crate) struct OpCall<'a> {
    /// The phase-2 name (`aclnnAdd`) and function.
    pub name: &'static str,
    pub phase2: Phase2,
    /// The tensors phase 1 takes, inputs first, the output last.
    pub tensors: &'a [&'a Tensor],
    /// `Some(dtype)`: phase 1 also takes an `alpha` of 1 in `dtype` (Add, Sub).
    pub alpha: Option<DType>,
    /// Phase 1's other by-value arguments as one number (the cast's target dtype): part of
    /// what makes two calls the same.
    pub extra: i64,
    /// Whether the executor may be reused: CANN does not repeat in-place copies.
    pub repeatable: bool,
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

    /// The handle, no longer destroyed on drop (a cached executor's, see [`crate::executors`]).
    fn into_raw(self) -> *mut AclTensor {
        let raw = self.raw;
        std::mem::forget(self);
        raw
    }
}

impl Drop for Descriptor<'_> {
    fn drop(&mut self) {
        // SAFETY: made by aclCreateTensor and destroyed once.
        unsafe { (self.aclnn.destroy_tensor)(self.raw) };
    }
}

impl Aclnn {
    /// An `aclIntArray` of `values` (a reduction's dims), destroyed on drop; `None` when this
    /// installation lacks `aclCreateIntArray` or it fails.
    pub fn int_array(&self, values: &[i64]) -> Option<IntArray<'_>> {
        let (create, destroy) = (self.create_int_array?, self.destroy_int_array?);
        // SAFETY: `values` is a live slice of `len` i64s, copied by aclCreateIntArray.
        let raw = unsafe { create(values.as_ptr(), values.len() as u64) };
        (!raw.is_null()).then_some(IntArray { destroy, raw, _aclnn: std::marker::PhantomData })
    }
}

/// An `aclIntArray`, destroyed on drop.
#[derive(Debug)]
pub struct IntArray<'a> {
    destroy: DestroyIntArray,
    raw: *mut AclIntArray,
    _aclnn: std::marker::PhantomData<&'a Aclnn>,
}

impl IntArray<'_> {
    pub fn raw(&self) -> *const AclIntArray {
        self.raw
    }
}

impl Drop for IntArray<'_> {
    fn drop(&mut self) {
        // SAFETY: made by aclCreateIntArray and destroyed once.
        unsafe { (self.destroy)(self.raw) };
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

    /// The handle, no longer destroyed on drop.
    fn into_raw(self) -> *mut AclScalar {
        let raw = self.raw;
        std::mem::forget(self);
        raw
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
