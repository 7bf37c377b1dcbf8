//! The built-in operators on Ascend, each through the aclnn operator CANN provides for it:
//!
//! | opbridge op | aclnn operator |
//! |---|---|
//! | `add`, `vector_add` | `aclnnAdd` (alpha = 1) |
//! | `sub` | `aclnnSub` (alpha = 1) |
//! | `mul`, `div`, `maximum`, `minimum` | `aclnnMul`, `aclnnDiv`, `aclnnMaximum`, `aclnnMinimum` |
//! | `pow` | `aclnnPowTensorTensor` |
//! | `cast` | `aclnnCast` |
//! | `contiguous` | `aclnnInplaceCopy` (a strided source into a contiguous output) |
//! | `matmul` | `aclnnMatmul` (`cubeMathType` = KEEP_DTYPE: no silent precision loss) |
//!
//! Broadcasting and strided inputs are described to aclnn as they are (view shape, strides and
//! offset over the storage), never expanded first.
#![allow(unsafe_code)]

use opbridge_ops::device::{DeviceCall, DeviceKernel};
use opbridge_runtime::{DeviceKind, Error, Result, Tensor};

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
    Matmul,
}

/// Our operator names and their kernels.
const KERNELS: [(&str, Kernel); 11] = [
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
    ("matmul", Kernel::Matmul),
];

/// Registers every Ascend kernel with the operator library.
pub fn register() {
    static ALL: [Kernel; 10] = [
        Kernel::Add,
        Kernel::Sub,
        Kernel::Mul,
        Kernel::Div,
        Kernel::Maximum,
        Kernel::Minimum,
        Kernel::Pow,
        Kernel::Cast,
        Kernel::Contiguous,
        Kernel::Matmul,
    ];
    for (name, kernel) in KERNELS {
        let registered: &'static Kernel =
            ALL.iter().find(|k| std::mem::discriminant(*k) == std::mem::discriminant(&kernel)).expect("listed");
        opbridge_ops::device::register(DeviceKind::Ascend, name, registered);
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
    fn enqueue(&self, call: &DeviceCall<'_>) -> Result<()> {
        let device = call.stream.device();
        if call.outputs.iter().all(|t| t.numel() == 0) {
            return Ok(()); // nothing to compute (aclnn refuses some empty shapes)
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
                let op =
                    OpCall { name, phase2, tensors, alpha, extra, repeatable: !matches!(self, Kernel::Contiguous) };
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
