//! The one operator call path below every front end (the Python bindings today, the server
//! next): no PyO3, no tokio.
//!
//! - [`plan`]: dtypes and shapes only — what each input is converted to and what the outputs
//!   are (the operator's input-dtype rule and shape function, memoized). Enough for server
//!   metadata and request validation.
//! - [`run_host`]: a planned call, synchronously, on host memory the caller owns (the numpy
//!   path): checks the outputs against the plan and each other, then runs the CPU kernel.
//! - [`launch`]: tensors in, tensors out, enqueued on a stream; new outputs, conversions and
//!   outputs computed aside come from the caller's [`Allocate`] (the device pool, or a
//!   session's child pool whose quota then covers them). Kernel failures stay typed: the
//!   stream's error keeps the `OpError` as its cause.
//!
//! The caller binds arguments (attributes by the schema), keeps the memory of host views alive
//! for the call, and turns results into its own values.
#![allow(unsafe_code)] // the conversion and copy kernels run on views of stream-ordered blocks.

use std::sync::Arc;

use opbridge_runtime::profiler::{self, Arg};
use opbridge_runtime::{Allocate, DType, DeviceId, Stream, StreamId, Tensor};

use crate::cpu::cast;
use crate::error::{OpError, Result};
use crate::registry::Entry;
use crate::schema::{Attrs, Meta};
use crate::view::{overlap, Overlap, TensorView};

type Few<T> = smallvec::SmallVec<[T; 4]>;

/// What a call will do, from the inputs' dtypes and shapes alone.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The dtype each present input has when the kernel runs (the caller converts, once).
    pub inputs: Vec<Option<DType>>,
    /// The outputs' dtypes and shapes.
    pub outputs: Vec<Meta>,
}

/// Checks the inputs against the schema (presence, dtypes) and runs the operator's input-dtype
/// rule and shape function.
pub fn plan(entry: &Entry, inputs: &[Option<Meta>], attrs: &Attrs) -> Result<Plan> {
    let schema = entry.schema();
    if inputs.len() != schema.inputs.len() {
        return Err(OpError::Argument {
            op: schema.name.as_str().into(),
            message: format!("expected {} inputs, got {}", schema.inputs.len(), inputs.len()),
        });
    }
    for (spec, meta) in schema.inputs.iter().zip(inputs) {
        match meta {
            None if !spec.optional => {
                return Err(OpError::Argument {
                    op: schema.name.as_str().into(),
                    message: format!("missing required input {:?}", spec.name),
                })
            }
            Some(meta) if !schema.dtypes.contains(&meta.dtype) => {
                let names: Vec<&str> = schema.dtypes.iter().map(|d| d.name()).collect();
                return Err(OpError::DType {
                    op: schema.name.as_str().into(),
                    expected: format!("{} of dtype {}", spec.name, names.join(", ")),
                    got: meta.dtype.to_string(),
                });
            }
            _ => {}
        }
    }
    Ok(Plan { inputs: entry.op.input_dtypes(inputs, attrs)?, outputs: entry.op.infer(inputs, attrs)? })
}

/// Checks a caller-given output against the plan: its shape, its dtype, and a contiguous layout
/// (kernels write outputs densely).
pub fn check_output(entry: &Entry, meta: &Meta, out: &TensorView) -> Result<()> {
    let op = || -> Arc<str> { entry.schema().name.as_str().into() };
    if out.shape.as_slice() != meta.shape.as_slice() {
        return Err(OpError::Shape {
            op: op(),
            expected: format!("out of shape {:?}", meta.shape),
            got: format!("{:?}", out.shape.as_slice()),
        });
    }
    if out.dtype != meta.dtype {
        return Err(OpError::DType {
            op: op(),
            expected: format!("out of dtype {}", meta.dtype),
            got: out.dtype.to_string(),
        });
    }
    if !out.is_contiguous() {
        return Err(OpError::Argument { op: op(), message: "expected a contiguous out".into() });
    }
    Ok(())
}

/// Whether an output must be computed aside and copied in afterwards: it overlaps an input,
/// other than as an exact alias of an operator that may work in place.
pub fn overlaps_inputs(entry: &Entry, inputs: &[Option<TensorView>], out: &TensorView) -> bool {
    let span = out.byte_span();
    inputs
        .iter()
        .flatten()
        .any(|v| overlap(v.byte_span(), span) != Overlap::Disjoint && !(entry.op.in_place_ok() && v == out))
}

/// Kernels write every output at once: two outputs sharing memory would be a data race.
fn check_outputs_disjoint(entry: &Entry, outputs: &[TensorView]) -> Result<()> {
    for (i, a) in outputs.iter().enumerate() {
        for b in &outputs[i + 1..] {
            if overlap(a.byte_span(), b.byte_span()) != Overlap::Disjoint {
                return Err(OpError::Argument {
                    op: entry.schema().name.as_str().into(),
                    message: "out arrays must not overlap each other".into(),
                });
            }
        }
    }
    Ok(())
}

/// A workspace the allocator refused: out of memory naming the operator and the size, or the
/// allocator's own error when it is not about memory.
fn workspace_error(entry: &Entry, bytes: usize, error: opbridge_runtime::Error) -> OpError {
    match error.kind() {
        opbridge_runtime::ErrorKind::OutOfMemory => {
            OpError::Workspace { op: entry.schema().name.as_str().into(), bytes, reason: error.to_string() }
        }
        _ => error.into(),
    }
}

/// A profiled call's arguments: the operator's version, where it runs, and (when the profile
/// records shapes) its inputs' shapes and dtypes.
fn call_args<'a>(
    entry: &Entry,
    inputs: impl Iterator<Item = Option<(DType, &'a [usize])>>,
    device: DeviceId,
    stream: StreamId,
) -> Vec<(&'static str, Arg)> {
    let mut args = vec![
        ("version", entry.schema().version.into()),
        ("device", device.into()),
        ("stream", if stream == StreamId::HOST { "inline".into() } else { stream.0.into() }),
    ];
    if profiler::record_shapes() {
        let (mut shapes, mut dtypes) = (Vec::new(), Vec::new());
        for input in inputs {
            match input {
                Some((dtype, shape)) => {
                    shapes.push(format!("{shape:?}"));
                    dtypes.push(dtype.name());
                }
                None => {
                    shapes.push("None".into());
                    dtypes.push("None");
                }
            }
        }
        args.push(("input_shapes", format!("[{}]", shapes.join(", ")).into()));
        args.push(("input_dtypes", dtypes.join(", ").into()));
    }
    args
}

/// An operator call's span in an active profile (None, at the cost of one atomic load, when no
/// profile is recording). Front ends that run a kernel without this module (the bindings' fast
/// lanes), or convert the caller's inputs before calling it, open it themselves with the
/// caller's inputs; the span this module would open is then not opened again.
pub fn call_span<'a>(
    entry: &Entry,
    inputs: impl Iterator<Item = Option<(DType, &'a [usize])>>,
    device: DeviceId,
    stream: StreamId,
) -> Option<profiler::Span> {
    if !profiler::active() || profiler::in_call() {
        return None;
    }
    Some(profiler::Span::begin("op", &entry.schema().name, 0, call_args(entry, inputs, device, stream)))
}

/// The outputs of a host call, with what the caller knows of them.
#[derive(Debug, Clone, Copy)]
pub enum HostOutputs<'a> {
    /// Allocated by the caller for this call, from the plan's metas: new memory, which overlaps
    /// no input and no other output (only their metas are checked again).
    New(&'a [TensorView]),
    /// Any other outputs (a caller's `out=`): checked against the plan, the inputs and each
    /// other.
    Given(&'a [TensorView]),
}

/// Runs a planned call synchronously on host memory (the numpy path).
///
/// `inputs` must have the plan's dtypes (any strides); `outputs` the plan's metas, contiguous,
/// disjoint from each other and from the inputs (or exact aliases where the operator works in
/// place: see [`overlaps_inputs`]). As for every view, the caller keeps the memory alive and
/// unaliased by other writers until this returns. A kernel's scratch memory comes from
/// `scratch` (a host-accessible allocator: the CPU pool, whose limit then covers it, or a
/// session's child pool).
pub fn run_host(
    entry: &Entry,
    attrs: &Attrs,
    plan: &Plan,
    inputs: &[Option<TensorView>],
    outputs: HostOutputs<'_>,
    scratch: &dyn Allocate,
) -> Result<()> {
    let (outputs, new) = match outputs {
        HostOutputs::New(views) => (views, true),
        HostOutputs::Given(views) => (views, false),
    };
    let misplanned = |what: String| OpError::Argument { op: entry.schema().name.as_str().into(), message: what };
    if inputs.len() != plan.inputs.len() || outputs.len() != plan.outputs.len() {
        return Err(misplanned(format!(
            "the call has {} inputs and {} outputs, its plan {} and {}",
            inputs.len(),
            outputs.len(),
            plan.inputs.len(),
            plan.outputs.len()
        )));
    }
    for (view, dtype) in inputs.iter().zip(&plan.inputs) {
        if view.as_ref().map(|v| v.dtype) != *dtype {
            return Err(misplanned(format!("an input is not of its planned dtype {dtype:?}")));
        }
    }
    for (meta, out) in plan.outputs.iter().zip(outputs) {
        check_output(entry, meta, out)?;
        if !new && overlaps_inputs(entry, inputs, out) {
            return Err(misplanned("an output overlaps an input: compute it aside".into()));
        }
    }
    if !new {
        check_outputs_disjoint(entry, outputs)?;
    }
    // The numpy path runs the kernel right here: its host time is its device time.
    let _span = call_span(
        entry,
        inputs.iter().map(|v| v.as_ref().map(|v| (v.dtype, &v.shape[..]))),
        DeviceId::CPU,
        StreamId::HOST,
    );
    let _call = entry.enter_scoped();
    if !entry.op.needs_workspace() {
        return entry.op.run_cpu_in(inputs, outputs, attrs, &mut []);
    }
    let metas: smallvec::SmallVec<[Option<Meta>; 4]> =
        inputs.iter().map(|v| v.as_ref().map(|v| Meta::new(v.dtype, &v.shape))).collect();
    let bytes = entry.op.workspace_size(&metas, attrs)?;
    if bytes == 0 {
        return entry.op.run_cpu_in(inputs, outputs, attrs, &mut []);
    }
    if scratch.device() != DeviceId::CPU {
        return Err(misplanned(format!(
            "scratch memory must be host memory, got an allocator on {}",
            scratch.device()
        )));
    }
    let block = scratch.allocate(bytes, StreamId::HOST).map_err(|e| workspace_error(entry, bytes, e))?;
    // SAFETY: a live block of at least `bytes` bytes of host memory (checked: the CPU device),
    // owned here and used by nothing else until it is dropped below; zeroed first, so the
    // kernel's `&mut [u8]` covers initialized bytes.
    let workspace = unsafe {
        std::ptr::write_bytes(block.ptr().0 as *mut u8, 0, bytes);
        std::slice::from_raw_parts_mut(block.ptr().0 as *mut u8, bytes)
    };
    let ran = entry.op.run_cpu_in(inputs, outputs, attrs, workspace);
    drop(block);
    ran
}

/// Enqueues a call on `stream`: tensors in, tensors out.
///
/// Every tensor must be on the stream's device, and the operator must have a kernel for it.
/// Inputs of another dtype than the plan's are converted (one copy, from `alloc`); strided
/// inputs are read in place. Without `out`, outputs are new tensors from `alloc`; with it, the
/// given tensors are written (an output that overlaps an input is computed aside, from
/// `alloc`, and copied in). Returns the outputs: new, or `out`'s. The call counts as in flight
/// for [`Entry::wait_idle`] until its kernel has run.
pub fn launch(
    entry: &Arc<Entry>,
    attrs: &Attrs,
    inputs: &[Option<Arc<Tensor>>],
    out: Option<&[Arc<Tensor>]>,
    stream: &Stream,
    alloc: &dyn Allocate,
) -> Result<Vec<Arc<Tensor>>> {
    let kernel = check_launch(entry, inputs, out, stream, alloc)?;
    let _span = launch_span(entry, inputs, stream);
    let metas: Few<Option<Meta>> = inputs.iter().map(|t| t.as_ref().map(|t| Meta::new(t.dtype(), t.shape()))).collect();
    let plan = plan(entry, &metas, attrs)?;
    launch_checked(entry, kernel, &plan, attrs, inputs, out, stream, alloc)
}

/// [`launch`] with the call's plan already made by the caller from these inputs' metas (the
/// bindings plan before they choose a device, and need not plan twice).
pub fn launch_planned(
    entry: &Arc<Entry>,
    plan: &Plan,
    attrs: &Attrs,
    inputs: &[Option<Arc<Tensor>>],
    out: Option<&[Arc<Tensor>]>,
    stream: &Stream,
    alloc: &dyn Allocate,
) -> Result<Vec<Arc<Tensor>>> {
    if inputs.len() != plan.inputs.len() || inputs.len() != entry.schema().inputs.len() {
        return Err(OpError::Argument {
            op: entry.schema().name.as_str().into(),
            message: format!("a plan for {} inputs, given {}", plan.inputs.len(), inputs.len()),
        });
    }
    let kernel = check_launch(entry, inputs, out, stream, alloc)?;
    let _span = launch_span(entry, inputs, stream);
    launch_checked(entry, kernel, plan, attrs, inputs, out, stream, alloc)
}

/// The profiler's span of a launch (none when it is off or inside a call already profiled).
fn launch_span(entry: &Entry, inputs: &[Option<Arc<Tensor>>], stream: &Stream) -> Option<profiler::Span> {
    call_span(entry, inputs.iter().map(|t| t.as_ref().map(|t| (t.dtype(), t.shape()))), stream.device(), stream.id())
}

/// What every launch checks first: the tensors and the allocator on the stream's device, and a
/// kernel for it (the operator's device kernel, or `None` for a host kernel on the CPU).
fn check_launch<'e>(
    entry: &'e Entry,
    inputs: &[Option<Arc<Tensor>>],
    out: Option<&[Arc<Tensor>]>,
    stream: &Stream,
    alloc: &dyn Allocate,
) -> Result<Option<&'e dyn crate::device::DeviceKernel>> {
    let schema = entry.schema();
    let op = || -> Arc<str> { schema.name.as_str().into() };
    let device = stream.device();
    let tensors = inputs.iter().flatten().chain(out.into_iter().flatten());
    if let Some(t) = tensors.clone().find(|t| t.device() != device) {
        return Err(OpError::Device {
            op: op(),
            message: format!("expected all tensors on {device} (the stream's device), got one on {}", t.device()),
        });
    }
    if alloc.device() != device {
        return Err(OpError::Device {
            op: op(),
            message: format!("outputs would come from {}, but the call runs on {device}", alloc.device()),
        });
    }
    let kernel = entry.device_kernel(device.kind);
    if kernel.is_none() && !entry.op.devices().contains(&device.kind) {
        let names: Vec<&str> = entry.devices().iter().map(|d| d.name()).collect();
        return Err(OpError::Device {
            op: op(),
            message: format!(
                "no {} kernel for {} v{}; it has kernels for: {}",
                device.kind.name(),
                schema.name,
                schema.version,
                names.join(", ")
            ),
        });
    }
    Ok(kernel)
}

/// A checked launch with its plan: on the device kernel, or the host kernel in stream order.
#[allow(clippy::too_many_arguments)]
fn launch_checked(
    entry: &Arc<Entry>,
    kernel: Option<&dyn crate::device::DeviceKernel>,
    plan: &Plan,
    attrs: &Attrs,
    inputs: &[Option<Arc<Tensor>>],
    out: Option<&[Arc<Tensor>]>,
    stream: &Stream,
    alloc: &dyn Allocate,
) -> Result<Vec<Arc<Tensor>>> {
    let schema = entry.schema();
    let op = || -> Arc<str> { schema.name.as_str().into() };
    let device = stream.device();
    if let Some(kernel) = kernel {
        return crate::device::launch(entry, kernel, plan, attrs, inputs, out, stream, alloc);
    }
    let mut converted: Vec<Option<Arc<Tensor>>> = Vec::with_capacity(inputs.len());
    for (t, dtype) in inputs.iter().zip(&plan.inputs) {
        converted.push(match (t, dtype) {
            (Some(t), Some(d)) if t.dtype() == *d => Some(Arc::clone(t)),
            (Some(t), Some(d)) => Some(convert(t, *d, stream, alloc)?),
            _ => None,
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
    let mut results: Vec<Arc<Tensor>> = Vec::with_capacity(plan.outputs.len());
    for (k, meta) in plan.outputs.iter().enumerate() {
        results.push(match out {
            Some(given) => {
                check_output(entry, meta, &TensorView::of_tensor(&given[k]))?;
                Arc::clone(&given[k])
            }
            None => Arc::new(Tensor::empty_in(alloc, &meta.shape, meta.dtype, stream.id())?),
        });
    }
    let views: Vec<Option<TensorView>> =
        converted.iter().map(|t| t.as_ref().map(|t| TensorView::of_tensor(t))).collect();
    let mut targets: Vec<Arc<Tensor>> = Vec::with_capacity(results.len());
    for result in &results {
        targets.push(if overlaps_inputs(entry, &views, &TensorView::of_tensor(result)) {
            Arc::new(Tensor::empty_in(alloc, result.shape(), result.dtype(), stream.id())?)
        } else {
            Arc::clone(result)
        });
    }
    let out_views: Vec<TensorView> = targets.iter().map(|t| TensorView::of_tensor(t)).collect();
    check_outputs_disjoint(entry, &out_views)?;
    // Scratch memory comes from the call's allocator too (a session's quota covers it), for
    // the call's stream: stream order makes it free for reuse once the kernel has run.
    let workspace = match entry.op.needs_workspace() {
        false => None,
        true => {
            let metas: Vec<Option<Meta>> =
                converted.iter().map(|t| t.as_ref().map(|t| Meta::new(t.dtype(), t.shape()))).collect();
            match entry.op.workspace_size(&metas, attrs)? {
                0 => None,
                bytes => {
                    Some((alloc.allocate(bytes, stream.id()).map_err(|e| workspace_error(entry, bytes, e))?, bytes))
                }
            }
        }
    };
    let call = entry.enter();
    let attrs = attrs.clone();
    let reads: Vec<&Tensor> = converted.iter().flatten().map(|t| t.as_ref()).collect();
    let writes: Vec<&Tensor> = targets.iter().map(|t| t.as_ref()).collect();
    let tracked = Arc::clone(call.entry());
    // Profiled: the kernel is a span on the stream's track, linked to this call by a flow.
    let flow = profiler::enqueue("kernel", &schema.name);
    let stream_id = stream.id();
    let done = Tensor::launch_event(
        stream,
        &reads,
        &writes,
        Box::new(move || {
            let _kernel = (flow != 0).then(|| {
                let name = &call.entry().schema().name;
                profiler::Span::begin(
                    "kernel",
                    name,
                    flow,
                    vec![("device", device.into()), ("stream", stream_id.0.into())],
                )
            });
            let scratch: &mut [u8] = match &workspace {
                None => &mut [],
                // SAFETY: a live block of at least `bytes` bytes of host-accessible memory (the
                // CPU kernels' device), owned by this closure and used by nothing else; zeroed
                // first, so the kernel's `&mut [u8]` covers initialized bytes.
                Some((block, bytes)) => unsafe {
                    std::ptr::write_bytes(block.ptr().0 as *mut u8, 0, *bytes);
                    std::slice::from_raw_parts_mut(block.ptr().0 as *mut u8, *bytes)
                },
            };
            // The call guard lives until the kernel has run: an unload waits for it.
            let ran = call.entry().op.run_cpu_in(&views, &out_views, &attrs, scratch).map_err(OpError::into_async);
            drop(workspace);
            ran
        }),
    )?;
    // Where the call sits in stream order, for an unload started from stream work.
    tracked.track(done);
    for (result, target) in results.iter().zip(&targets) {
        if !Arc::ptr_eq(result, target) {
            copy_tensor(target, result, stream)?;
        }
    }
    Ok(results)
}

/// A copy of `t` converted to `dtype`, enqueued on `stream` (the one documented copy for an
/// input of another dtype than the kernel's): contiguous, except that broadcast axes (stride 0,
/// length > 1) stay broadcast — only the unique elements are converted and stored, never the
/// logical size of a broadcast view.
fn convert(t: &Arc<Tensor>, dtype: DType, stream: &Stream, alloc: &dyn Allocate) -> Result<Arc<Tensor>> {
    let broadcast: Vec<bool> = t.shape().iter().zip(t.strides()).map(|(&d, &s)| s == 0 && d > 1).collect();
    let unique: Vec<usize> = t.shape().iter().zip(&broadcast).map(|(&d, &b)| if b { 1 } else { d }).collect();
    let block = Tensor::empty_in(alloc, &unique, dtype, stream.id())?;
    let mut src = TensorView::of_tensor(t);
    src.shape = unique.as_slice().into();
    let dst = TensorView::of_tensor(&block);
    let converted = if broadcast.contains(&true) {
        let strides = block.strides().iter().zip(&broadcast).map(|(&s, &b)| if b { 0 } else { s }).collect();
        let storage = Arc::clone(block.storage());
        Tensor::from_storage(storage, block.device(), dtype, t.shape().to_vec(), Some(strides), block.byte_offset())?
    } else {
        block
    };
    Tensor::launch(
        stream,
        &[t],
        &[&converted],
        Box::new(move || {
            // SAFETY: `src` is `t`'s validated layout cut to its unique elements (a sub-view);
            // `dst` is a fresh contiguous block of that shape; stream order keeps both alive and
            // unaliased until this kernel has run.
            unsafe { cast::cast_view(&src, &dst) }.map_err(|error| OpError::cpu_kernel("cast", error).into_async())
        }),
    )?;
    Ok(Arc::new(converted))
}

/// Enqueues a byte copy of contiguous `src` into contiguous `dst` (same size) on `stream`.
fn copy_tensor(src: &Tensor, dst: &Tensor, stream: &Stream) -> Result<()> {
    let (from, to, bytes) = (src.data_ptr(), dst.data_ptr(), src.nbytes());
    Tensor::launch(
        stream,
        &[src],
        &[dst],
        Box::new(move || {
            // SAFETY: both are live contiguous blocks of `bytes` bytes (stream order).
            unsafe { std::ptr::copy(from.0 as *const u8, to.0 as *mut u8, bytes) };
            Ok(())
        }),
    )?;
    Ok(())
}
