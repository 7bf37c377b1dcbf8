//! The built-in operators on Ascend, each through the aclnn operator CANN provides for it:
//!
//! | opbridge op | aclnn operator |
//! |---|---|
//! | `add`, `vector_add` | `aclnnAdd` (alpha = 1) |
//! | `axpy` (`alpha * x + y`) | `aclnnAdd(y, x, alpha)` |
//! | `sub` | `aclnnSub` (alpha = 1) |
//! | `mul`, `div`, `maximum`, `minimum` | `aclnnMul`, `aclnnDiv`, `aclnnMaximum`, `aclnnMinimum` |
//! | `pow` | `aclnnPowTensorTensor` |
//! | `cast` | `aclnnCast` |
//! | `contiguous` | `aclnnInplaceCopy` (a strided source into a contiguous output) |
//! | `transpose` | `aclnnInplaceCopy` from the input's permuted view (no transpose kernel needed) |
//! | `softmax`, `log_softmax` | `aclnnSoftmax`, `aclnnLogSoftmax` (`dim` = `axis`) |
//! | `sum`, `mean` | `aclnnReduceSum`, `aclnnMean` (`dims` = `axis` or all, `dtype` = the result's) |
//! | `max`, `min` | `aclnnAmax`, `aclnnAmin` |
//! | `argmax` | `aclnnArgMax` (`axis` None: over the flat view of a contiguous input) |
//! | `layer_norm` | `aclnnLayerNorm` (`normalizedShape` = the last axis; no mean / rstd outputs) |
//! | `rms_norm` | `aclnnRmsNorm` (gamma = `weight`, or ones uploaded on the stream; `rstdOut` a scratch float32 tensor; float16 / float32, as CANN) |
//! | `embedding_bag` | `aclnnEmbeddingBag` (mode 0 sum, 1 mean, 2 max; `offset2bag`, `bagSize`, `maxIndices` scratch; a bad index or offset fails the stream, as CANN's kernel does) |
//! | `gelu` | `aclnnGeluV2` (`approximate` 0 = erf, 1 = tanh; float16 / float32, as CANN) |
//! | `matmul` | `aclnnMatmul` (`cubeMathType` = KEEP_DTYPE: no silent precision loss) |
//! | `neg`, `abs`, `exp`, `log`, `sqrt` | `aclnnNeg`, `aclnnAbs`, `aclnnExp`, `aclnnLog`, `aclnnSqrt` |
//! | `relu`, `sigmoid`, `tanh`, `silu` | `aclnnRelu`, `aclnnSigmoid`, `aclnnTanh`, `aclnnSilu` |
//!
//! Broadcasting and strided inputs are described to aclnn as they are (view shape, strides and
//! offset over the storage), never expanded first.
#![allow(unsafe_code)]

use opbridge_ops::device::{DeviceCall, DeviceKernel};
use opbridge_runtime::{DType, DeviceKind, Error, Result, Tensor};

use crate::aclnn::{acl_dtype, AclScalar, AclTensor, Aclnn, OpCall, Phase2, WorkspaceOut};
use crate::device::Runtime;
use crate::sys::AclStatus;

/// Which aclnn operator a kernel calls.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    Pow,
    Cast,
    Contiguous,
    Transpose,
    Softmax,
    LogSoftmax,
    Sum,
    Mean,
    Max,
    Min,
    ArgMax,
    LayerNorm,
    RmsNorm,
    EmbeddingBag,
    Gelu,
    Axpy,
    Matmul,
    /// A unary operator, by opbridge name (its aclnn operator in [`Aclnn::unary`]).
    Unary(&'static str),
}

/// Our operator names and their kernels (a static: the registry keeps `&'static` kernels).
static KERNELS: [(&str, Kernel); 33] = [
    ("add", Kernel::Add),
    ("vector_add", Kernel::Add),
    ("sub", Kernel::Sub),
    ("mul", Kernel::Mul),
    ("div", Kernel::Div),
    ("maximum", Kernel::Maximum),
    ("minimum", Kernel::Minimum),
    ("pow", Kernel::Pow),
    ("cast", Kernel::Cast),
    ("contiguous", Kernel::Contiguous),
    ("transpose", Kernel::Transpose),
    ("softmax", Kernel::Softmax),
    ("log_softmax", Kernel::LogSoftmax),
    ("sum", Kernel::Sum),
    ("mean", Kernel::Mean),
    ("max", Kernel::Max),
    ("min", Kernel::Min),
    ("argmax", Kernel::ArgMax),
    ("layer_norm", Kernel::LayerNorm),
    ("rms_norm", Kernel::RmsNorm),
    ("embedding_bag", Kernel::EmbeddingBag),
    ("gelu", Kernel::Gelu),
    ("axpy", Kernel::Axpy),
    ("matmul", Kernel::Matmul),
    ("neg", Kernel::Unary("neg")),
    ("abs", Kernel::Unary("abs")),
    ("exp", Kernel::Unary("exp")),
    ("log", Kernel::Unary("log")),
    ("sqrt", Kernel::Unary("sqrt")),
    ("relu", Kernel::Unary("relu")),
    ("sigmoid", Kernel::Unary("sigmoid")),
    ("tanh", Kernel::Unary("tanh")),
    ("silu", Kernel::Unary("silu")),
];

/// Registers every Ascend kernel with the operator library.
pub fn register() {
    for (name, kernel) in &KERNELS {
        opbridge_ops::device::register(DeviceKind::Ascend, name, kernel);
    }
}

/// The operator's input `k`, which the schema makes required for these operators.
fn input<'a>(call: &DeviceCall<'a>, k: usize) -> Result<&'a Tensor> {
    call.inputs.get(k).copied().flatten().ok_or_else(|| Error::Device {
        device: call.stream.device(),
        message: format!("{}: input {k} is missing", call.op),
    })
}

impl DeviceKernel for Kernel {
    /// Where CANN's kernel takes fewer dtypes than the host's: no float64 in GeluV2, RmsNorm or
    /// EmbeddingBag (whose indices are int32 / int64).
    fn dtypes(&self) -> Option<&'static [DType]> {
        match self {
            Kernel::Gelu | Kernel::RmsNorm => Some(&[DType::F16, DType::F32]),
            Kernel::EmbeddingBag => Some(&[DType::F16, DType::F32, DType::I32, DType::I64]),
            _ => None,
        }
    }

    fn enqueue(&self, call: &DeviceCall<'_>) -> Result<()> {
        let device = call.stream.device();
        if call.outputs.iter().all(|t| t.numel() == 0) && !matches!(self, Kernel::EmbeddingBag) {
            // Nothing to compute (aclnn refuses some empty shapes); embedding_bag still checks
            // its indices and offsets, as the host does.
            return Ok(());
        }
        let runtime: std::sync::Arc<Runtime> =
            crate::backend().runtime().map_err(|reason| Error::Unavailable { device, reason })?;
        let aclnn: &Aclnn =
            runtime.aclnn().map_err(|reason| Error::Unavailable { device, reason: reason.to_string() })?;
        runtime.bind(device.index)?;
        let missing = |name: &str| Error::Device {
            device,
            message: format!("{}: this CANN installation's aclnn libraries lack {name}", call.op),
        };
        let out = call.outputs[0];
        let stream = call.stream.native_handle();
        let workspace = |bytes: usize| -> Result<Option<opbridge_runtime::Buffer>> {
            Ok(match bytes {
                0 => None,
                n => Some(call.alloc.allocate(n, call.stream.id())?),
            })
        };
        // One aclnn operator on the call's stream: `tensors` (inputs, then the output) are
        // described for phase 1 (or its cached executor is pointed at them).
        let launch =
            |(name, phase2): (&'static str, Phase2),
             tensors: &[&Tensor],
             alpha: Option<opbridge_runtime::DType>,
             extra: i64,
             phase1: &mut dyn FnMut(&[*mut AclTensor], *mut AclScalar, WorkspaceOut) -> AclStatus| {
                let op = OpCall { name, phase2, tensors, alpha, extra, repeatable: !self.one_shot() };
                aclnn.launch(&runtime, device, &op, stream, phase1, workspace)
            };
        match self {
            Kernel::Add | Kernel::Sub => {
                let (op, name) =
                    if matches!(self, Kernel::Add) { (aclnn.add, "aclnnAdd") } else { (aclnn.sub, "aclnnSub") };
                let op = op.ok_or_else(|| missing(name))?;
                let tensors = [input(call, 0)?, input(call, 1)?, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_add.h.
                launch((op.name, op.phase2), &tensors, Some(out.dtype()), 0, &mut |t, alpha, (size, exec)| unsafe {
                    (op.phase1)(t[0], t[1], alpha, t[2], size, exec)
                })
            }
            Kernel::Mul | Kernel::Div | Kernel::Maximum | Kernel::Minimum | Kernel::Pow => {
                let (op, name) = match self {
                    Kernel::Mul => (aclnn.mul, "aclnnMul"),
                    Kernel::Div => (aclnn.div, "aclnnDiv"),
                    Kernel::Maximum => (aclnn.maximum, "aclnnMaximum"),
                    Kernel::Minimum => (aclnn.minimum, "aclnnMinimum"),
                    _ => (aclnn.pow, "aclnnPowTensorTensor"),
                };
                let op = op.ok_or_else(|| missing(name))?;
                let tensors = [input(call, 0)?, input(call, 1)?, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_mul.h & co.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], t[1], t[2], size, exec)
                })
            }
            Kernel::Cast => {
                let op = aclnn.cast.ok_or_else(|| missing("aclnnCast"))?;
                let dtype = acl_dtype(out.dtype());
                let tensors = [input(call, 0)?, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_cast.h.
                launch((op.name, op.phase2), &tensors, None, i64::from(dtype), &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], dtype, t[1], size, exec)
                })
            }
            Kernel::Contiguous => {
                let op = aclnn.copy.ok_or_else(|| missing("aclnnInplaceCopy"))?;
                let tensors = [input(call, 0)?, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_copy.h
                // (the destination first).
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[1], t[0], size, exec)
                })
            }
            Kernel::Unary(name) => {
                let op = aclnn.unary.iter().find(|(n, _)| n == name).map(|(_, op)| *op);
                let op = op.ok_or_else(|| missing(&format!("the aclnn operator of {name}")))?;
                let tensors = [input(call, 0)?, out];
                // SAFETY: live descriptors and out-pointers, the unary prototype of aclnn_exp.h & co.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], t[1], size, exec)
                })
            }
            Kernel::Transpose => {
                let op = aclnn.copy.ok_or_else(|| missing("aclnnInplaceCopy"))?;
                let x = input(call, 0)?;
                let permuted = permuted_view(x, call)?;
                let tensors = [&permuted, out];
                // SAFETY: as for `Contiguous`: the permuted view is the source.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[1], t[0], size, exec)
                })
            }
            Kernel::Softmax | Kernel::LogSoftmax => {
                let (op, name) = match self {
                    Kernel::Softmax => (aclnn.softmax, "aclnnSoftmax"),
                    _ => (aclnn.log_softmax, "aclnnLogSoftmax"),
                };
                let op = op.ok_or_else(|| missing(name))?;
                let mut dim = call.attrs.int("axis").map_err(attr_error(call))?;
                let x = input(call, 0)?;
                // A 0-d input is its one element along a 1-D axis (aclnn takes no 0-d softmax):
                // the same result as the host's.
                let (x1, out1);
                let (x, out) = if x.shape().is_empty() {
                    let one = |t: &Tensor| {
                        Tensor::from_storage(
                            std::sync::Arc::clone(t.storage()),
                            t.device(),
                            t.dtype(),
                            vec![1],
                            Some(vec![1]),
                            t.byte_offset(),
                        )
                    };
                    (x1, out1) = (one(x)?, one(out)?);
                    dim = 0;
                    (&x1, &out1)
                } else {
                    (x, out)
                };
                let tensors = [x, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_softmax.h.
                launch((op.name, op.phase2), &tensors, None, dim, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], dim, t[1], size, exec)
                })
            }
            Kernel::Sum | Kernel::Mean | Kernel::Max | Kernel::Min => {
                let x = input(call, 0)?;
                let dims: Vec<i64> = match call.attrs.opt_int("axis").map_err(attr_error(call))? {
                    Some(axis) => vec![axis],
                    None => (0..x.shape().len() as i64).collect(),
                };
                let keep = call.attrs.bool("keepdims").map_err(attr_error(call))?;
                let dims = aclnn.int_array(&dims).ok_or_else(|| missing("aclCreateIntArray"))?;
                let tensors = [x, out];
                match self {
                    Kernel::Sum | Kernel::Mean => {
                        let (op, name) = match self {
                            Kernel::Sum => (aclnn.reduce_sum, "aclnnReduceSum"),
                            _ => (aclnn.mean, "aclnnMean"),
                        };
                        let op = op.ok_or_else(|| missing(name))?;
                        let dtype = acl_dtype(out.dtype());
                        // SAFETY: live descriptors, int array and out-pointers, the prototypes of
                        // aclnn_reduce_sum.h / aclnn_mean.h.
                        launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                            (op.phase1)(t[0], dims.raw(), keep, dtype, t[1], size, exec)
                        })
                    }
                    _ => {
                        let (op, name) = match self {
                            Kernel::Max => (aclnn.amax, "aclnnAmax"),
                            _ => (aclnn.amin, "aclnnAmin"),
                        };
                        let op = op.ok_or_else(|| missing(name))?;
                        // SAFETY: as above, the prototypes of aclnn_amax.h / aclnn_amin.h.
                        launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                            (op.phase1)(t[0], dims.raw(), keep, t[1], size, exec)
                        })
                    }
                }
            }
            Kernel::ArgMax => {
                let op = aclnn.argmax.ok_or_else(|| missing("aclnnArgMax"))?;
                let x = input(call, 0)?;
                let (flat, dim);
                let source = match call.attrs.opt_int("axis").map_err(attr_error(call))? {
                    Some(axis) => {
                        dim = axis;
                        x
                    }
                    // numpy's flat index: the input seen as one dimension.
                    None => {
                        if !x.is_contiguous() {
                            return Err(Error::Device {
                                device,
                                message: format!(
                                    "{}: over all axes on ascend needs a contiguous input (call contiguous first)",
                                    call.op
                                ),
                            });
                        }
                        flat = Tensor::from_storage(
                            std::sync::Arc::clone(x.storage()),
                            x.device(),
                            x.dtype(),
                            vec![x.numel()],
                            None,
                            x.byte_offset(),
                        )?;
                        dim = 0;
                        &flat
                    }
                };
                let tensors = [source, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_argmax.h.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], dim, false, t[1], size, exec)
                })
            }
            Kernel::LayerNorm => {
                let op = aclnn.layer_norm.ok_or_else(|| missing("aclnnLayerNorm"))?;
                let x = input(call, 0)?;
                let last = x.shape().last().copied().unwrap_or(1) as i64;
                let normalized = aclnn.int_array(&[last]).ok_or_else(|| missing("aclCreateIntArray"))?;
                let eps = call.attrs.float("eps").map_err(attr_error(call))?;
                let (weight, bias) = (call.inputs.get(1).copied().flatten(), call.inputs.get(2).copied().flatten());
                // Descriptors for what is given: x, weight?, bias?, out.
                let mut tensors: Vec<&Tensor> = vec![x];
                tensors.extend(weight);
                tensors.extend(bias);
                tensors.push(out);
                let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
                // SAFETY: live descriptors, int array and out-pointers, the prototype of
                // aclnn_layer_norm.h; absent optional tensors and outputs are null.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    let mut next = 1;
                    let mut optional = |given: bool| {
                        if given {
                            next += 1;
                            t[next - 1]
                        } else {
                            std::ptr::null_mut()
                        }
                    };
                    let (w, b) = (optional(has_weight), optional(has_bias));
                    let o = t[t.len() - 1];
                    (op.phase1)(
                        t[0],
                        normalized.raw(),
                        w,
                        b,
                        eps,
                        o,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        size,
                        exec,
                    )
                })
            }
            Kernel::RmsNorm => {
                let op = aclnn.rms_norm.ok_or_else(|| missing("aclnnRmsNorm"))?;
                let x = input(call, 0)?;
                let eps = call.attrs.float("eps").map_err(attr_error(call))?;
                let last = x.shape().last().copied().unwrap_or(1);
                // gamma: the weight, or ones (aclnnRmsNorm has no optional gamma), uploaded on
                // the stream from pinned memory; freed with this call, in stream order.
                let ones;
                let gamma = match call.inputs.get(1).copied().flatten() {
                    Some(weight) => weight,
                    None => {
                        ones = Tensor::empty_in(call.alloc, &[last], x.dtype(), call.stream.id())?;
                        ones.upload_async(call.stream, &ones_bytes(x.dtype(), last))?;
                        &ones
                    }
                };
                // rstdOut: float32, x's leading dims and 1 for the normalized one (scratch).
                let mut rstd_shape = x.shape().to_vec();
                if let Some(d) = rstd_shape.last_mut() {
                    *d = 1;
                }
                let rstd = Tensor::empty_in(call.alloc, &rstd_shape, opbridge_runtime::DType::F32, call.stream.id())?;
                let tensors = [x, gamma, out, &rstd];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_rms_norm.h.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], t[1], eps, t[2], t[3], size, exec)
                })
            }
            Kernel::EmbeddingBag => {
                let op = aclnn.embedding_bag.ok_or_else(|| missing("aclnnEmbeddingBag"))?;
                let (weight, indices, offsets) = (input(call, 0)?, input(call, 1)?, input(call, 2)?);
                let mode: i64 = match call.attrs.str("mode").map_err(attr_error(call))? {
                    "mean" => 1,
                    "max" => 2,
                    _ => 0, // "sum" (the planning refused anything else)
                };
                // The kernel's other outputs, which opbridge's operator does not return: scratch,
                // in the indices' dtype, freed with this call in stream order.
                let (bags, dim) = (offsets.shape()[0], weight.shape()[1]);
                let scratch = |shape: &[usize]| Tensor::empty_in(call.alloc, shape, indices.dtype(), call.stream.id());
                let offset2bag = scratch(&[indices.shape()[0]])?;
                let bag_size = scratch(&[bags])?;
                let max_indices = if mode == 2 { scratch(&[bags, dim])? } else { scratch(&[bags])? };
                let tensors = [weight, indices, offsets, out, &offset2bag, &bag_size, &max_indices];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_embedding_bag.h
                // (no per-sample weights: null; paddingIdx -1: none, as ATen says).
                launch((op.name, op.phase2), &tensors, None, mode, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(
                        t[0],
                        t[1],
                        t[2],
                        false,
                        mode,
                        false,
                        std::ptr::null(),
                        false,
                        -1,
                        t[3],
                        t[4],
                        t[5],
                        t[6],
                        size,
                        exec,
                    )
                })
            }
            Kernel::Gelu => {
                let op = aclnn.gelu.ok_or_else(|| missing("aclnnGeluV2"))?;
                let approximate = match call.attrs.str("approximate").map_err(attr_error(call))? {
                    "tanh" => 1,
                    _ => 0, // "none" (the planning refused anything else)
                };
                let tensors = [input(call, 0)?, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_gelu_v2.h.
                launch((op.name, op.phase2), &tensors, None, approximate, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], approximate, t[1], size, exec)
                })
            }
            Kernel::Axpy => {
                let op = aclnn.add.ok_or_else(|| missing("aclnnAdd"))?;
                let alpha = call.attrs.float("alpha").map_err(attr_error(call))?;
                // float16 keeps alpha in float32, as the host kernel does (a float16 alpha would
                // flush 1e-8 to zero and overflow 1e5).
                let scalar_dtype = match out.dtype() {
                    opbridge_runtime::DType::F16 => opbridge_runtime::DType::F32,
                    dtype => dtype,
                };
                let alpha = aclnn.scalar(alpha, scalar_dtype);
                let tensors = [input(call, 1)?, input(call, 0)?, out]; // y + alpha * x
                                                                       // SAFETY: live descriptors, scalar and out-pointers, the prototype of aclnn_add.h.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], t[1], alpha.raw(), t[2], size, exec)
                })
            }
            Kernel::Matmul => {
                let op = aclnn.matmul.ok_or_else(|| missing("aclnnMatmul"))?;
                let tensors = [input(call, 0)?, input(call, 1)?, out];
                // SAFETY: live descriptors and out-pointers, the prototype of aclnn_matmul.h;
                // cubeMathType 0 = KEEP_DTYPE.
                launch((op.name, op.phase2), &tensors, None, 0, &mut |t, _, (size, exec)| unsafe {
                    (op.phase1)(t[0], t[1], t[2], 0, size, exec)
                })
            }
        }
    }
}

impl Kernel {
    /// Calls whose executor is not kept for reuse: copies from a view (CANN does not repeat
    /// in-place copies); reductions, layer norm and axpy, whose int array or alpha scalar is
    /// only guaranteed to the call that passes it (and whose optional tensors would shift the
    /// address setters' indices); rms_norm and embedding_bag, which have several outputs (the
    /// reuse path re-points one) and scratch tensors of their own.
    fn one_shot(&self) -> bool {
        matches!(
            self,
            Kernel::Contiguous
                | Kernel::Transpose
                | Kernel::Sum
                | Kernel::Mean
                | Kernel::Max
                | Kernel::Min
                | Kernel::ArgMax
                | Kernel::LayerNorm
                | Kernel::RmsNorm
                | Kernel::EmbeddingBag
                | Kernel::Axpy
        )
    }
}

/// `n` ones of a floating `dtype`, as bytes (a default gamma).
fn ones_bytes(dtype: opbridge_runtime::DType, n: usize) -> Vec<u8> {
    let one: Vec<u8> = match dtype {
        opbridge_runtime::DType::F16 => half::f16::ONE.to_le_bytes().to_vec(),
        opbridge_runtime::DType::F64 => 1f64.to_le_bytes().to_vec(),
        _ => 1f32.to_le_bytes().to_vec(),
    };
    one.repeat(n)
}

/// An attribute the operator's schema guarantees, mistyped: a device error naming the op.
fn attr_error<'a>(call: &'a DeviceCall<'_>) -> impl Fn(opbridge_ops::OpError) -> Error + 'a {
    move |e| Error::Device { device: call.stream.device(), message: format!("{}: {e}", call.op) }
}

/// `x` seen with its axes permuted by the call's `axes` (default reversed; checked by the
/// operator's planning), over the same storage: what `transpose` copies out contiguously.
fn permuted_view(x: &Tensor, call: &DeviceCall<'_>) -> Result<Tensor> {
    let ndim = x.shape().len();
    let perm: Vec<usize> = match call.attrs.get("axes") {
        Some(opbridge_ops::AttrValue::Ints(axes)) => {
            axes.iter().map(|&a| if a < 0 { (a + ndim as i64) as usize } else { a as usize }).collect()
        }
        _ => (0..ndim).rev().collect(),
    };
    if perm.len() != ndim || perm.iter().any(|&a| a >= ndim) {
        return Err(Error::Device {
            device: call.stream.device(),
            message: format!("{}: axes {perm:?} are not a permutation of {ndim} axes", call.op),
        });
    }
    Tensor::from_storage(
        std::sync::Arc::clone(x.storage()),
        x.device(),
        x.dtype(),
        perm.iter().map(|&a| x.shape()[a]).collect(),
        Some(perm.iter().map(|&a| x.strides()[a]).collect()),
        x.byte_offset(),
    )
}
