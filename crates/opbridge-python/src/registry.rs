//! Registered operators from Python: `ob.ops.<name>(...)`, `ob.ops.get(name, version=...)` and
//! `ob.list_ops()`. One generic call path serves every operator, built-in or loaded: numpy
//! arrays run synchronously on their buffers, `Tensor`s are enqueued on the current stream.

use std::sync::Arc;

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use opbridge_ops::registry::{Entry, Lane, Registry};
use opbridge_ops::{overlap, AttrValue, Attrs, Meta, Overlap, TensorView};
use opbridge_runtime::{DType, DeviceContext, Tensor};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList, PyTuple};

use smallvec::SmallVec;

use crate::errors::{argument_error, device_error, dtype_error, shape_error, to_pyerr};
use crate::ffi::numpy as np_ffi;
use crate::host::{self, check_out, new_output, HostArray};
use crate::tensor::{as_out_tensor, as_tensor, PyTensor};

/// One version of a registered operator, callable like a function.
#[pyclass(name = "Op", module = "opbridge", frozen, dict)]
#[derive(Debug)]
pub struct PyOp {
    entry: Arc<Entry>,
}

fn registry() -> &'static Registry {
    Registry::global()
}

/// A Python value as an attribute value.
fn attr_value(value: &Bound<'_, PyAny>) -> PyResult<AttrValue> {
    if value.is_none() {
        return Ok(AttrValue::None);
    }
    // Type checks first: a failed `extract` builds a Python exception, which costs more than
    // the whole call. bool before int: Python's bool is an int.
    if let Ok(b) = value.cast::<pyo3::types::PyBool>() {
        return Ok(AttrValue::Bool(b.is_true()));
    }
    if value.is_instance_of::<pyo3::types::PyInt>() {
        return Ok(AttrValue::Int(value.extract()?));
    }
    if value.is_instance_of::<pyo3::types::PyFloat>() {
        return Ok(AttrValue::Float(value.extract()?));
    }
    if let Ok(s) = value.cast::<pyo3::types::PyString>() {
        return Ok(AttrValue::Str(s.to_str()?.to_string()));
    }
    // numpy scalars and other int- or float-likes (rare: the failed attempts are fine here).
    if let Ok(i) = value.extract::<i64>() {
        return Ok(AttrValue::Int(i));
    }
    if let Ok(x) = value.extract::<f64>() {
        return Ok(AttrValue::Float(x));
    }
    if let Ok(v) = value.extract::<Vec<i64>>() {
        return Ok(AttrValue::Ints(v));
    }
    // numpy dtypes and scalar types (`dtype=np.float32`) travel by name.
    if let Ok(descr) = host::numpy(value.py())?.call_method1("dtype", (value,)) {
        return Ok(AttrValue::Str(descr.getattr("name")?.extract()?));
    }
    Err(argument_error(format!("unsupported argument value {value} of type {}", value.get_type().name()?)))
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
                None => attrs.push((key, attr_value(&value)?)),
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

/// Kernels write every output at once: two outputs sharing memory would be a data race.
fn check_outputs_disjoint(name: &str, outputs: &[TensorView]) -> PyResult<()> {
    for (i, a) in outputs.iter().enumerate() {
        for b in &outputs[i + 1..] {
            if overlap(a.byte_span(), b.byte_span()) != Overlap::Disjoint {
                return Err(argument_error(format!("{name}: out arrays must not overlap each other")));
            }
        }
    }
    Ok(())
}

/// The elementwise fast lane (see `opbridge_ops::registry::Lane`): every argument a plain
/// C-contiguous, aligned, native ndarray of one dtype and shape, no attributes, and `out`
/// (when given) of the same kind and either disjoint from the inputs or one of them. Returns
/// `None` when the call does not qualify: the generic path then handles it, errors included.
fn try_lane<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
    lane: &Lane,
    args: &Bound<'py, PyTuple>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    const MAX_INPUTS: usize = 4;
    let n = args.len();
    if n != entry.schema().inputs.len() || n == 0 || n > MAX_INPUTS {
        return Ok(None);
    }
    let mut addresses = [0usize; MAX_INPUTS];
    let mut first: Option<(DType, Bound<'py, PyUntypedArray>)> = None;
    for (k, arg) in args.iter().enumerate() {
        let Some(array) = np_ffi::as_ndarray(&arg) else { return Ok(None) };
        let layout = np_ffi::layout(array);
        if !(layout.is_c_contiguous() && layout.is_aligned() && layout.is_native()) {
            return Ok(None);
        }
        let Some(dtype) = np_ffi::dtype_of_num(layout.type_num) else { return Ok(None) };
        match &first {
            None => first = Some((dtype, array.clone())),
            Some((d, a)) if *d == dtype && a.shape() == array.shape() => {}
            Some(_) => return Ok(None),
        }
        addresses[k] = layout.data;
    }
    let Some((dtype, model)) = first else { return Ok(None) };
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
            let Some(array) = np_ffi::as_ndarray(given) else { return Ok(None) };
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
    let guard = entry.enter_scoped();
    let inputs = &addresses[..n];
    host::run(py, bytes * (n + 1), || (lane.run)(dtype, inputs, out_address, len)).map_err(to_pyerr)?;
    drop(guard);
    Ok(Some(result))
}

/// The synchronous numpy path.
fn call_host<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
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
    let wanted = entry.op.input_dtypes(&metas, &call.attrs).map_err(to_pyerr)?;
    let outputs = entry.op.infer(&metas, &call.attrs).map_err(to_pyerr)?;
    // Inputs the kernel can read in place are kept (any strides); the others are copied once.
    let mut inputs: Few<Option<HostArray<'py>>> = Few::new();
    for (array, dtype) in arrays.into_iter().zip(&wanted) {
        inputs.push(match (array, dtype) {
            (Some(a), Some(dtype)) => {
                let size = dtype.size() as isize;
                let readable = a.dtype == *dtype
                    && a.is_native()
                    && a.layout().is_aligned()
                    && a.array.strides().iter().all(|s| s % size == 0);
                Some(if readable { a } else { a.normalized(*dtype)? })
            }
            _ => None,
        });
    }
    let views: Few<Option<TensorView>> = inputs.iter().map(|a| a.as_ref().map(view_of)).collect();
    // Outputs: the caller's (validated) or new ones; computed aside when they overlap inputs.
    let given = out_list(name, out, outputs.len())?;
    let mut results: Few<HostArray<'py>> = Few::new();
    let mut copy_back: Vec<(usize, HostArray<'py>)> = Vec::new();
    for (k, meta) in outputs.iter().enumerate() {
        let Some(given) = &given else {
            results.push(new_output(py, meta.dtype, &meta.shape)?);
            continue;
        };
        let target = check_out(name, &given[k])?;
        if target.shape() != meta.shape.as_slice() {
            return Err(shape_error(format!(
                "{name}: expected out of shape {:?}, got {:?}",
                meta.shape,
                target.shape()
            )));
        }
        if target.dtype != meta.dtype {
            return Err(dtype_error(format!("{name}: expected out of dtype {}, got {}", meta.dtype, target.dtype)));
        }
        let target_view = view_of(&target);
        let clash = views.iter().flatten().any(|v| {
            overlap(v.byte_span(), target_view.byte_span()) != Overlap::Disjoint
                && !(entry.op.in_place_ok() && *v == target_view)
        });
        if clash {
            results.push(new_output(py, meta.dtype, &meta.shape)?);
            copy_back.push((k, target));
        } else {
            results.push(target);
        }
    }
    let out_views: Few<TensorView> = results.iter().map(view_of).collect();
    check_outputs_disjoint(name, &out_views)?;
    let bytes: usize = out_views.iter().chain(views.iter().flatten()).map(|v| v.numel() * v.dtype.size()).sum();
    let guard = entry.enter_scoped();
    let attrs = &call.attrs;
    host::run(py, bytes, || guard.entry().op.run_cpu(&views, &out_views, attrs)).map_err(to_pyerr)?;
    drop(guard);
    for (k, target) in copy_back {
        host::numpy(py)?.call_method1("copyto", (&target.array, &results[k].array))?;
        results[k] = target;
    }
    if results.len() == 1 {
        return Ok(results.remove(0).array.into_any());
    }
    Ok(PyTuple::new(py, results.into_iter().map(|r| r.array.into_any()))?.into_any())
}

/// The async path: tensors in, tensors out, enqueued on the current stream.
fn call_tensor<'py>(
    py: Python<'py>,
    entry: &Arc<Entry>,
    call: BoundCall<'py>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let schema = entry.schema();
    let name = schema.name.as_str();
    let mut tensors: Vec<Option<Arc<Tensor>>> = Vec::with_capacity(call.inputs.len());
    for input in &call.inputs {
        tensors.push(match input {
            Some(obj) => Some(Arc::clone(&as_tensor(name, obj)?.inner)),
            None => None,
        });
    }
    let device = tensors.iter().flatten().next().map(|t| t.device()).unwrap_or(opbridge_runtime::DeviceId::CPU);
    if let Some(t) = tensors.iter().flatten().find(|t| t.device() != device) {
        return Err(device_error(format!("{name}: expected all tensors on {device}, got one on {}", t.device())));
    }
    for (spec, t) in schema.inputs.iter().zip(&tensors) {
        if let Some(t) = t.as_ref().filter(|t| !schema.dtypes.contains(&t.dtype())) {
            let names: Vec<&str> = schema.dtypes.iter().map(|d| d.name()).collect();
            return Err(dtype_error(format!(
                "{name}: expected {} of dtype {}, got {}",
                spec.name,
                names.join(", "),
                t.dtype()
            )));
        }
    }
    let ctx = DeviceContext::get(device).map_err(to_pyerr)?;
    let stream = ctx.current_stream().map_err(to_pyerr)?;
    let metas: Vec<Option<Meta>> =
        tensors.iter().map(|t| t.as_ref().map(|t| Meta::new(t.dtype(), t.shape()))).collect();
    let wanted = entry.op.input_dtypes(&metas, &call.attrs).map_err(to_pyerr)?;
    let outputs = entry.op.infer(&metas, &call.attrs).map_err(to_pyerr)?;
    let mut inputs: Vec<Option<Arc<Tensor>>> = Vec::with_capacity(tensors.len());
    for (t, dtype) in tensors.iter().zip(&wanted) {
        inputs.push(match (t, dtype) {
            (Some(t), Some(d)) => Some(py.detach(|| opbridge_ops::contiguous(t, *d, &stream)).map_err(to_pyerr)?),
            _ => None,
        });
    }
    let given = out_list(name, out, outputs.len())?;
    let mut results: Vec<Arc<Tensor>> = Vec::with_capacity(outputs.len());
    for (k, meta) in outputs.iter().enumerate() {
        match &given {
            Some(given) => {
                let target = as_out_tensor(name, &given[k])?;
                if target.read_only {
                    return Err(argument_error(format!("{name}: out is read-only")));
                }
                let t = &target.inner;
                if t.shape() != meta.shape.as_slice() {
                    return Err(shape_error(format!(
                        "{name}: expected out of shape {:?}, got {:?}",
                        meta.shape,
                        t.shape()
                    )));
                }
                if t.dtype() != meta.dtype {
                    return Err(dtype_error(format!(
                        "{name}: expected out of dtype {}, got {}",
                        meta.dtype,
                        t.dtype()
                    )));
                }
                if !t.is_contiguous() {
                    return Err(argument_error(format!("{name}: expected a contiguous out")));
                }
                results.push(Arc::clone(t));
            }
            None => results.push(Arc::new(
                py.detach(|| Tensor::empty(ctx, &meta.shape, meta.dtype, stream.id())).map_err(to_pyerr)?,
            )),
        }
    }
    // An output overlapping an input (other than an exact in-place alias) is computed aside.
    let views: Vec<Option<TensorView>> = inputs.iter().map(|t| t.as_ref().map(|t| TensorView::of_tensor(t))).collect();
    let mut targets: Vec<Arc<Tensor>> = Vec::with_capacity(results.len());
    for result in &results {
        let view = TensorView::of_tensor(result);
        let clash = views.iter().flatten().any(|v| {
            overlap(v.byte_span(), view.byte_span()) != Overlap::Disjoint && !(entry.op.in_place_ok() && *v == view)
        });
        targets.push(if clash {
            Arc::new(py.detach(|| Tensor::empty(ctx, result.shape(), result.dtype(), stream.id())).map_err(to_pyerr)?)
        } else {
            Arc::clone(result)
        });
    }
    let out_views: Vec<TensorView> = targets.iter().map(|t| TensorView::of_tensor(t)).collect();
    check_outputs_disjoint(name, &out_views)?;
    let guard = entry.enter();
    let attrs = call.attrs.clone();
    let reads: Vec<&Tensor> = inputs.iter().flatten().map(|t| t.as_ref()).collect();
    let writes: Vec<&Tensor> = targets.iter().map(|t| t.as_ref()).collect();
    Tensor::launch(
        &stream,
        &reads,
        &writes,
        Box::new(move || {
            // The guard lives until the kernel has run: an unload waits for it.
            guard.entry().op.run_cpu(&views, &out_views, &attrs).map_err(|e| e.to_string())
        }),
    )
    .map_err(to_pyerr)?;
    for (result, target) in results.iter().zip(&targets) {
        if !Arc::ptr_eq(result, target) {
            opbridge_ops::copy_tensor(target, result, &stream).map_err(to_pyerr)?;
        }
    }
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
        Ok(dict)
    }

    #[pyo3(signature = (*args, out=None, **kwargs))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        out: Option<&Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let (None, Some(lane)) = (kwargs, self.entry.op.lane()) {
            if let Some(result) = try_lane(py, &self.entry, lane, args, out)? {
                return Ok(result);
            }
        }
        let call = bind(&self.entry, args, kwargs)?;
        if is_tensor_call(&call, out) {
            call_tensor(py, &self.entry, call, out)
        } else {
            call_host(py, &self.entry, call, out)
        }
    }

    fn __repr__(&self) -> String {
        let s = self.entry.schema();
        format!("<opbridge op {} v{} ({})>", s.name, s.version, self.entry.source)
    }
}

/// The operator `name` at `version` (latest when omitted). Unknown names or versions raise
/// ``OpBridgeError`` listing what exists.
#[pyfunction]
#[pyo3(signature = (name, version=None))]
pub fn get_op(name: &str, version: Option<u32>) -> PyResult<PyOp> {
    Ok(PyOp { entry: registry().get(name, version).map_err(to_pyerr)? })
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
