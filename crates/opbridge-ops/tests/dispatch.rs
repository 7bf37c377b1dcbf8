//! The dispatch layer without any front end: plan (dtypes and shapes), run on host memory (the
//! numpy path), launch on a stream with outputs from a given allocator (device pool or a child
//! pool with a quota), and the error kinds every front end maps. Device tests run on every
//! device the build has (`test_device!`).
#![allow(unsafe_code)] // the tests read device memory of the host-accessible CPU device back.

use std::sync::{Arc, Mutex, MutexGuard};

use opbridge_ops::dispatch::{self, HostOutputs, Plan};
use opbridge_ops::{AttrValue, Attrs, Entry, ErrorKind, Meta, OpError, Registry, TensorView};
use opbridge_runtime::{test_device, Allocate, DType, DeviceContext, Error, Storage, Stream, Tensor};

/// Serializes the tests that read the device pool's counters.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn cpu_pool() -> &'static Arc<opbridge_runtime::MemoryPool> {
    DeviceContext::cpu().pool()
}

fn entry(name: &str, version: Option<u32>) -> Arc<Entry> {
    opbridge_ops::global().get(name, version).unwrap()
}

fn attrs(entry: &Entry, given: &[(&str, AttrValue)]) -> Attrs {
    entry.schema().bind_attrs(given.iter().map(|(n, v)| (*n, v.clone()))).unwrap()
}

fn no_attrs(entry: &Entry) -> Attrs {
    attrs(entry, &[])
}

/// A device tensor holding `values` (float32), written by a host copy on `stream`.
fn tensor_f32(ctx: &DeviceContext, stream: &Stream, shape: &[usize], values: &[f32]) -> Arc<Tensor> {
    let t = Tensor::empty(ctx, shape, DType::F32, stream.id()).unwrap();
    stream.synchronize().unwrap();
    // SAFETY: a fresh contiguous CPU-device block of `values.len()` float32s, idle (the
    // stream it was allocated for is synchronized); nothing else refers to it yet.
    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), t.data_ptr().0 as *mut f32, values.len()) };
    Arc::new(t)
}

/// A device tensor of int64 values.
fn tensor_i64(ctx: &DeviceContext, stream: &Stream, values: &[i64]) -> Arc<Tensor> {
    let t = Tensor::empty(ctx, &[values.len()], DType::I64, stream.id()).unwrap();
    stream.synchronize().unwrap();
    // SAFETY: as in `tensor_f32`, for int64 values.
    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), t.data_ptr().0 as *mut i64, values.len()) };
    Arc::new(t)
}

/// The values of a contiguous tensor after the work writing it (its failure, if any, is the
/// error).
fn read<T: Copy>(t: &Tensor) -> Result<Vec<T>, Error> {
    t.wait_ready()?;
    assert!(t.is_contiguous());
    let n = t.numel();
    let mut out = Vec::with_capacity(n);
    // SAFETY: a contiguous CPU-device tensor of `n` elements of `T`, no longer written (waited
    // for above).
    unsafe {
        std::ptr::copy_nonoverlapping(t.data_ptr().0 as *const T, out.as_mut_ptr(), n);
        out.set_len(n);
    }
    Ok(out)
}

#[test]
fn plan_gives_conversions_and_outputs_without_running() {
    let add = entry("add", None);
    let plan = dispatch::plan(
        &add,
        &[Some(Meta::new(DType::F32, &[3, 1])), Some(Meta::new(DType::F64, &[4]))],
        &no_attrs(&add),
    )
    .unwrap();
    assert_eq!(plan, Plan { inputs: vec![Some(DType::F64); 2], outputs: vec![Meta::new(DType::F64, &[3, 4])] });

    let sum = entry("sum", None);
    let keep = attrs(&sum, &[("axis", AttrValue::Int(0)), ("keepdims", AttrValue::Bool(true))]);
    let plan = dispatch::plan(&sum, &[Some(Meta::new(DType::F32, &[5, 2]))], &keep).unwrap();
    assert_eq!(plan.outputs, vec![Meta::new(DType::F32, &[1, 2])]);
}

#[test]
fn plan_errors_have_the_kind_front_ends_map() {
    let add = entry("add", None);
    let a = no_attrs(&add);
    let shape = dispatch::plan(&add, &[Some(Meta::new(DType::F32, &[3])), Some(Meta::new(DType::F32, &[4]))], &a);
    assert_eq!(shape.unwrap_err().kind(), ErrorKind::Shape);
    let matmul = entry("matmul", Some(1));
    let ints = [Some(Meta::new(DType::I32, &[2, 2])), Some(Meta::new(DType::I32, &[2, 2]))];
    let dtype = dispatch::plan(&matmul, &ints, &no_attrs(&matmul)).unwrap_err();
    assert_eq!(dtype.kind(), ErrorKind::DType);
    assert!(dtype.to_string().contains("matmul: expected a of dtype"), "{dtype}");
    let missing = dispatch::plan(&add, &[Some(Meta::new(DType::F32, &[3])), None], &a).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::Argument);
    let unknown = opbridge_ops::global().get("no_such_op", None).unwrap_err();
    assert_eq!(unknown.kind(), ErrorKind::NotFound);
    let wrong_attr = add.schema().bind_attrs([("axis", AttrValue::Int(0))]).unwrap_err();
    assert_eq!(wrong_attr.kind(), ErrorKind::Argument);
}

#[test]
fn run_host_runs_a_planned_call_on_host_memory() {
    let add = entry("add", None);
    let attrs = no_attrs(&add);
    let (a, b) = (vec![1.0f32, 2.0, 3.0], vec![10.0f32]);
    let mut out = vec![0f32; 3];
    let views = [
        Some(TensorView::contiguous(a.as_ptr() as usize, DType::F32, &[3])),
        Some(TensorView::contiguous(b.as_ptr() as usize, DType::F32, &[1])),
    ];
    let plan =
        dispatch::plan(&add, &[Some(Meta::new(DType::F32, &[3])), Some(Meta::new(DType::F32, &[1]))], &attrs).unwrap();
    let target = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F32, &[3]);
    dispatch::run_host(&add, &attrs, &plan, &views, HostOutputs::Given(std::slice::from_ref(&target)), cpu_pool())
        .unwrap();
    assert_eq!(out, vec![11.0, 12.0, 13.0]);

    // The checks give typed errors, before anything runs.
    let mut short = vec![0f32; 2];
    let wrong_shape = TensorView::contiguous(short.as_mut_ptr() as usize, DType::F32, &[2]);
    let err = dispatch::run_host(
        &add,
        &attrs,
        &plan,
        &views,
        HostOutputs::Given(std::slice::from_ref(&wrong_shape)),
        cpu_pool(),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shape, "{err}");
    // New outputs are trusted not to overlap anything, never to match the plan.
    let err =
        dispatch::run_host(&add, &attrs, &plan, &views, HostOutputs::New(&[wrong_shape]), cpu_pool()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shape, "{err}");
    let mut doubles = vec![0f64; 3];
    let wrong_dtype = TensorView::contiguous(doubles.as_mut_ptr() as usize, DType::F64, &[3]);
    let err =
        dispatch::run_host(&add, &attrs, &plan, &views, HostOutputs::Given(&[wrong_dtype]), cpu_pool()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DType, "{err}");
    // An output overlapping an input must be computed aside by the caller.
    let b_as_out = TensorView {
        strides: [0isize].into_iter().collect(),
        ..TensorView::contiguous(b.as_ptr() as usize, DType::F32, &[3])
    };
    let err = dispatch::run_host(&add, &attrs, &plan, &views, HostOutputs::Given(&[b_as_out]), cpu_pool()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Argument, "{err}");
    assert!(dispatch::overlaps_inputs(
        &add,
        &views,
        &TensorView::contiguous(a.as_ptr() as usize + 4, DType::F32, &[3])
    ));
    // An exact alias is in place for an elementwise operator.
    assert!(!dispatch::overlaps_inputs(&add, &views, &TensorView::contiguous(a.as_ptr() as usize, DType::F32, &[3])));
    assert_eq!(out, vec![11.0, 12.0, 13.0], "failed calls wrote nothing");
}

fn launch_writes_new_outputs_and_given_ones(ctx: &'static Arc<DeviceContext>) {
    let stream = Stream::new(ctx).unwrap();
    let add = entry("vector_add", Some(1));
    let attrs = no_attrs(&add);
    let a = tensor_f32(ctx, &stream, &[4], &[1.0, 2.0, 3.0, 4.0]);
    let b = tensor_f32(ctx, &stream, &[4], &[10.0, 20.0, 30.0, 40.0]);
    let results =
        dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(b.clone())], None, &stream, ctx.pool()).unwrap();
    assert_eq!(results.len(), 1);
    assert_eq!(read::<f32>(&results[0]).unwrap(), vec![11.0, 22.0, 33.0, 44.0]);
    // Into a given output, and in place (an exact alias of an input).
    let out = Arc::new(Tensor::empty(ctx, &[4], DType::F32, stream.id()).unwrap());
    let given = dispatch::launch(
        &add,
        &attrs,
        &[Some(a.clone()), Some(b.clone())],
        Some(std::slice::from_ref(&out)),
        &stream,
        ctx.pool(),
    )
    .unwrap();
    assert!(Arc::ptr_eq(&given[0], &out));
    dispatch::launch(
        &add,
        &attrs,
        &[Some(a.clone()), Some(b.clone())],
        Some(std::slice::from_ref(&a)),
        &stream,
        ctx.pool(),
    )
    .unwrap();
    assert_eq!(read::<f32>(&out).unwrap(), vec![11.0, 22.0, 33.0, 44.0]);
    assert_eq!(read::<f32>(&a).unwrap(), vec![11.0, 22.0, 33.0, 44.0]);
    stream.synchronize().unwrap();
}
test_device!(launch_writes_new_outputs_and_given_ones);

fn launch_converts_dtypes_reads_strides_and_computes_overlaps_aside(ctx: &'static Arc<DeviceContext>) {
    let stream = Stream::new(ctx).unwrap();
    let add = entry("vector_add", Some(1));
    let attrs = no_attrs(&add);
    // float32 + int64 -> float64 (numpy's promotion): the int input is converted on the stream.
    let a = tensor_f32(ctx, &stream, &[3], &[0.5, 1.5, 2.5]);
    let i = tensor_i64(ctx, &stream, &[1, 2, 3]);
    let r = dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(i)], None, &stream, ctx.pool()).unwrap();
    assert_eq!(r[0].dtype(), DType::F64);
    assert_eq!(read::<f64>(&r[0]).unwrap(), vec![1.5, 3.5, 5.5]);
    // A transposed (strided) input is read in place.
    let m = tensor_f32(ctx, &stream, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let t = Arc::new(
        Tensor::from_storage(
            Arc::clone(m.storage()),
            m.device(),
            DType::F32,
            vec![3, 2],
            Some(vec![1, 3]),
            m.byte_offset(),
        )
        .unwrap(),
    );
    let neg = entry("neg", None);
    let r = dispatch::launch(&neg, &no_attrs(&neg), &[Some(t)], None, &stream, ctx.pool()).unwrap();
    assert_eq!(read::<f32>(&r[0]).unwrap(), vec![-1.0, -4.0, -2.0, -5.0, -3.0, -6.0]);
    // An output that partially overlaps an input: computed aside, then copied in.
    let x = tensor_f32(ctx, &stream, &[5], &[1.0, 2.0, 3.0, 4.0, 5.0]);
    let head = Arc::new(
        Tensor::from_storage(Arc::clone(x.storage()), x.device(), DType::F32, vec![4], None, x.byte_offset()).unwrap(),
    );
    let tail = Arc::new(
        Tensor::from_storage(Arc::clone(x.storage()), x.device(), DType::F32, vec![4], None, x.byte_offset() + 4)
            .unwrap(),
    );
    dispatch::launch(&add, &attrs, &[Some(head.clone()), Some(head.clone())], Some(&[tail]), &stream, ctx.pool())
        .unwrap();
    // Access order is kept per tensor object, not per storage: wait for the stream, then read
    // the storage through `x`.
    stream.synchronize().unwrap();
    assert_eq!(read::<f32>(&x).unwrap(), vec![1.0, 2.0, 4.0, 6.0, 8.0]);
    stream.synchronize().unwrap();
}
test_device!(launch_converts_dtypes_reads_strides_and_computes_overlaps_aside);

fn launch_checks_arguments_before_anything_runs(ctx: &'static Arc<DeviceContext>) {
    let stream = Stream::new(ctx).unwrap();
    let add = entry("vector_add", Some(1));
    let attrs = no_attrs(&add);
    let a = tensor_f32(ctx, &stream, &[4], &[1.0; 4]);
    let short = tensor_f32(ctx, &stream, &[3], &[1.0; 3]);
    let err =
        dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(short.clone())], None, &stream, ctx.pool()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shape);
    let err = dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(a.clone())], Some(&[short]), &stream, ctx.pool())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shape);
    assert!(err.to_string().contains("out of shape"), "{err}");
    let doubles = Arc::new(Tensor::empty(ctx, &[4], DType::F64, stream.id()).unwrap());
    let err =
        dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(a.clone())], Some(&[doubles]), &stream, ctx.pool())
            .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DType);
    let err = dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(a.clone())], Some(&[]), &stream, ctx.pool())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Argument);
    stream.synchronize().unwrap();
}
test_device!(launch_checks_arguments_before_anything_runs);

fn kernel_errors_on_a_stream_keep_their_type(ctx: &'static Arc<DeviceContext>) {
    let stream = Stream::new(ctx).unwrap();
    let bag = entry("embedding_bag", None);
    let weight = tensor_f32(ctx, &stream, &[4, 2], &[1.0; 8]);
    let indices = tensor_i64(ctx, &stream, &[1, 99]);
    let offsets = tensor_i64(ctx, &stream, &[0]);
    let r = dispatch::launch(
        &bag,
        &no_attrs(&bag),
        &[Some(weight), Some(indices), Some(offsets)],
        None,
        &stream,
        ctx.pool(),
    )
    .unwrap();
    // The host read reports the kernel's failure with the kind it has before launch on the
    // numpy path (an argument out of range), and the typed cause is reachable.
    let Err(Error::Async { error, .. }) = read::<f32>(&r[0]) else { panic!("the failed kernel's output was readable") };
    assert_eq!(error.kind(), ErrorKind::Argument);
    let cause = OpError::from_async(&error).expect("the OpError travels as the cause");
    assert_eq!(cause.kind(), ErrorKind::Argument);
    assert!(cause.to_string().starts_with("embedding_bag: "), "{cause}");
    let Err(Error::Async { error, .. }) = stream.synchronize() else { panic!("the stream reports it too") };
    assert_eq!(OpError::Runtime(Error::Async { stream: String::new(), error }).kind(), ErrorKind::Argument);
    stream.synchronize().unwrap();
}
test_device!(kernel_errors_on_a_stream_keep_their_type);

fn a_child_pool_quota_covers_outputs_and_temporaries(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let stream = Stream::new(ctx).unwrap();
    let add = entry("vector_add", Some(1));
    let attrs = no_attrs(&add);
    let n = 64 * 1024; // 256 KiB of float32
    let a = tensor_f32(ctx, &stream, &[n], &vec![1.0; n]);
    let i = tensor_i64(ctx, &stream, &vec![2; n]);
    // Room for one float64 output (512 KiB) but not for it and the converted input beside it.
    let session = ctx.pool().child(3 * 256 * 1024);
    assert_eq!(session.device(), ctx.id());
    let err = dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(i.clone())], None, &stream, &session).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfMemory, "{err}");
    assert!(matches!(err, OpError::Runtime(Error::OutOfMemory { quota: true, .. })), "{err:?}");
    stream.synchronize().unwrap();
    assert_eq!(session.usage().0, 0, "a failed call gives back what it took");
    // A float32 + float32 call fits: its output counts against the quota while it lives.
    let r = dispatch::launch(&add, &attrs, &[Some(a.clone()), Some(a.clone())], None, &stream, &session).unwrap();
    assert_eq!(read::<f32>(&r[0]).unwrap()[n - 1], 2.0);
    assert_eq!(session.usage().0, session.parent().block_size(n * 4));
    drop(r);
    stream.synchronize().unwrap();
    assert_eq!(session.usage().0, 0);
    // With a larger quota the converted temporary is the session's too: its peak holds both.
    let roomy = ctx.pool().child(2 * 1024 * 1024);
    let r = dispatch::launch(&add, &attrs, &[Some(a), Some(i)], None, &stream, &roomy).unwrap();
    assert_eq!(read::<f64>(&r[0]).unwrap()[0], 3.0);
    let (_, peak) = roomy.usage();
    assert!(peak >= roomy.parent().block_size(n * 8) * 2, "output and converted input: peak {peak}");
    drop(r);
    stream.synchronize().unwrap();
}
test_device!(a_child_pool_quota_covers_outputs_and_temporaries);

fn a_registry_of_its_own_dispatches_like_the_default(ctx: &'static Arc<DeviceContext>) {
    let own = Registry::new();
    opbridge_ops::register_builtins(&own).unwrap();
    let stream = Stream::new(ctx).unwrap();
    let mul = own.get("mul", None).unwrap();
    assert!(!Arc::ptr_eq(&mul, &entry("mul", None)), "its own entries, not the default registry's");
    let a = tensor_f32(ctx, &stream, &[2], &[3.0, 4.0]);
    let r = dispatch::launch(&mul, &no_attrs(&mul), &[Some(a.clone()), Some(a)], None, &stream, ctx.pool()).unwrap();
    assert_eq!(read::<f32>(&r[0]).unwrap(), vec![9.0, 16.0]);
    // Built-ins are not counted in flight (their code cannot be unloaded): nothing to wait for.
    mul.wait_idle().unwrap();
    stream.synchronize().unwrap();
}
test_device!(a_registry_of_its_own_dispatches_like_the_default);

#[test]
fn external_storage_tensors_dispatch_like_pool_ones() {
    // A tensor over memory another library owns (numpy's, through DLPack) is read in place.
    let ctx = DeviceContext::cpu();
    let stream = Stream::new(ctx).unwrap();
    let values: Vec<f32> = vec![1.0, -2.0, 3.0];
    let ptr = values.as_ptr() as usize;
    let storage =
        Storage::External { ptr: opbridge_runtime::DevicePtr(ptr), len: 12, device: ctx.id(), owner: Box::new(values) };
    let t = Arc::new(Tensor::from_storage(Arc::new(storage), ctx.id(), DType::F32, vec![3], None, 0).unwrap());
    let abs = entry("abs", None);
    let r = dispatch::launch(&abs, &no_attrs(&abs), &[Some(t)], None, &stream, ctx.pool()).unwrap();
    assert_eq!(read::<f32>(&r[0]).unwrap(), vec![1.0, 2.0, 3.0]);
    stream.synchronize().unwrap();
}

/// A scratch-hungry operator: 1 KiB of workspace per input element, which its kernel checks
/// (size, alignment, zeroed) and dirties.
struct Scratchy;

impl opbridge_plugin_sdk::Op for Scratchy {
    const NAME: &'static str = "scratchy";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const DTYPES: &'static [DType] = &[DType::F32];
    const WORKSPACE: Option<opbridge_plugin_sdk::WorkspaceFn> = Some(|inputs, _| inputs[0].shape[0] * 1024);

    fn infer(
        inputs: &opbridge_plugin_sdk::Inputs<'_, opbridge_plugin_sdk::Meta>,
        _: &opbridge_plugin_sdk::Attrs<'_>,
    ) -> opbridge_plugin_sdk::Result<Vec<opbridge_plugin_sdk::Meta>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(
        inputs: &opbridge_plugin_sdk::Inputs<'_, opbridge_plugin_sdk::Tensor<'_>>,
        outputs: &mut [opbridge_plugin_sdk::TensorMut<'_>],
        _: &opbridge_plugin_sdk::Attrs<'_>,
        ws: &mut [u8],
    ) -> opbridge_plugin_sdk::Result<()> {
        let n = inputs[0].len();
        if ws.len() != n * 1024 || !(ws.as_ptr() as usize).is_multiple_of(64) || ws.iter().any(|&b| b != 0) {
            return Err(opbridge_plugin_sdk::Error::new(
                opbridge_plugin_sdk::Status::Failed,
                format!("bad workspace: {} bytes, zeroed {}", ws.len(), ws.iter().all(|&b| b == 0)),
            ));
        }
        ws.fill(0xAB); // the next call must get it zeroed again
        let x: Vec<f32> = inputs[0].values::<f32>()?.collect();
        outputs[0].as_mut_slice::<f32>()?.copy_from_slice(&x);
        Ok(())
    }
}

fn a_child_pool_quota_covers_the_kernel_workspace(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let own = Registry::new();
    let op = opbridge_ops::native::register::<Scratchy>(&own, opbridge_ops::Source::Builtin).unwrap();
    let stream = Stream::new(ctx).unwrap();
    let n = 256; // 1 KiB output, 256 KiB of workspace
    let x = tensor_f32(ctx, &stream, &[n], &vec![7.0; n]);
    // The output fits this quota, the workspace beside it does not.
    let tight = ctx.pool().child(64 * 1024);
    let err = dispatch::launch(&op, &no_attrs(&op), &[Some(x.clone())], None, &stream, &tight).unwrap_err();
    assert!(matches!(&err, OpError::Workspace { bytes, .. } if *bytes == n * 1024), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::OutOfMemory);
    assert!(err.to_string().contains("quota"), "the pool's reason is kept: {err}");
    stream.synchronize().unwrap();
    assert_eq!(tight.usage().0, 0, "the failed call gave its output back");
    // The numpy path takes its workspace from the allocator it is given, quota included.
    let mut out = vec![0f32; n];
    let host_in = [Some(TensorView::of_tensor(&x))];
    let host_out = [TensorView::contiguous(out.as_mut_ptr() as usize, DType::F32, &[n])];
    let plan = dispatch::plan(&op, &[Some(Meta::new(DType::F32, &[n]))], &no_attrs(&op)).unwrap();
    let run = |alloc: &dyn Allocate| {
        dispatch::run_host(&op, &no_attrs(&op), &plan, &host_in, HostOutputs::New(&host_out), alloc)
    };
    let err = run(&tight).unwrap_err();
    assert!(matches!(&err, OpError::Workspace { bytes, .. } if *bytes == n * 1024), "{err:?}");
    run(&ctx.pool().child(1 << 20)).unwrap();
    assert_eq!(out, vec![7.0; n]);
    let roomy = ctx.pool().child(1 << 20);
    for _ in 0..2 {
        let r = dispatch::launch(&op, &no_attrs(&op), &[Some(x.clone())], None, &stream, &roomy).unwrap();
        assert_eq!(read::<f32>(&r[0]).unwrap(), vec![7.0; n], "the kernel accepted its workspace");
    }
    stream.synchronize().unwrap();
    let (used, peak) = roomy.usage();
    assert_eq!(used, 0, "output and workspace went back");
    assert!(peak >= n * 1024 + roomy.parent().block_size(n * 4), "the workspace counted: peak {peak}");
}
test_device!(a_child_pool_quota_covers_the_kernel_workspace);

/// An operator whose workspace is `bytes` (an attribute): sizes no allocator can serve.
struct Greedy;

impl opbridge_plugin_sdk::Op for Greedy {
    const NAME: &'static str = "greedy";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [opbridge_plugin_sdk::Attr] = &[opbridge_plugin_sdk::Attr::int("bytes", 0)];
    const DTYPES: &'static [DType] = &[DType::F32];
    const WORKSPACE: Option<opbridge_plugin_sdk::WorkspaceFn> =
        Some(|_, attrs| attrs.int("bytes").map_or(0, |b| b as u64 as usize));

    fn infer(
        inputs: &opbridge_plugin_sdk::Inputs<'_, opbridge_plugin_sdk::Meta>,
        _: &opbridge_plugin_sdk::Attrs<'_>,
    ) -> opbridge_plugin_sdk::Result<Vec<opbridge_plugin_sdk::Meta>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(
        _: &opbridge_plugin_sdk::Inputs<'_, opbridge_plugin_sdk::Tensor<'_>>,
        _: &mut [opbridge_plugin_sdk::TensorMut<'_>],
        _: &opbridge_plugin_sdk::Attrs<'_>,
        _: &mut [u8],
    ) -> opbridge_plugin_sdk::Result<()> {
        Ok(())
    }
}

/// A workspace too large to allocate is out of memory on both paths: the host workspace of
/// `run_cpu` (the numpy path) and the call allocator's (the tensor path); sizes past the address
/// space too.
fn an_unallocatable_workspace_is_out_of_memory(ctx: &'static Arc<DeviceContext>) {
    let _serial = serial();
    let own = Registry::new();
    let op = opbridge_ops::native::register::<Greedy>(&own, opbridge_ops::Source::Builtin).unwrap();
    let stream = Stream::new(ctx).unwrap();
    let x = tensor_f32(ctx, &stream, &[4], &[1.0; 4]);
    let mut out = [0f32; 4];
    for bytes in [-1i64, i64::MAX, 1 << 62, (1 << 47) + 3] {
        let attrs = attrs(&op, &[("bytes", AttrValue::Int(bytes))]);
        let input = TensorView::of_tensor(&x);
        let output = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F32, &[4]);
        let host = op.op.run_cpu(&[Some(input)], &[output], &attrs).unwrap_err();
        assert_eq!(host.kind(), ErrorKind::OutOfMemory, "host workspace of {bytes} bytes: {host}");
        assert!(matches!(host, OpError::Workspace { .. }), "{host:?}");
        assert!(host.to_string().starts_with("greedy: out of memory"), "{host}");
        let pooled = dispatch::launch(&op, &attrs, &[Some(x.clone())], None, &stream, ctx.pool()).unwrap_err();
        assert_eq!(pooled.kind(), ErrorKind::OutOfMemory, "pool workspace of {bytes} bytes: {pooled}");
    }
    stream.synchronize().unwrap();
    // A size that fits runs.
    let fits = attrs(&op, &[("bytes", AttrValue::Int(4096))]);
    let output = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F32, &[4]);
    op.op.run_cpu(&[Some(TensorView::of_tensor(&x))], &[output], &fits).unwrap();
}
test_device!(an_unallocatable_workspace_is_out_of_memory);
