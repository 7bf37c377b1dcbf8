//! Kernels of the built-in operators on accelerators. A backend crate (Ascend over aclnn, CUDA
//! later) registers one per operator it covers; [`crate::dispatch::launch`] finds it by the
//! tensors' device kind. A device kernel enqueues its work on the call's stream (the vendor API
//! does the enqueueing, on the submitting thread) and returns: it never runs host code over
//! device memory. Operators of loaded libraries bring their device kernels through the plugin
//! ABI instead; a name match here is for built-ins only.

use std::sync::{Arc, RwLock};

use opbridge_runtime::{Allocate, CallSite, CopyKind, DType, DeviceKind, Launch, Result, Stream, Tensor};

use crate::dispatch::Plan;
use crate::error::OpError;
use crate::registry::Entry;
use crate::schema::Attrs;
use crate::view::TensorView;

/// The few tensors of one call, without a heap allocation.
type Few<T> = smallvec::SmallVec<[T; 4]>;

/// One call handed to a device kernel. Inputs have the dtypes the operator's `input_dtypes`
/// asked for (any strides, on the stream's device); outputs are contiguous, of the inferred
/// shapes and dtypes, and do not overlap the inputs.
#[derive(Debug)]
pub struct DeviceCall<'a> {
    pub op: &'a str,
    pub attrs: &'a Attrs,
    pub inputs: &'a [Option<&'a Tensor>],
    pub outputs: &'a [&'a Tensor],
    pub stream: &'a Stream,
    /// Where scratch memory comes from (the call's allocator, so a session's quota covers
    /// it), allocated for `stream`: it may be freed as soon as the work is enqueued.
    pub alloc: &'a dyn Allocate,
}

/// An operator's kernel on one kind of device.
pub trait DeviceKernel: Send + Sync + 'static {
    /// Enqueues the operator on `call.stream` and returns; failures while it runs are the
    /// stream's, reported at its next synchronize.
    fn enqueue(&self, call: &DeviceCall<'_>) -> Result<()>;

    /// The dtypes the kernel computes in, when fewer than the operator's (CANN's GeluV2 has no
    /// float64): a call with another is refused before anything is enqueued, as a dtype error.
    /// `None`: every dtype of the operator.
    fn dtypes(&self) -> Option<&'static [DType]> {
        None
    }

    /// [`DeviceKernel::enqueue`] with the operator's own error kinds (a plugin kernel's
    /// `OPB_ERR_SHAPE` stays a shape error); by default the runtime's errors become
    /// [`OpError::Device`] (out of memory stays out of memory: the caller may free and retry).
    fn enqueue_call(&self, call: &DeviceCall<'_>) -> crate::Result<()> {
        self.enqueue(call).map_err(|e| match e.kind() {
            opbridge_runtime::ErrorKind::OutOfMemory => OpError::Runtime(e),
            _ => OpError::Device { op: call.op.into(), message: e.to_string() },
        })
    }
}

type Registered = (DeviceKind, &'static str, &'static dyn DeviceKernel);

static KERNELS: RwLock<Vec<Registered>> = RwLock::new(Vec::new());

/// Registers `kernel` as built-in operator `op`'s kernel on `kind` (a later registration for the
/// same pair replaces it).
pub fn register(kind: DeviceKind, op: &'static str, kernel: &'static dyn DeviceKernel) {
    let mut kernels = KERNELS.write().unwrap_or_else(|p| p.into_inner());
    kernels.retain(|(k, name, _)| !(*k == kind && *name == op));
    kernels.push((kind, op, kernel));
}

/// Built-in operator `op`'s kernel on `kind`, if a backend registered one.
pub fn find(kind: DeviceKind, op: &str) -> Option<&'static dyn DeviceKernel> {
    let kernels = KERNELS.read().unwrap_or_else(|p| p.into_inner());
    kernels.iter().find(|(k, name, _)| *k == kind && *name == op).map(|(_, _, kernel)| *kernel)
}

/// The accelerator kinds with a kernel for built-in operator `op`.
pub fn kinds(op: &str) -> Vec<DeviceKind> {
    let kernels = KERNELS.read().unwrap_or_else(|p| p.into_inner());
    let mut kinds: Vec<DeviceKind> = kernels.iter().filter(|(_, name, _)| *name == op).map(|(k, _, _)| *k).collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

/// [`crate::dispatch::launch`] on an accelerator: inputs of another dtype than the kernel's are
/// converted on the device (its `cast` kernel), outputs come from `alloc` (or are the given
/// `out=` tensors), and the kernel is enqueued ordered after earlier work on the same tensors
/// on other streams. With `OPBRIDGE_LAUNCH_BLOCKING=1` every launch is waited for, so a
/// failing kernel is reported by the call that launched it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    entry: &Arc<Entry>,
    kernel: &dyn DeviceKernel,
    plan: &Plan,
    attrs: &Attrs,
    inputs: &[Option<Arc<Tensor>>],
    out: Option<&[Arc<Tensor>]>,
    stream: &Stream,
    alloc: &dyn Allocate,
) -> crate::Result<Vec<Arc<Tensor>>> {
    let schema = entry.schema();
    let op = || -> Arc<str> { schema.name.as_str().into() };
    if let Some(allowed) = kernel.dtypes() {
        if let Some(dtype) = plan.inputs.iter().flatten().find(|d| !allowed.contains(d)) {
            let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
            return Err(OpError::DType {
                op: op(),
                expected: format!("{} on {} (its kernel there)", names.join(", "), stream.device().kind.name()),
                got: dtype.to_string(),
            });
        }
    }
    let mut converted: Few<Option<Arc<Tensor>>> = Few::with_capacity(inputs.len());
    for (t, dtype) in inputs.iter().zip(&plan.inputs) {
        converted.push(match (t, dtype) {
            (Some(t), Some(d)) if t.dtype() != *d => Some(cast_on_device(entry, t, *d, stream, alloc)?),
            (t, _) => t.clone(),
        });
    }
    if let Some(given) = out {
        if given.len() != plan.outputs.len() {
            return Err(OpError::Argument {
                op: op(),
                message: format!("expected {} out tensors, got {}", plan.outputs.len(), given.len()),
            });
        }
    }
    let views: Few<Option<TensorView>> =
        converted.iter().map(|t| t.as_ref().map(|t| TensorView::of_tensor(t))).collect();
    let mut results: Vec<Arc<Tensor>> = Vec::with_capacity(plan.outputs.len());
    let mut targets: Few<Arc<Tensor>> = Few::with_capacity(plan.outputs.len());
    for (k, meta) in plan.outputs.iter().enumerate() {
        let result = match out {
            Some(given) => {
                crate::dispatch::check_output(entry, meta, &TensorView::of_tensor(&given[k]))?;
                Arc::clone(&given[k])
            }
            None => Arc::new(Tensor::empty_in(alloc, &meta.shape, meta.dtype, stream.id())?),
        };
        // An `out=` that overlaps an input is written through a temporary, copied after.
        targets.push(if crate::dispatch::overlaps_inputs(entry, &views, &TensorView::of_tensor(&result)) {
            Arc::new(Tensor::empty_in(alloc, result.shape(), result.dtype(), stream.id())?)
        } else {
            Arc::clone(&result)
        });
        results.push(result);
    }
    let reads: Few<&Tensor> = converted.iter().flatten().map(|t| t.as_ref()).collect();
    let writes: Few<&Tensor> = targets.iter().map(|t| t.as_ref()).collect();
    let call_inputs: Few<Option<&Tensor>> = converted.iter().map(|t| t.as_deref()).collect();
    // The kernel's own error, kept typed past the runtime's ordering code.
    let mut failed: Option<OpError> = None;
    let done = Tensor::enqueue_event(stream, &reads, &writes, |stream| {
        let call = DeviceCall { op: &schema.name, attrs, inputs: &call_inputs, outputs: &writes, stream, alloc };
        kernel.enqueue_call(&call).map_err(|e| {
            let error = opbridge_runtime::Error::Device { device: stream.device(), message: e.to_string() };
            failed = Some(e);
            error
        })
    })
    .map_err(|e| {
        failed.take().unwrap_or_else(|| match e.kind() {
            opbridge_runtime::ErrorKind::OutOfMemory => OpError::Runtime(e),
            _ => OpError::Device { op: op(), message: e.to_string() },
        })
    })?;
    entry.track(done);
    stream.note_launch(Launch { what: entry.label(), site: CALL_SITE.with(|c| c.borrow_mut().take()) });
    for (result, target) in results.iter().zip(&targets) {
        if !Arc::ptr_eq(result, target) {
            let (from, to, bytes) = (target.data_ptr(), result.data_ptr(), target.nbytes());
            Tensor::enqueue_event(stream, &[target], &[result], |s| s.copy(to, from, bytes, CopyKind::DeviceToDevice))?;
        }
    }
    if launch_blocking() {
        stream.synchronize().map_err(|e| OpError::Device {
            op: op(),
            message: format!("{e} (OPBRIDGE_LAUNCH_BLOCKING=1: this launch was waited for)"),
        })?;
    }
    Ok(results)
}

/// A contiguous copy of `t` in `dtype`, made on the device by its `cast` kernel.
fn cast_on_device(
    entry: &Entry,
    t: &Arc<Tensor>,
    dtype: DType,
    stream: &Stream,
    alloc: &dyn Allocate,
) -> crate::Result<Arc<Tensor>> {
    let kind = stream.device().kind;
    let cast = find(kind, "cast").ok_or_else(|| OpError::Device {
        op: entry.schema().name.as_str().into(),
        message: format!(
            "an input of {} needs converting to {dtype}, and {} has no cast kernel",
            t.dtype(),
            kind.name()
        ),
    })?;
    let converted = Tensor::empty_in(alloc, t.shape(), dtype, stream.id())?;
    let attrs = Attrs::default();
    Tensor::enqueue_event(stream, &[t], &[&converted], |stream| {
        cast.enqueue(&DeviceCall {
            op: "cast",
            attrs: &attrs,
            inputs: &[Some(t.as_ref())],
            outputs: &[&converted],
            stream,
            alloc,
        })
    })?;
    Ok(Arc::new(converted))
}

thread_local! {
    /// Where the next launch on this thread comes from (`app.py:12`), set by a front end that
    /// knows (the Python bindings), for the message of an asynchronous failure.
    static CALL_SITE: std::cell::RefCell<Option<CallSite>> = const { std::cell::RefCell::new(None) };
}

/// Names the call site of the next device launch on this thread (taken by that launch).
pub fn set_call_site(site: Option<CallSite>) {
    CALL_SITE.with(|c| *c.borrow_mut() = site);
}

/// `OPBRIDGE_LAUNCH_BLOCKING=1`: wait for every device launch (read once per process).
pub fn launch_blocking() -> bool {
    static BLOCKING: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BLOCKING.get_or_init(|| std::env::var("OPBRIDGE_LAUNCH_BLOCKING").is_ok_and(|v| v == "1"))
}

/// The staged numpy path of an elementwise operator on an accelerator: same-length host inputs
/// (contiguous bytes, already in the kernel's dtypes) go through the device in chunks, the
/// copy-in of one chunk overlapping the kernel of the previous one and the copy-out of the one
/// before (`pipeline::staged_work`); the chunk size comes from the device's measured copy model
/// (`pipeline::chunk_bytes`). `output` receives the result bytes.
pub fn run_staged(
    entry: &Entry,
    ctx: &opbridge_runtime::DeviceContext,
    attrs: &Attrs,
    inputs: &[(&[u8], DType)],
    output: (&mut [u8], DType),
    len: usize,
) -> crate::Result<opbridge_runtime::pipeline::PipelineReport> {
    let schema = entry.schema();
    let device = ctx.id();
    let kernel = entry.device_kernel(device.kind).ok_or_else(|| OpError::Device {
        op: schema.name.as_str().into(),
        message: format!("no {} kernel for {} v{}", device.kind.name(), schema.name, schema.version),
    })?;
    let (out_bytes, out_dtype) = output;
    if let Some(allowed) = kernel.dtypes() {
        if let Some(dtype) = inputs.iter().map(|(_, d)| *d).find(|d| !allowed.contains(d)) {
            let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
            return Err(OpError::DType {
                op: schema.name.as_str().into(),
                expected: format!("{} on {} (its kernel there)", names.join(", "), device.kind.name()),
                got: dtype.to_string(),
            });
        }
    }
    let widest = inputs.iter().map(|(_, d)| d.size()).chain([out_dtype.size()]).max().unwrap_or(1);
    let chunk_elems = (opbridge_runtime::pipeline::chunk_bytes(ctx)? / widest).max(1);
    // A chunk's buffers seen as 1-D tensors of `n` elements (the slots own the memory).
    let view = |ptr: opbridge_runtime::DevicePtr, n: usize, dtype: DType| -> Result<Tensor> {
        let storage = opbridge_runtime::Storage::External { ptr, len: n * dtype.size(), device, owner: Box::new(()) };
        Tensor::from_storage(Arc::new(storage), device, dtype, vec![n], None, 0)
    };
    let work = |stream: &Stream, ins: &[opbridge_runtime::DevicePtr], out: opbridge_runtime::DevicePtr, n: usize| {
        let tensors: Vec<Tensor> = ins.iter().zip(inputs).map(|(&p, (_, d))| view(p, n, *d)).collect::<Result<_>>()?;
        let out = view(out, n, out_dtype)?;
        let call_inputs: Vec<Option<&Tensor>> = tensors.iter().map(Some).collect();
        kernel.enqueue(&DeviceCall {
            op: &schema.name,
            attrs,
            inputs: &call_inputs,
            outputs: &[&out],
            stream,
            alloc: ctx.pool(),
        })
    };
    let bytes: Vec<&[u8]> = inputs.iter().map(|(b, _)| *b).collect();
    let sizes: Vec<usize> = inputs.iter().map(|(_, d)| d.size()).collect();
    opbridge_runtime::pipeline::staged_work(ctx, &bytes, &sizes, out_bytes, out_dtype.size(), len, chunk_elems, &work)
        .map_err(|e| match e.kind() {
            // Out of memory stays out of memory (a server answers 503; the caller may retry).
            opbridge_runtime::ErrorKind::OutOfMemory => OpError::Runtime(e),
            _ => OpError::Device { op: schema.name.as_str().into(), message: e.to_string() },
        })
}
