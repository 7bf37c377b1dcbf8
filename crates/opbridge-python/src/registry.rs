//! Registered operators from Python: `ob.ops.<name>(...)`, `ob.ops.get(name, version=...)`,
//! `ob.list_ops()`, and `ob.vector_add` / `ob.matmul` (fixed-signature entries to two of them).
//! This file binds arguments, extracts numpy arrays, serves the elementwise fast lane and wraps
//! results; the call itself (plan, checks, kernel, launch) is `opbridge_ops::dispatch`, the
//! same path the server takes. numpy arrays run synchronously on their buffers, `Tensor`s are
//! enqueued on the current stream.

use std::sync::{Arc, Once, OnceLock};

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use opbridge_ops::dispatch::{self, HostOutputs};
use opbridge_ops::hybrid::{self, Route};
use opbridge_ops::registry::{Entry, Lane, Registry, ViewLane};
use opbridge_ops::schema::AttrSpec;
use opbridge_ops::{overlap, AttrValue, Attrs, Meta, Overlap, TensorView};
use opbridge_runtime::{DType, DeviceContext, DeviceId, Stream, StreamId, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use smallvec::SmallVec;

use crate::errors::{argument_error, to_pyerr};
use crate::ffi::numpy as np_ffi;
use crate::ffi::vectorcall;
use crate::host::{self, check_out, new_output, HostArray};
use crate::tensor::{as_out_tensor, input_tensor, PyTensor};

/// One version of a registered operator, callable like a function.
#[pyclass(name = "Op", module = "opbridge", frozen, dict)]
#[derive(Debug)]
pub struct PyOp {
    entry: Arc<Entry>,
    /// The function CPython calls this object through (vectorcall, `ffi::vectorcall`); read
    /// by CPython at the offset `new_bound` gives the type, never by us.
    vectorcall: vectorcall::VectorcallFn,
}

impl PyOp {
    /// The `Op` object for `entry`. The first one gives the class vectorcall (and makes it
    /// immutable), now that the offset of an instance's `vectorcall` field can be measured:
    /// the module's init makes one ([`enable_vectorcall`]), before Python code can touch the
    /// class.
    fn new_bound<'py>(py: Python<'py>, entry: Arc<Entry>) -> PyResult<Bound<'py, PyOp>> {
        static VECTORCALL: Once = Once::new();
        let op = Bound::new(py, PyOp { entry, vectorcall: vectorcall::function::<PyOp>() })?;
        VECTORCALL.call_once(|| {
            let offset = std::ptr::from_ref(&op.get().vectorcall) as usize - op.as_ptr() as usize;
            vectorcall::enable(&op.get_type(), offset);
        });
        Ok(op)
    }
}

/// Gives the `Op` class vectorcall at the module's init (see [`PyOp::new_bound`]).
pub(crate) fn enable_vectorcall(py: Python<'_>) -> PyResult<()> {
    PyOp::new_bound(py, registry().get("add", None).map_err(to_pyerr)?).map(drop)
}

/// Calls with positional arrays and at most `out=`: the fast lanes straight from CPython's
/// argument array (`__call__` takes them after CPython packed a tuple and PyO3 unpacked it).
impl vectorcall::FastCall for PyOp {
    fn fast_call<'py>(
        callable: &Bound<'py, PyAny>,
        args: &[Bound<'py, PyAny>],
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        fast_lanes(callable.py(), &callable.cast::<PyOp>()?.get().entry, || args.iter(), out)
    }
}

/// A call with positional arguments only (attributes at their defaults) through the operator's
/// fast lanes: the elementwise lane, then the view lane (each walks the arguments `args` gives).
/// `None` when neither serves it.
fn fast_lanes<'py, A, I>(
    py: Python<'py>,
    entry: &Entry,
    args: impl Fn() -> I,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyAny>>>
where
    A: std::ops::Deref<Target = Bound<'py, PyAny>>,
    I: ExactSizeIterator<Item = A>,
{
    if let Some(lane) = entry.op.lane() {
        if let Some(result) = try_lane(py, entry, lane, args(), out)? {
            return Ok(Some(result));
        }
    }
    match entry.op.view_lane() {
        Some(lane) => try_view_lane(py, entry, lane, args(), out),
        None => Ok(None),
    }
}

/// The process-wide default registry (built-ins and loaded libraries).
pub(crate) fn registry() -> &'static Registry {
    opbridge_ops::global()
}

/// A Python value as the value of the attribute `key` of the operator `op` (`spec`: its
/// declaration, when it has one). Every value that cannot be one is an `ArgumentError` naming
/// the argument.
fn attr_value(op: &str, key: &str, spec: Option<&AttrSpec>, value: &Bound<'_, PyAny>) -> PyResult<AttrValue> {
    if value.is_none() {
        return Ok(AttrValue::None);
    }
    // Type checks first: a failed `extract` builds a Python exception, which costs more than
    // the whole call. bool before int: Python's bool is an int.
    if let Ok(b) = value.cast::<pyo3::types::PyBool>() {
        return Ok(AttrValue::Bool(b.is_true()));
    }
    if value.is_instance_of::<pyo3::types::PyInt>() {
        return int_attr(op, key, spec, value);
    }
    if value.is_instance_of::<pyo3::types::PyFloat>() {
        return Ok(AttrValue::Float(value.extract()?));
    }
    if let Ok(s) = value.cast::<pyo3::types::PyString>() {
        return Ok(AttrValue::Str(s.to_str()?.to_string()));
    }
    // numpy scalars and other int- or float-likes (rare: the failed attempts are fine here).
    // (`np.int32` the type has an unbound `__index__` too: types travel as dtypes, below.)
    if !value.is_instance_of::<pyo3::types::PyType>() && value.hasattr("__index__")? {
        if let Ok(index) = value.call_method0("__index__") {
            return int_attr(op, key, spec, &index);
        }
    }
    if let Ok(x) = value.extract::<f64>() {
        return Ok(AttrValue::Float(x));
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let mut ints = Vec::with_capacity(value.len()?);
        for (i, item) in value.try_iter()?.enumerate() {
            let item = item?;
            if item.is_instance_of::<pyo3::types::PyBool>() || !item.hasattr("__index__")? {
                return Err(argument_error(format!(
                    "{op}: {key} must be a list of ints, got {} at position {i}",
                    crate::convert::type_name(&item)
                )));
            }
            ints.push(
                crate::convert::int_arg(&format!("{op}: {key}[{i}]"), &item, i64::MIN.into(), i64::MAX.into())? as i64
            );
        }
        return Ok(AttrValue::Ints(ints));
    }
    // numpy dtypes and scalar types (`dtype=np.float32`) travel by name.
    if let Ok(descr) = crate::convert::numpy(value.py())?.call_method1("dtype", (value,)) {
        return Ok(AttrValue::Str(descr.getattr("name")?.extract()?));
    }
    Err(argument_error(format!(
        "{op}: unsupported value for {key}: {value} of type {}",
        crate::convert::type_name(value)
    )))
}

/// An int attribute value. A float attribute takes any int, converted as Python's `float()`
/// converts it; other attributes take 64-bit integers.
fn int_attr(op: &str, key: &str, spec: Option<&AttrSpec>, value: &Bound<'_, PyAny>) -> PyResult<AttrValue> {
    let takes_float = spec.is_some_and(|s| s.takes_float);
    match value.extract::<i64>() {
        // Exact up to 2**53, then rounded to nearest like `float()` (the kernel side's `as f64`).
        Ok(i) => Ok(AttrValue::Int(i)),
        Err(_) if takes_float => match value.extract::<f64>() {
            Ok(x) => Ok(AttrValue::Float(x)),
            Err(_) => Err(argument_error(format!(
                "{op}: {key} is too large for a float: {}",
                crate::convert::short_int(value)
            ))),
        },
        Err(_) => Err(argument_error(format!(
            "{op}: {key} is out of range: got {}, expected a 64-bit integer ({} to {})",
            crate::convert::short_int(value),
            i64::MIN,
            i64::MAX
        ))),
    }
}

fn attr_to_py<'py>(py: Python<'py>, value: &AttrValue) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        AttrValue::None => py.None().into_bound(py),
        AttrValue::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        AttrValue::Int(i) => i.into_pyobject(py)?.into_any(),
        AttrValue::Float(x) => x.into_pyobject(py)?.into_any(),
        AttrValue::Str(s) => s.into_pyobject(py)?.into_any(),
        AttrValue::Ints(v) => PyList::new(py, v)?.into_any(),
    })
}

/// Per-call lists (operands, metas, views): inline for the usual handful, so a call does not
/// allocate to describe itself.
type Few<T> = SmallVec<[T; 4]>;

/// The call's arguments sorted into tensor inputs (by schema position) and attributes.
struct BoundCall<'py> {
    inputs: Few<Option<Bound<'py, PyAny>>>,
    attrs: Attrs,
}

fn bind<'py>(
    entry: &Entry,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<BoundCall<'py>> {
    let schema = entry.schema();
    let name = &schema.name;
    if args.len() > schema.inputs.len() {
        return Err(PyTypeError::new_err(format!(
            "{name}() takes {} tensor arguments ({}), got {}",
            schema.inputs.len(),
            schema.inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", "),
            args.len()
        )));
    }
    let mut inputs: Few<Option<Bound<'py, PyAny>>> = args.iter().map(Some).collect();
    inputs.resize(schema.inputs.len(), None);
    let mut attrs: Few<(PyBackedStr, AttrValue)> = Few::new();
    if let Some(kwargs) = kwargs {
        for (key, value) in kwargs.iter() {
            let key: PyBackedStr = key.extract()?;
            match schema.inputs.iter().position(|i| i.name == *key) {
                Some(index) if inputs[index].is_some() => {
                    return Err(PyTypeError::new_err(format!("{name}() got multiple values for argument {key:?}")));
                }
                Some(index) => inputs[index] = Some(value),
                None => {
                    let spec = schema.attrs.iter().find(|a| a.name == *key);
                    let value = attr_value(name, &key, spec, &value)?;
                    attrs.push((key, value));
                }
            }
        }
    }
    for (spec, input) in schema.inputs.iter().zip(inputs.iter_mut()) {
        if input.as_ref().is_some_and(|i| i.is_none()) {
            *input = None;
        }
        if input.is_none() && !spec.optional {
            return Err(PyTypeError::new_err(format!("{name}() missing required tensor argument {:?}", spec.name)));
        }
    }
    let attrs = schema.bind_attrs(attrs).map_err(to_pyerr)?;
    Ok(BoundCall { inputs, attrs })
}

fn is_tensor_call(call: &BoundCall<'_>, out: Option<&Bound<'_, PyAny>>) -> bool {
    let outs: Vec<Bound<'_, PyAny>> = match out {
        Some(o) if o.is_instance_of::<PyTuple>() => o.try_iter().map(|it| it.flatten().collect()).unwrap_or_default(),
        Some(o) => vec![o.clone()],
        None => vec![],
    };
    call.inputs.iter().flatten().chain(outs.iter()).any(|x| x.is_instance_of::<PyTensor>())
}

/// `out=` as a list of objects, one per output.
fn out_list<'py>(name: &str, out: Option<&Bound<'py, PyAny>>, n: usize) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
    let Some(out) = out else { return Ok(None) };
    let list: Vec<Bound<'py, PyAny>> =
        if let Ok(tuple) = out.cast::<PyTuple>() { tuple.iter().collect() } else { vec![out.clone()] };
    if list.len() != n {
        return Err(argument_error(format!("{name}: expected {n} out arrays, got {}", list.len())));
    }
    Ok(Some(list))
}

fn view_of(array: &HostArray<'_>) -> TensorView {
    let size = array.dtype.size() as isize;
    TensorView {
        data: array.layout().data,
        dtype: array.dtype,
        shape: array.shape().into(),
        strides: array.array.strides().iter().map(|s| s / size).collect(),
    }
}

/// The elementwise fast lane (see `opbridge_ops::registry::Lane`): every argument a plain
/// C-contiguous, aligned, native ndarray of one dtype and shape, no attributes, and `out`
/// (when given) of the same kind and either disjoint from the inputs or one of them. Returns
/// `None` when the call does not qualify: the generic path then handles it, errors included.
fn try_lane<'py, A: std::ops::Deref<Target = Bound<'py, PyAny>>>(
    py: Python<'py>,
    entry: &Entry,
    lane: &Lane,
    args: impl ExactSizeIterator<Item = A>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    const MAX_INPUTS: usize = 4;
    let n = args.len();
    if n != entry.schema().inputs.len() || n == 0 || n > MAX_INPUTS {
        return Ok(None);
    }
    let mut addresses = [0usize; MAX_INPUTS];
    let mut first: Option<(DType, Bound<'py, PyUntypedArray>)> = None;
    // A second input of another dtype, for a lane that promotes two inputs (`vector_add`).
    let mut other: Option<(DType, Bound<'py, PyUntypedArray>)> = None;
    for (k, arg) in args.enumerate() {
        let Some(array) = np_ffi::as_exact_ndarray(&arg) else { return Ok(None) };
        let layout = np_ffi::layout(array);
        if !(layout.is_c_contiguous() && layout.is_aligned() && layout.is_native()) {
            return Ok(None);
        }
        let Some(dtype) = np_ffi::dtype_of_num(layout.type_num) else { return Ok(None) };
        match &first {
            None => first = Some((dtype, array.clone())),
            Some((d, a)) if *d == dtype && a.shape() == array.shape() => {}
            Some((_, a)) if k == 1 && n == 2 && lane.promote.is_some() && a.shape() == array.shape() => {
                other = Some((dtype, array.clone()));
            }
            Some(_) => return Ok(None),
        }
        addresses[k] = layout.data;
    }
    let Some((first_dtype, model)) = first else { return Ok(None) };
    // Mixed dtypes: each input not of the promoted dtype is converted once (by numpy), as the
    // generic path would; the copies are fresh, so disjoint from any `out`, and live until the
    // kernel returns.
    let mut converted: Few<Bound<'py, PyUntypedArray>> = Few::new();
    let second_dtype = other.as_ref().map_or(first_dtype, |(d, _)| *d);
    let dtype = match (other, lane.promote) {
        (None, _) => first_dtype,
        (Some((second_dtype, second)), Some(promote)) => {
            let dtype = promote(first_dtype, second_dtype);
            if !(lane.accepts)(dtype) {
                return Ok(None);
            }
            for (k, (input_dtype, array)) in [(first_dtype, &model), (second_dtype, &second)].into_iter().enumerate() {
                if input_dtype != dtype {
                    let copy = host::converted(array, dtype)?;
                    addresses[k] = np_ffi::layout(&copy).data;
                    converted.push(copy);
                }
            }
            dtype
        }
        (Some(_), None) => return Ok(None),
    };
    if !(lane.accepts)(dtype) || !entry.schema().dtypes.contains(&dtype) {
        return Ok(None);
    }
    let len = model.len();
    let bytes = len * dtype.size();
    let (out_address, result) = match out {
        None => {
            let fresh = new_output(py, dtype, model.shape())?;
            (fresh.layout().data, fresh.array.into_any())
        }
        Some(given) => {
            let Some(array) = np_ffi::as_exact_ndarray(given) else { return Ok(None) };
            let layout = np_ffi::layout(array);
            let usable = layout.is_c_contiguous()
                && layout.is_aligned()
                && layout.is_native()
                && layout.is_writeable()
                && np_ffi::dtype_of_num(layout.type_num) == Some(dtype)
                && array.shape() == model.shape();
            let span = (layout.data, bytes);
            let safe = |&a: &usize| match overlap((a, bytes), span) {
                Overlap::Disjoint => true,
                Overlap::Same => entry.op.in_place_ok(),
                Overlap::Partial => false,
            };
            if !usable || !addresses[..n].iter().all(safe) {
                return Ok(None);
            }
            (layout.data, given.clone())
        }
    };
    let _span = dispatch::call_span(
        entry,
        (0..n).map(|k| Some((if k == 1 { second_dtype } else { first_dtype }, model.shape()))),
        DeviceId::CPU,
        StreamId::HOST,
    );
    let guard = entry.enter_scoped();
    let inputs = &addresses[..n];
    host::run(py, bytes * (n + 1), || (lane.run)(dtype, inputs, out_address, len)).map_err(to_pyerr)?;
    drop(guard);
    drop(converted); // the converted inputs lived until the kernel returned
    Ok(Some(result))
}

/// The view fast lane (see `opbridge_ops::registry::ViewLane`): every argument an exact ndarray of one
/// dtype the lane accepts, aligned, in native byte order, with strides in whole elements (any
/// layout: transposed views are read in place), positional inputs only (attributes at their
/// defaults), and `out` (when given) a plain C-contiguous writeable ndarray of the lane's shape
/// and output dtype, disjoint from the inputs.
/// Returns `None` when the call does not qualify or the lane declines its shapes: the generic
/// path then handles it, errors, promotion and overlapping outputs included.
fn try_view_lane<'py, A: std::ops::Deref<Target = Bound<'py, PyAny>>>(
    py: Python<'py>,
    entry: &Entry,
    lane: &ViewLane,
    args: impl ExactSizeIterator<Item = A>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let n = args.len();
    if n != entry.schema().inputs.len() || n == 0 {
        return Ok(None);
    }
    let mut views: Few<TensorView> = Few::new();
    for arg in args {
        let Some(array) = np_ffi::as_exact_ndarray(&arg) else { return Ok(None) };
        let layout = np_ffi::layout(array);
        let Some(dtype) = np_ffi::dtype_of_num(layout.type_num) else { return Ok(None) };
        let size = dtype.size() as isize;
        let strides = array.strides();
        if !(layout.is_aligned() && layout.is_native())
            || views.first().is_some_and(|v| v.dtype != dtype)
            || strides.iter().any(|s| s % size != 0)
        {
            return Ok(None);
        }
        let mut view = TensorView {
            data: layout.data,
            dtype,
            shape: opbridge_ops::view::Dims::from_slice(array.shape()),
            strides: opbridge_ops::view::Strides::from_slice(strides),
        };
        view.strides.iter_mut().for_each(|s| *s /= size);
        views.push(view);
    }
    let dtype = views[0].dtype;
    if !(lane.accepts)(dtype) || !entry.schema().dtypes.contains(&dtype) {
        return Ok(None);
    }
    let shapes: Few<&[usize]> = views.iter().map(|v| v.shape.as_slice()).collect();
    let Some(shape) = (lane.shape)(&shapes) else { return Ok(None) };
    let work = (lane.work_bytes)(&shapes, dtype);
    let out_dtype = (lane.out_dtype)(dtype);
    let (target, result) = match out {
        None => {
            let fresh = new_output(py, out_dtype, &shape)?;
            (TensorView::contiguous(fresh.layout().data, out_dtype, &shape), fresh.array.into_any())
        }
        Some(given) => {
            let Some(array) = np_ffi::as_exact_ndarray(given) else { return Ok(None) };
            let layout = np_ffi::layout(array);
            let usable = layout.is_c_contiguous()
                && layout.is_aligned()
                && layout.is_native()
                && layout.is_writeable()
                && np_ffi::dtype_of_num(layout.type_num) == Some(out_dtype)
                && array.shape() == shape.as_slice();
            if !usable {
                return Ok(None);
            }
            let target = TensorView::contiguous(layout.data, out_dtype, &shape);
            if views.iter().any(|v| overlap(v.byte_span(), target.byte_span()) != Overlap::Disjoint) {
                return Ok(None);
            }
            (target, given.clone())
        }
    };
    let _span = dispatch::call_span(
        entry,
        views.iter().map(|v| Some((v.dtype, v.shape.as_slice()))),
        DeviceId::CPU,
        StreamId::HOST,
    );
    let guard = entry.enter_scoped();
    host::run(py, work, || (lane.run)(&views, &target)).map_err(to_pyerr)?;
    drop(guard);
    Ok(Some(result))
}

/// The synchronous numpy path: arrays in, the plan's conversions made once by numpy, outputs
/// the caller's (checked) or new, and `dispatch::run_host` on the buffers.
fn call_host<'py>(
    py: Python<'py>,
    entry: &Entry,
    call: BoundCall<'py>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let schema = entry.schema();
    let name = schema.name.as_str();
    let mut arrays: Few<Option<HostArray<'py>>> = Few::new();
    for (spec, input) in schema.inputs.iter().zip(&call.inputs) {
        arrays.push(match input {
            Some(obj) => Some(HostArray::extract(name, &spec.name, obj, &schema.dtypes)?),
            None => None,
        });
    }
    let metas: Few<Option<Meta>> = arrays.iter().map(|a| a.as_ref().map(|a| Meta::new(a.dtype, a.shape()))).collect();
    // Profiled with the inputs as given, before any conversion.
    let _span = dispatch::call_span(
        entry,
        metas.iter().map(|m| m.as_ref().map(|m| (m.dtype, &m.shape[..]))),
        DeviceId::CPU,
        StreamId::HOST,
    );
    let plan = dispatch::plan(entry, &metas, &call.attrs).map_err(to_pyerr)?;
    // Inputs the kernel can read in place are kept (any strides, broadcast ones included); the
    // others are copied once (their unique elements: broadcast axes stay broadcast).
    let mut inputs: Few<Option<HostArray<'py>>> = Few::new();
    for (array, dtype) in arrays.into_iter().zip(&plan.inputs) {
        inputs.push(match (array, dtype) {
            (Some(a), Some(dtype)) => Some(a.converted(*dtype)?),
            _ => None,
        });
    }
    let views: Few<Option<TensorView>> = inputs.iter().map(|a| a.as_ref().map(view_of)).collect();
    // Outputs: the caller's (checked against the plan) or new ones; computed aside when they
    // overlap an input.
    let given = out_list(name, out, plan.outputs.len())?;
    let mut results: Few<HostArray<'py>> = Few::new();
    let mut copy_back: Vec<(usize, HostArray<'py>)> = Vec::new();
    for (k, meta) in plan.outputs.iter().enumerate() {
        let Some(given) = &given else {
            results.push(new_output(py, meta.dtype, &meta.shape)?);
            continue;
        };
        let target = check_out(name, &given[k])?;
        let target_view = view_of(&target);
        dispatch::check_output(entry, meta, &target_view).map_err(to_pyerr)?;
        if dispatch::overlaps_inputs(entry, &views, &target_view) {
            results.push(new_output(py, meta.dtype, &meta.shape)?);
            copy_back.push((k, target));
        } else {
            results.push(target);
        }
    }
    let out_views: Few<TensorView> = results.iter().map(view_of).collect();
    let bytes: usize = out_views.iter().chain(views.iter().flatten()).map(|v| v.numel() * v.dtype.size()).sum();
    let attrs = &call.attrs;
    let outputs = match given {
        None => HostOutputs::New(&out_views),
        Some(_) => HostOutputs::Given(&out_views),
    };
    // Kernel scratch memory comes from the CPU pool: `set_memory_limit` covers it.
    let scratch = DeviceContext::cpu().pool();
    host::run(py, bytes, || dispatch::run_host(entry, attrs, &plan, &views, outputs, scratch)).map_err(to_pyerr)?;
    for (k, target) in copy_back {
        crate::convert::numpy(py)?.call_method1("copyto", (&target.array, &results[k].array))?;
        results[k] = target;
    }
    if results.len() == 1 {
        return Ok(results.remove(0).array.into_any());
    }
    Ok(PyTuple::new(py, results.into_iter().map(|r| r.array.into_any()))?.into_any())
}

/// A tensor-path argument before anything is copied: a `Tensor`, or a numpy array.
enum Arg<'py> {
    Tensor(Arc<Tensor>),
    Host(HostArray<'py>),
}

/// The async path: arguments become tensors (numpy inputs copied at the call, a numpy `out=`
/// wrapped in place), `dispatch::launch` enqueues the call on the current stream of their
/// device with outputs from its pool, and `Tensor`s come back at once. The call is planned
/// and its new outputs allocated before any numpy input is copied: a call that fails its
/// shape, dtype or memory check costs no copy of its inputs.
fn call_tensor<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
    call: BoundCall<'py>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let schema = entry.schema();
    let name = schema.name.as_str();
    let mut args: Few<Option<Arg<'py>>> = Few::new();
    for (spec, input) in schema.inputs.iter().zip(&call.inputs) {
        args.push(match input {
            Some(obj) => Some(match obj.cast::<PyTensor>() {
                Ok(t) => Arg::Tensor(Arc::clone(&t.get().inner)),
                Err(_) => Arg::Host(HostArray::extract(name, &spec.name, obj, &schema.dtypes)?),
            }),
            None => None,
        });
    }
    let given = out_list(name, out, schema.outputs.len())?;
    let mut outs: Option<Vec<Arc<Tensor>>> = None;
    if let Some(given) = &given {
        let mut list = Vec::with_capacity(given.len());
        for obj in given {
            list.push(Arc::clone(&as_out_tensor(name, obj)?.inner));
        }
        outs = Some(list);
    }
    let metas: Few<Option<Meta>> = args
        .iter()
        .map(|a| {
            a.as_ref().map(|a| match a {
                Arg::Tensor(t) => Meta::new(t.dtype(), t.shape()),
                Arg::Host(h) => Meta::new(h.dtype, h.shape()),
            })
        })
        .collect();
    let plan = dispatch::plan(entry, &metas, &call.attrs).map_err(to_pyerr)?;
    let tensors = args.iter().flatten().filter_map(|a| match a {
        Arg::Tensor(t) => Some(t),
        Arg::Host(_) => None,
    });
    let device = tensors.chain(outs.iter().flatten()).next().map_or(DeviceId::CPU, |t| t.device());
    let ctx = DeviceContext::get(device).map_err(to_pyerr)?;
    let stream = ctx.current_stream().map_err(to_pyerr)?;
    // Profiled with the inputs as given; its outputs and input copies, allocated here before
    // `launch`, are the call's memory.
    let _span = dispatch::call_span(
        entry,
        metas.iter().map(|m| m.as_ref().map(|m| (m.dtype, &m.shape[..]))),
        device,
        stream.id(),
    );
    if device.kind != opbridge_runtime::DeviceKind::Cpu {
        // Device work fails asynchronously: its error will name where it was launched from.
        opbridge_ops::device::set_call_site(crate::convert::python_call_site(py));
    }
    let all_tensors = args.iter().flatten().all(|a| matches!(a, Arg::Tensor(_)));
    if all_tensors {
        // Tensors only: one detach for outputs and launch, with the plan made above.
        let inputs: Few<Option<Arc<Tensor>>> = args
            .into_iter()
            .map(|a| match a {
                Some(Arg::Tensor(t)) => Some(t),
                _ => None,
            })
            .collect();
        let results = py
            .detach(|| {
                dispatch::launch_planned(entry, &plan, &call.attrs, &inputs, outs.as_deref(), &stream, ctx.pool())
            })
            .map_err(to_pyerr)?;
        return finish_tensor_call(py, given, results, &stream);
    }
    if outs.is_none() {
        // The outputs first (the memory check), from the pool `launch` would take them from.
        let metas = &plan.outputs;
        let made = py
            .detach(|| -> opbridge_runtime::Result<Vec<Arc<Tensor>>> {
                metas
                    .iter()
                    .map(|m| Ok(Arc::new(Tensor::empty_in(ctx.pool(), &m.shape, m.dtype, stream.id())?)))
                    .collect()
            })
            .map_err(to_pyerr)?;
        outs = Some(made);
    }
    let mut inputs: Few<Option<Arc<Tensor>>> = Few::new();
    for (arg, dtype) in args.into_iter().zip(&plan.inputs) {
        inputs.push(match (arg, dtype) {
            (Some(Arg::Tensor(t)), _) => Some(t),
            (Some(Arg::Host(h)), Some(dtype)) => Some(input_tensor(name, h, *dtype)?.inner),
            (Some(Arg::Host(h)), None) => {
                let dtype = h.dtype;
                Some(input_tensor(name, h, dtype)?.inner)
            }
            (None, _) => None,
        });
    }
    let attrs = &call.attrs;
    // Detached: allocating may wait for streams whose host functions need the GIL.
    let results = py
        .detach(|| dispatch::launch(entry, attrs, &inputs, outs.as_deref(), &stream, ctx.pool()))
        .map_err(to_pyerr)?;
    finish_tensor_call(py, given, results, &stream)
}

/// A Tensor call's return value: its new outputs as Tensors, or the caller's `out=` (numpy
/// arrays among them are filled before this returns).
fn finish_tensor_call<'py>(
    py: Python<'py>,
    given: Option<Vec<Bound<'py, PyAny>>>,
    results: Vec<Arc<Tensor>>,
    stream: &Stream,
) -> PyResult<Bound<'py, PyAny>> {
    let mut returned: Vec<Bound<'py, PyAny>> = match &given {
        Some(given) => given.clone(),
        None => {
            results.into_iter().map(|t| Ok(Bound::new(py, PyTensor::new(t))?.into_any())).collect::<PyResult<_>>()?
        }
    };
    if given.as_ref().is_some_and(|g| g.iter().any(|o| !o.is_instance_of::<PyTensor>())) {
        // numpy out= arrays: the caller expects them filled when the call returns.
        py.detach(|| stream.synchronize()).map_err(to_pyerr)?;
    }
    Ok(if returned.len() == 1 { returned.remove(0) } else { PyTuple::new(py, returned)?.into_any() })
}

/// A Python number (`int`, `float`, `complex`, `bool`, or a subclass: numpy's scalars that
/// subclass them, `numpy.float64`, are strong, which `numpy.result_type` knows).
fn is_python_number(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<pyo3::types::PyInt>()
        || obj.is_instance_of::<pyo3::types::PyFloat>()
        || obj.is_instance_of::<pyo3::types::PyComplex>()
}

/// Python numbers among the inputs become 0-d arrays of the dtype the installed numpy gives
/// them beside the other operands: `numpy.result_type(<other operands>, <numbers>)` (numpy 2:
/// NEP 50's weak scalars, so `float32_array + 1.5` stays float32; numpy 1: value-based
/// casting). A `Tensor` takes part by its dtype; other operands are converted to arrays here,
/// once. A number that does not fit the dtype (numpy's `OverflowError`, e.g. `2**40` beside
/// int32) is an `ArgumentError`, unless the operator computes that integer dtype in a float
/// dtype (true division: `int32_array / 2**40` is float64 in numpy), which then holds it.
fn weak_scalars<'py>(py: Python<'py>, entry: &Entry, call: &mut BoundCall<'py>) -> PyResult<()> {
    let name = entry.schema().name.as_str();
    let schema_inputs = call.inputs.len();
    let numbers =
        call.inputs.iter().flatten().filter(|x| np_ffi::as_ndarray(x).is_none() && is_python_number(x)).count();
    if numbers == 0 {
        return Ok(());
    }
    let mut operands: Few<Bound<'py, PyAny>> = Few::new();
    let mut scalars: Few<usize> = Few::new();
    for k in 0..schema_inputs {
        let Some(obj) = &call.inputs[k] else { continue };
        if np_ffi::as_ndarray(obj).is_some() {
            operands.push(obj.clone());
        } else if let Ok(t) = obj.cast::<PyTensor>() {
            operands.push(np_ffi::descr(py, t.get().inner.dtype()).into_any());
        } else if is_python_number(obj) {
            scalars.push(k);
        } else {
            let array = host::as_array(name, "argument", obj)?.into_any();
            operands.push(array.clone());
            call.inputs[k] = Some(array);
        }
    }
    let np = crate::convert::numpy(py)?;
    let all: Few<Bound<'py, PyAny>> =
        operands.into_iter().chain(scalars.iter().filter_map(|&k| call.inputs[k].clone())).collect();
    // numpy's refusal to combine the operands (strings, objects: `DTypePromotionError`, a
    // `TypeError`) is a typed DTypeError naming the call, with numpy's error as the cause.
    let dtype = np.call_method1(pyo3::intern!(py, "result_type"), PyTuple::new(py, all)?).map_err(|e| {
        let error = crate::errors::dtype_error(format!("{name}: the operands have no common dtype: {e}"));
        error.set_cause(py, Some(e));
        error
    })?;
    for k in scalars {
        let Some(value) = call.inputs[k].take() else { continue };
        let as_dtype = |dtype: &Bound<'py, PyAny>| {
            let kwargs = PyDict::new(py);
            kwargs.set_item(pyo3::intern!(py, "dtype"), dtype)?;
            np.call_method(pyo3::intern!(py, "asarray"), (&value,), Some(&kwargs))
        };
        let array = match as_dtype(&dtype) {
            Ok(array) => array,
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) => {
                match computed_as_float(py, entry, call, k, &dtype)? {
                    Some(float) => as_dtype(&float)?,
                    None => {
                        return Err(argument_error(format!(
                            "{name}: the Python scalar {value} does not fit the operands' dtype {dtype}: {e}"
                        )))
                    }
                }
            }
            Err(e) => return Err(e),
        };
        call.inputs[k] = Some(array);
    }
    Ok(())
}

/// The float dtype the operator converts input `k` to when every input is of the integer
/// `dtype` (true division computes int32 in float64), if it does.
fn computed_as_float<'py>(
    py: Python<'py>,
    entry: &Entry,
    call: &BoundCall<'py>,
    k: usize,
    dtype: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let num: i32 = dtype.getattr(pyo3::intern!(py, "num"))?.extract()?;
    let Some(dtype) = np_ffi::dtype_of_num(num) else { return Ok(None) };
    let metas: Few<Option<Meta>> =
        call.inputs.iter().enumerate().map(|(i, x)| (x.is_some() || i == k).then(|| Meta::new(dtype, &[]))).collect();
    let planned = entry.op.input_dtypes(&metas, &call.attrs).ok().and_then(|d| d.get(k).copied().flatten());
    Ok(planned.filter(|d| d.is_float()).map(|d| np_ffi::descr(py, d).into_any()))
}

/// A call after binding: the numpy path, or the tensor path when any argument is a `Tensor`.
/// Python numbers are weak scalars first (see [`weak_scalars`]).
fn dispatch_call<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
    mut call: BoundCall<'py>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    weak_scalars(py, entry, &mut call)?;
    if is_tensor_call(&call, out) {
        call_tensor(py, entry, call, out)
    } else {
        call_host(py, entry, call, out)
    }
}

/// A built-in operator version, looked up once: `ob.vector_add` and `ob.matmul` call exactly it
/// (built-ins are never unregistered from the default registry).
fn pinned(cell: &'static OnceLock<Arc<Entry>>, name: &str, version: u32) -> PyResult<&'static Arc<Entry>> {
    if let Some(entry) = cell.get() {
        return Ok(entry);
    }
    let entry = registry().get(name, Some(version)).map_err(to_pyerr)?;
    Ok(cell.get_or_init(|| entry))
}

/// A two-operand call of a pinned operator, without the tuple a callable object would cost
/// (`Op.__call__` receives one from CPython; a function with a fixed signature does not).
fn call_two<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(lane) = entry.op.lane() {
        if let Some(result) = try_lane(py, entry, lane, [a, b].into_iter(), out)? {
            return Ok(result);
        }
    }
    if let Some(lane) = entry.op.view_lane() {
        if let Some(result) = try_view_lane(py, entry, lane, [a, b].into_iter(), out)? {
            return Ok(result);
        }
    }
    let attrs = entry.schema().bind_attrs(std::iter::empty::<(&str, AttrValue)>()).map_err(to_pyerr)?;
    // Both operands are present whatever they are (`None` is refused as an array, as numpy
    // would refuse it), so the error is about the argument, not a missing one.
    let call = BoundCall { inputs: Few::from_iter([Some(a.clone()), Some(b.clone())]), attrs };
    dispatch_call(py, entry, call, out)
}

/// Elementwise sum of two arrays of the same shape.
///
/// Args:
///     a: numpy array (or anything numpy converts, or an ``opbridge.Tensor``).
///     b: same shape as ``a`` (no broadcasting: a Python scalar is accepted only beside a 0-d
///         array). dtypes float16, float32, float64, int32, int64; the result dtype is numpy's
///         for ``a + b`` (Python scalars are weak under numpy 2: ``float32 + 1.5`` is float32).
///     out: optional output: a ``Tensor`` or a writeable, C-contiguous ndarray of the result's
///         shape and dtype, never converted. It may be ``a`` or ``b`` itself (in-place).
///
/// Returns:
///     A new array (or ``out``). With ``Tensor`` arguments, a ``Tensor`` enqueued on the
///     current stream; the call returns at once (a numpy argument beside a ``Tensor`` is
///     copied first, so it may change as soon as the call returns).
///
/// Raises:
///     ShapeError: shapes differ, or ``out`` has the wrong shape.
///     DTypeError: an unsupported dtype, or ``out`` of the wrong dtype.
///     ArgumentError: ``out`` is not an array that can be written in place (a list, a
///         scalar, read-only, not C-contiguous), an ndarray subclass with semantics of its
///         own (``numpy.ma.MaskedArray``, ``numpy.matrix``: see the README), or a Python int
///         that does not fit the result's integer dtype.
///
/// The registered operator ``vector_add`` version 1 (``ob.ops.get("vector_add", version=1)``),
/// called through a fixed signature. Non-contiguous, byte-swapped or mixed-dtype inputs are
/// copied once (by numpy) before the kernel runs; contiguous native inputs are read in place.
/// The GIL is released for inputs of 64 KiB and more, and inputs of 128K elements and more use
/// all cores.
///
/// Example:
///     >>> import numpy as np, opbridge as ob
///     >>> a = np.arange(4, dtype=np.float32)
///     >>> ob.vector_add(a, np.ones_like(a))
///     array([1., 2., 3., 4.], dtype=float32)
#[pyfunction]
#[pyo3(signature = (a, b, out=None, device=None))]
pub fn vector_add<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    device: Option<&str>,
) -> PyResult<Bound<'py, PyAny>> {
    static ENTRY: OnceLock<Arc<Entry>> = OnceLock::new();
    let entry = pinned(&ENTRY, "vector_add", 1)?;
    let Some(device) = device else { return call_two(py, entry, a, b, out) };
    let attrs = entry.schema().bind_attrs(std::iter::empty::<(&str, AttrValue)>()).map_err(to_pyerr)?;
    match numpy_route(entry, &[a, b], out, device)? {
        Route::Device(target) => staged(py, entry, &[a, b], &attrs, out, target),
        Route::Host => call_two(py, entry, a, b, out),
    }
}

/// Where a call with `device=` runs: `"auto"` asks the hybrid table (`ob.calibrate()`'s
/// crossovers) for numpy inputs that can be staged (an elementwise operator, arrays of one
/// shape and dtype, no `out=`), and keeps everything else on the host; a device name is that
/// device (`cpu` is the host path). The route is a profiler span's `path`.
fn numpy_route(
    entry: &Entry,
    args: &[&Bound<'_, PyAny>],
    out: Option<&Bound<'_, PyAny>>,
    device: &str,
) -> PyResult<Route> {
    if device != "auto" {
        let target = crate::convert::parse_device(Some(device))?;
        return Ok(if target.kind == opbridge_runtime::DeviceKind::Cpu { Route::Host } else { Route::Device(target) });
    }
    let route = match (out, stageable(entry, args)) {
        (None, Some((dtype, elems))) => match hybrid::route(&entry.schema().name, dtype, elems) {
            // A crossover set by hand may name a dtype the device's kernel does not take.
            Route::Device(d) if !entry.runs_on(d.kind, dtype) => Route::Host,
            route => route,
        },
        _ => Route::Host,
    };
    if opbridge_runtime::profiler::active() {
        let _span = opbridge_runtime::profiler::Span::begin(
            "dispatch",
            &format!("hybrid {}", entry.schema().name),
            0,
            vec![("path", route.label().into())],
        );
    }
    Ok(route)
}

/// Where `ob.explain` says a call of `op` on `args` (with `device=`) runs, and why.
pub(crate) fn explain_route(
    op: &Bound<'_, PyAny>,
    args: &Bound<'_, PyTuple>,
    out: Option<&Bound<'_, PyAny>>,
    device: &str,
) -> PyResult<(String, String)> {
    let entry = match op.cast::<PyOp>() {
        Ok(op) => Arc::clone(&op.get().entry),
        Err(_) => {
            let name: PyBackedStr = op
                .extract()
                .map_err(|_| PyTypeError::new_err("explain: op must be an operator name or an ob.ops operator"))?;
            registry().get(&name, None).map_err(to_pyerr)?
        }
    };
    let name = entry.schema().name.clone();
    let inputs: Few<Bound<'_, PyAny>> = args.iter().collect();
    let refs: Few<&Bound<'_, PyAny>> = inputs.iter().collect();
    if device != "auto" && device != "cpu" && !device.starts_with("cpu:") {
        // What the call would refuse, said instead of a path.
        if let Some(refused) = staging_refusal(&entry, &refs) {
            return Ok(("error".into(), refused));
        }
    }
    if let Some(t) = refs.iter().find_map(|a| a.cast::<PyTensor>().ok()) {
        let at = t.get().inner.device();
        return Ok((
            at.to_string(),
            format!("{name} on Tensors runs where they live ({at}); device= is for numpy inputs"),
        ));
    }
    if !entry.devices().contains(&opbridge_runtime::DeviceKind::Cpu) {
        let has: Vec<&str> = entry.devices().iter().map(|d| d.name()).collect();
        return Ok((
            "error".into(),
            format!("{name} has no host kernel (it has kernels for: {}): call it on Tensors there", has.join(", ")),
        ));
    }
    if device != "auto" {
        return Ok(match numpy_route(&entry, &refs, out, device)? {
            Route::Host => ("host".into(), format!("{name}: device={device:?} is the host path")),
            Route::Device(d) => (d.to_string(), format!("{name}: device={device:?} stages the call through {d}")),
        });
    }
    if out.is_some() {
        return Ok(("host".into(), format!("{name}: out= is written on the host (a staged call returns a new array)")));
    }
    if entry.op.lane().is_none() {
        return Ok(("host".into(), format!("{name}: no staged device path (elementwise operators only); host")));
    }
    let Some((dtype, elems)) = stageable(&entry, &refs) else {
        return Ok((
            "host".into(),
            format!("{name}: the staged path takes numpy arrays of one shape and dtype; these run on the host"),
        ));
    };
    let (route, why) = hybrid::explain(&name, dtype, elems);
    Ok((route.label(), why))
}

/// Why a call cannot be staged through a device at all (`device=` naming one): Tensor inputs
/// (they live on a device already), or an operator that is not elementwise.
fn staging_refusal(entry: &Entry, args: &[&Bound<'_, PyAny>]) -> Option<String> {
    let name = &entry.schema().name;
    if args.iter().any(|a| a.is_instance_of::<PyTensor>()) {
        return Some(format!(
            "{name}: device= stages numpy arrays; a Tensor already lives on a device (call without device=)"
        ));
    }
    entry.op.lane().is_none().then(|| {
        format!("{name}: device= stages elementwise operators on numpy arrays; call {name} on Tensors instead")
    })
}

/// The dtype and element count of a numpy call the staged path can take (see [`staged`]):
/// an elementwise operator with a fast lane, every input a numpy array of one shape and dtype.
fn stageable(entry: &Entry, args: &[&Bound<'_, PyAny>]) -> Option<(DType, usize)> {
    let lane = entry.op.lane()?;
    let mut meta: Option<(DType, &[usize])> = None;
    for arg in args {
        let array = np_ffi::as_ndarray(arg)?;
        let dtype = np_ffi::dtype_of_num(np_ffi::layout(array).type_num)?;
        match meta {
            None => meta = Some((dtype, array.shape())),
            Some((d, shape)) if d == dtype && shape == array.shape() => {}
            Some(_) => return None,
        }
    }
    // Only what the lane serves as such (integer `pow` or `div` keep the host's own checks).
    meta.filter(|(dtype, _)| (lane.accepts)(*dtype)).map(|(dtype, shape)| (dtype, shape.iter().product()))
}

/// numpy in, numpy out, computed on an accelerator: the inputs go through the device in chunks,
/// copies overlapping the kernel (see `opbridge_ops::device::run_staged`). Elementwise calls of
/// one shape (no broadcasting); the result is a new array.
fn staged<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
    args: &[&Bound<'py, PyAny>],
    attrs: &Attrs,
    out: Option<&Bound<'py, PyAny>>,
    target: DeviceId,
) -> PyResult<Bound<'py, PyAny>> {
    let name = entry.schema().name.as_str();
    if out.is_some() {
        return Err(argument_error(format!("{name}: out= is not supported with device= (the result is a new array)")));
    }
    if let Some(refused) = staging_refusal(entry, args) {
        return Err(argument_error(refused));
    }
    let mut arrays = Vec::with_capacity(args.len());
    for (k, arg) in args.iter().enumerate() {
        arrays.push(HostArray::extract(name, ["a", "b", "c"][k.min(2)], arg, &entry.schema().dtypes)?);
    }
    let metas: Vec<Option<Meta>> = arrays.iter().map(|a| Some(Meta::new(a.dtype, a.shape()))).collect();
    let plan = dispatch::plan(entry, &metas, attrs).map_err(to_pyerr)?;
    let result = &plan.outputs[0];
    if arrays.iter().any(|a| a.shape() != result.shape.as_slice()) {
        return Err(crate::errors::shape_error(format!(
            "{name}: device= stages elementwise calls of one shape; got shapes {:?}",
            arrays.iter().map(|a| a.shape().to_vec()).collect::<Vec<_>>()
        )));
    }
    let ctx = DeviceContext::get(target).map_err(to_pyerr)?;
    let mut normalized = Vec::with_capacity(arrays.len());
    for (array, dtype) in arrays.into_iter().zip(&plan.inputs) {
        let dtype = dtype.unwrap_or(array.dtype);
        normalized.push((array.normalized(dtype)?, dtype));
    }
    let inputs: Vec<(&[u8], DType)> =
        normalized.iter().map(|(a, d)| np_ffi::contiguous_bytes(&a.array).map(|b| (b, *d))).collect::<PyResult<_>>()?;
    let len = result.shape.iter().product();
    let array = np_ffi::filled_array(py, result.dtype, &result.shape, |bytes| {
        opbridge_ops::device::run_staged(entry, ctx, attrs, &inputs, (bytes, result.dtype), len)
            .map(drop)
            .map_err(to_pyerr)
    })?;
    Ok(array.into_any())
}

/// Matrix product of two 2-D float arrays: ``(m, k) @ (k, n) -> (m, n)``.
///
/// Args:
///     a, b: 2-D arrays of float16, float32 or float64 (mixed dtypes promote as numpy does);
///         any strides (transposed views are read in place).
///     out: optional writeable C-contiguous ``(m, n)`` array of the result dtype; it may
///         overlap the inputs (the product is then computed aside and copied in).
///
/// The registered operator ``matmul`` version 1 (``ob.ops.matmul`` is version 2, numpy's ``@``
/// with batches), called through a fixed signature. Uses a packed SIMD GEMM (the ``gemm``
/// crate) on all cores for large products; float16 accumulates in float32. The GIL is released
/// while it runs.
///
/// Example:
///     >>> import numpy as np, opbridge as ob
///     >>> ob.matmul(np.eye(2, dtype=np.float32), np.ones((2, 3), np.float32))
///     array([[1., 1., 1.],
///            [1., 1., 1.]], dtype=float32)
#[pyfunction]
#[pyo3(signature = (a, b, out=None))]
pub fn matmul<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    static ENTRY: OnceLock<Arc<Entry>> = OnceLock::new();
    call_two(py, pinned(&ENTRY, "matmul", 1)?, a, b, out)
}

#[pymethods]
impl PyOp {
    #[getter]
    fn name(&self) -> String {
        self.entry.schema().name.clone()
    }

    #[getter]
    fn version(&self) -> u32 {
        self.entry.schema().version
    }

    /// ``"built-in"`` or the path of the library that registered it.
    #[getter]
    fn source(&self) -> String {
        self.entry.source.to_string()
    }

    /// The Python-style signature, e.g. ``add(a, b, *, out=None)``.
    #[getter]
    fn signature(&self) -> String {
        self.entry.schema().signature()
    }

    /// The schema as a dict: inputs, outputs, attributes with defaults, dtypes.
    #[getter]
    fn schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.entry.schema();
        let dict = PyDict::new(py);
        dict.set_item("name", &s.name)?;
        dict.set_item("version", s.version)?;
        dict.set_item("doc", &s.doc)?;
        dict.set_item("inputs", s.inputs.iter().map(|i| (i.name.clone(), i.optional)).collect::<Vec<_>>())?;
        dict.set_item("outputs", s.outputs.clone())?;
        let attrs = PyList::empty(py);
        for a in &s.attrs {
            let default = match &a.default {
                Some(v) => attr_to_py(py, v)?,
                None => py.None().into_bound(py),
            };
            attrs.append((a.name.clone(), default, a.default.is_none(), a.doc.clone()))?;
        }
        dict.set_item("attrs", attrs)?;
        dict.set_item("dtypes", s.dtypes.iter().map(|d| d.name()).collect::<Vec<_>>())?;
        // Per input, the dtypes it takes (narrower than `dtypes` for an index input, say).
        let per_input: Vec<Vec<&str>> =
            s.inputs.iter().map(|i| i.dtypes(&s.dtypes).iter().map(|d| d.name()).collect()).collect();
        dict.set_item("input_dtypes", per_input)?;
        Ok(dict)
    }

    #[pyo3(signature = (*args, out=None, device=None, **kwargs))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        out: Option<&Bound<'py, PyAny>>,
        device: Option<&Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(device) = device {
            if let Some(result) = self.call_on(py, args, out, device, kwargs)? {
                return Ok(result);
            }
            // Routed to the host: the call as without `device=`.
        }
        if kwargs.is_none() {
            if let Some(result) = fast_lanes(py, &self.entry, || args.iter_borrowed(), out)? {
                return Ok(result);
            }
        }
        let call = bind(&self.entry, args, kwargs)?;
        dispatch_call(py, &self.entry, call, out)
    }

    fn __repr__(&self) -> String {
        let s = self.entry.schema();
        format!("<opbridge op {} v{} ({})>", s.name, s.version, self.entry.source)
    }
}

impl PyOp {
    /// A call with `device=`: numpy inputs staged through that device, or routed by the hybrid
    /// table (`"auto"`); see [`numpy_route`]. `None` when the call runs on the host, which the
    /// caller then makes as without `device=` (its fast lanes included). An operator with an
    /// attribute of its own named `device` gets the value as that attribute.
    fn call_on<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        out: Option<&Bound<'py, PyAny>>,
        device: &Bound<'py, PyAny>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let entry = &self.entry;
        if entry.schema().attrs.iter().any(|a| a.name == "device") {
            let kwargs = match kwargs {
                Some(k) => k.copy()?,
                None => PyDict::new(py),
            };
            kwargs.set_item("device", device)?;
            let call = bind(entry, args, Some(&kwargs))?;
            return dispatch_call(py, entry, call, out).map(Some);
        }
        let name = &entry.schema().name;
        let device = device
            .cast::<PyString>()
            .map_err(|_| argument_error(format!("{name}: device= takes a device name (\"ascend:0\") or \"auto\"")))?;
        // A literal "auto" is the interned string: found by its address, without decoding it.
        let device: &str = if device.is(pyo3::intern!(py, "auto")) { "auto" } else { device.to_str()? };
        // The inputs: the positional arguments when that is all there is (no binding needed).
        let call = match kwargs {
            None if args.len() == entry.schema().inputs.len() => None,
            _ => Some(bind(entry, args, kwargs)?),
        };
        let inputs: Few<Bound<'py, PyAny>> = match &call {
            None => args.iter().collect(),
            Some(call) => call.inputs.iter().flatten().cloned().collect(),
        };
        let refs: Few<&Bound<'py, PyAny>> = inputs.iter().collect();
        let Route::Device(target) = numpy_route(entry, &refs, out, device)? else { return Ok(None) };
        let call = match call {
            Some(call) => call,
            None => bind(entry, args, kwargs)?,
        };
        if inputs.len() != call.inputs.len() {
            return Err(argument_error(format!("{name}: device= stages calls with every input given")));
        }
        staged(py, entry, &refs, &call.attrs, out, target).map(Some)
    }
}

/// The operator `name` at `version` (latest when omitted). Unknown names or versions raise
/// ``OpBridgeError`` listing what exists.
#[pyfunction]
#[pyo3(signature = (name, version=None))]
pub fn get_op<'py>(py: Python<'py>, name: &str, version: Option<&Bound<'_, PyAny>>) -> PyResult<Bound<'py, PyOp>> {
    let version = match version {
        None => None,
        Some(v) => Some(crate::convert::int_arg("version", v, 0, u32::MAX.into())? as u32),
    };
    PyOp::new_bound(py, registry().get(name, version).map_err(to_pyerr)?)
}

/// A counter that changes whenever an operator is registered or unregistered (lets the Python
/// layer cache `Op` objects).
#[pyfunction]
pub fn registry_generation() -> u64 {
    registry().generation()
}

/// Every registered operator: a list of dicts with ``name``, ``versions``, and per version its
/// ``source``, ``dtypes`` and ``devices``.
#[pyfunction]
pub fn list_ops<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for info in registry().list() {
        let dict = PyDict::new(py);
        dict.set_item("name", &info.name)?;
        dict.set_item("versions", info.versions.iter().map(|v| v.0).collect::<Vec<_>>())?;
        let latest = info.versions.last().expect("a listed operator has a version");
        dict.set_item("source", latest.1.to_string())?;
        dict.set_item("dtypes", latest.2.iter().map(|d| d.name()).collect::<Vec<_>>())?;
        dict.set_item("devices", latest.3.iter().map(|d| d.name()).collect::<Vec<_>>())?;
        let per_version = PyDict::new(py);
        for (version, source, dtypes, devices) in &info.versions {
            let v = PyDict::new(py);
            v.set_item("source", source.to_string())?;
            v.set_item("dtypes", dtypes.iter().map(|d: &DType| d.name()).collect::<Vec<_>>())?;
            v.set_item("devices", devices.iter().map(|d| d.name()).collect::<Vec<_>>())?;
            per_version.set_item(version, v)?;
        }
        dict.set_item("by_version", per_version)?;
        list.append(dict)?;
    }
    Ok(list)
}
