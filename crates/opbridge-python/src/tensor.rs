//! `opbridge.Tensor` and the functions that make tensors (`asarray`, `empty`, `zeros`,
//! `from_dlpack`).

use std::sync::Arc;

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use opbridge_runtime::{CopyKind, DType, DeviceContext, DeviceId, DevicePtr, Storage, Tensor};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::convert::{parse_device, parse_dtype};
use crate::errors::{argument_error, device_error, to_pyerr};
use crate::ffi::{dlpack, numpy as np_ffi};
use crate::host::HostArray;

/// An n-dimensional array on an opbridge device, in pooled device memory.
///
/// Work on tensors is asynchronous: operators enqueue on the current stream and return a new
/// ``Tensor`` at once. Reading the data on the host (``numpy()``, ``__array__``, DLPack
/// export) waits for the work that produces it.
///
/// Example:
///     >>> import numpy as np, opbridge as ob
///     >>> t = ob.asarray(np.arange(3, dtype=np.float32))
///     >>> ob.vector_add(t, t).numpy()
///     array([0., 2., 4.], dtype=float32)
#[pyclass(name = "Tensor", module = "opbridge", frozen)]
#[derive(Debug)]
pub struct PyTensor {
    pub inner: Arc<Tensor>,
    /// Imported from a producer that marked its memory read-only (DLPack flag).
    pub read_only: bool,
}

impl PyTensor {
    pub fn new(inner: Arc<Tensor>) -> PyTensor {
        PyTensor { inner, read_only: false }
    }
}

impl np_ffi::TensorOwner for PyTensor {
    fn tensor(&self) -> &Arc<Tensor> {
        &self.inner
    }

    fn read_only(&self) -> bool {
        self.read_only
    }
}

/// Strides in bytes, as numpy reports them.
fn byte_strides(t: &Tensor) -> Vec<isize> {
    t.strides().iter().map(|&s| s * t.dtype().size() as isize).collect()
}

#[pymethods]
impl PyTensor {
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.shape())
    }

    /// The element type, as a ``numpy.dtype``.
    #[getter]
    fn dtype<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        np_ffi::descr(py, self.inner.dtype()).into_any()
    }

    /// The device, e.g. ``"cpu:0"``.
    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    #[getter]
    fn ndim(&self) -> usize {
        self.inner.shape().len()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.numel()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// Strides in bytes, like ``numpy.ndarray.strides``.
    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, byte_strides(&self.inner))
    }

    /// Address of the first element (for interop and debugging).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.inner.data_ptr().0
    }

    fn __len__(&self) -> PyResult<usize> {
        self.inner
            .shape()
            .first()
            .copied()
            .ok_or_else(|| pyo3::exceptions::PyTypeError::new_err("len() of a 0-d tensor"))
    }

    fn __repr__(&self) -> String {
        let shape: Vec<String> = self.inner.shape().iter().map(usize::to_string).collect();
        let comma = if shape.len() == 1 { "," } else { "" };
        format!(
            "Tensor(shape=({}{comma}), dtype={}, device='{}')",
            shape.join(", "),
            self.inner.dtype(),
            self.inner.device()
        )
    }

    /// Waits for the work that produces this tensor.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let inner = Arc::clone(&self.inner);
        py.detach(|| inner.wait_ready()).map_err(to_pyerr)
    }

    /// True when no enqueued work still writes this tensor (on an accelerator: nor work queued
    /// after that write on its stream, whose end is only marked).
    fn is_ready(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.is_ready())
    }

    /// A numpy array sharing this tensor's memory (CPU device), after waiting for the work that
    /// produces it; the array keeps the tensor alive. On a device whose memory the host cannot
    /// read (an accelerator), a new array filled by a device-to-host copy, which reports a
    /// failure of the work that produced the tensor.
    fn numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyUntypedArray>> {
        let py = slf.py();
        let this = slf.get();
        let inner = Arc::clone(&this.inner);
        let ctx = DeviceContext::get(inner.device()).map_err(to_pyerr)?;
        if !ctx.device().host_accessible() {
            return download(py, &inner, ctx);
        }
        py.detach(|| inner.wait_ready()).map_err(to_pyerr)?;
        np_ffi::tensor_array(slf)
    }

    /// numpy's array protocol (numpy 2): the tensor's memory as an array, after waiting for
    /// the work that produces it. ``copy=None`` copies only for a ``dtype`` conversion,
    /// ``copy=True`` always returns a new array, ``copy=False`` never copies and raises
    /// ``ValueError`` when ``dtype`` would need a conversion.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let own = np_ffi::descr(py, slf.get().inner.dtype()).into_any();
        let target = match dtype {
            None => None,
            Some(d) => Some(crate::convert::numpy(py)?.call_method1("dtype", (d,))?),
        };
        // numpy's dtype equality is equivalence ('<f4' == float32, '>f4' != float32).
        let convert = match &target {
            Some(t) => !t.eq(&own)?,
            None => false,
        };
        if convert && copy == Some(false) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "Unable to avoid copy while creating an array as requested: the tensor is {}, \
                 the array must be {} (copy=False)",
                own.str()?,
                target.as_ref().map_or(Ok(String::new()), |t| t.str().map(|s| s.to_string()))?
            )));
        }
        let device = slf.get().inner.device();
        if copy == Some(false) && !DeviceContext::get(device).map_err(to_pyerr)?.device().host_accessible() {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "Unable to avoid copy while creating an array as requested: the tensor is on {device}, whose \
                 memory is not host memory (copy=False)"
            )));
        }
        let view = Self::numpy(slf)?.into_any();
        match (convert, copy) {
            // astype always returns a new array unless told copy=False.
            (true, _) => view.call_method1("astype", (target.as_ref().unwrap_or(&own),)),
            (false, Some(true)) => view.call_method0("copy"),
            (false, _) => Ok(view),
        }
    }

    /// DLPack export (zero-copy). Waits for pending work first, so consumers on any stream see
    /// the data.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = max_version;
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "__dlpack__(copy=True) is not supported; use numpy() and copy",
            ));
        }
        let device = self.inner.device();
        let dl_device = match dl_device {
            Some(d) if !d.is_none() => {
                let pair: Vec<Bound<'py, PyAny>> =
                    d.extract()
                        .ok()
                        .filter(|p: &Vec<Bound<'py, PyAny>>| p.len() == 2)
                        .ok_or_else(|| argument_error("dl_device must be a (device_type, device_id) pair".into()))?;
                let int = |what: &str, v: &Bound<'py, PyAny>| {
                    crate::convert::int_arg(what, v, i32::MIN.into(), i32::MAX.into()).map(|v| v as i32)
                };
                Some((int("dl_device[0]", &pair[0])?, int("dl_device[1]", &pair[1])?))
            }
            _ => None,
        };
        if let Some((kind, index)) = dl_device {
            if (kind, index) != (device.kind.dlpack_code(), device.index as i32) {
                return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                    "cannot export a tensor on {device} to DLPack device {kind}:{index}"
                )));
            }
        }
        // Device memory goes only to a consumer that says it handles this device (it names
        // it in `dl_device`, or hands over its stream): a host consumer such as numpy would
        // read addresses the host cannot touch.
        let asked = dl_device == Some((device.kind.dlpack_code(), device.index as i32));
        let host = DeviceContext::get(device).map_err(to_pyerr)?.device().host_accessible();
        if !host && !asked && stream.is_none_or(|s| s.is_none()) {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "the tensor is on {device}, whose memory is not host memory: copy it with .numpy() or .to('cpu'), \
                 or pass dl_device={:?} from a consumer of that device",
                (device.kind.dlpack_code(), device.index)
            )));
        }
        let inner = Arc::clone(&self.inner);
        py.detach(|| inner.wait_ready()).map_err(to_pyerr)?;
        dlpack::export(py, Arc::clone(&self.inner))
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        let device = self.inner.device();
        (device.kind.dlpack_code(), device.index as i32)
    }

    /// This tensor on `device` (itself when it is already there).
    fn to<'py>(slf: &Bound<'py, Self>, device: &str) -> PyResult<Bound<'py, Self>> {
        let target = parse_device(Some(device))?;
        if target == slf.get().inner.device() {
            return Ok(slf.clone());
        }
        let ctx = DeviceContext::get(target).map_err(to_pyerr)?;
        let inner = Arc::clone(&slf.get().inner);
        let copy = slf.py().detach(|| inner.to_device(ctx)).map_err(to_pyerr)?;
        Bound::new(slf.py(), PyTensor::new(Arc::new(copy)))
    }

    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("opbridge._aio")?.call_method1("wait_tensor", (slf,))?.call_method0("__await__")
    }
}

/// A tensor input made from a numpy argument: a private snapshot in `dtype` taken at the call
/// (what a host-to-device copy from pageable memory does in CUDA), since the kernel runs later
/// on a stream and the caller may change or drop the array as soon as the call returns.
/// Broadcast axes stay broadcast (see [`HostArray::snapshot`]).
pub fn input_tensor(op: &str, host: HostArray<'_>, dtype: DType) -> PyResult<PyTensor> {
    let snapshot = host.snapshot(dtype)?;
    wrap_host_array(op, &snapshot)
}

/// An `out=` tensor: an `opbridge.Tensor`, or a numpy array wrapped zero-copy (host memory is
/// the CPU device's memory) that must be writable in place as it is (the numpy path's
/// [`host::check_out`](crate::host::check_out) rules); callers synchronize before returning it.
/// Anything else (a list, a scalar, an object with `__array__`) is an `ArgumentError`: the
/// result would be lost in a temporary.
pub fn as_out_tensor<'py>(op: &str, obj: &Bound<'py, PyAny>) -> PyResult<PyRef<'py, PyTensor>> {
    if let Ok(tensor) = obj.cast::<PyTensor>() {
        let tensor = tensor.borrow();
        if tensor.read_only {
            return Err(argument_error(format!("{op}: out is read-only")));
        }
        return Ok(tensor);
    }
    if np_ffi::as_ndarray(obj).is_none() {
        return Err(argument_error(format!(
            "{op}: expected out to be an opbridge.Tensor or a numpy.ndarray, got {}",
            obj.get_type().name()?
        )));
    }
    let host = crate::host::check_out(op, obj)?;
    let tensor = wrap_host_array(op, &host)?;
    Ok(Bound::new(obj.py(), tensor)?.borrow())
}

/// Owner that keeps a numpy array alive while a tensor borrows its memory.
struct HostOwner(#[allow(dead_code)] Py<PyAny>);

fn wrap_host_array(op: &str, host: &HostArray<'_>) -> PyResult<PyTensor> {
    let layout = host.layout();
    let size = host.dtype.size() as isize;
    let strides: Vec<isize> = host.array.strides().iter().map(|s| s / size).collect();
    if host.array.strides().iter().any(|s| s % size != 0 || *s < 0) || !layout.is_aligned() {
        return Err(argument_error(format!(
            "{op}: expected a numpy array with non-negative strides and aligned data, got strides {:?}; \
             pass a contiguous copy",
            host.array.strides()
        )));
    }
    let n = host.array.len();
    let reach: isize = if n == 0 {
        0
    } else {
        host.shape().iter().zip(&strides).map(|(&d, &s)| (d as isize - 1) * s).sum::<isize>() + 1
    };
    let storage = Storage::External {
        ptr: DevicePtr(layout.data),
        len: reach as usize * size as usize,
        device: DeviceId::CPU,
        owner: Box::new(HostOwner(host.array.clone().into_any().unbind())),
    };
    let tensor =
        Tensor::from_storage(Arc::new(storage), DeviceId::CPU, host.dtype, host.shape().to_vec(), Some(strides), 0)
            .map_err(to_pyerr)?;
    Ok(PyTensor { inner: Arc::new(tensor), read_only: !layout.is_writeable() })
}

/// Copies `obj` (a numpy array or anything numpy converts) into a new tensor in the device's
/// pool. A ``Tensor`` on the same device and dtype is returned as is.
///
/// Example:
///     >>> t = ob.asarray(np.ones(3, np.float32)); t.shape, t.device
///     ((3,), 'cpu:0')
#[pyfunction]
#[pyo3(signature = (obj, dtype=None, device=None))]
pub fn asarray<'py>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    device: Option<&str>,
) -> PyResult<Bound<'py, PyTensor>> {
    let target = parse_device(device)?;
    let wanted = dtype.map(|d| parse_dtype(py, Some(d))).transpose()?;
    if let Ok(tensor) = obj.cast::<PyTensor>() {
        let inner = &tensor.get().inner;
        if inner.device() == target && wanted.is_none_or(|d| d == inner.dtype()) {
            return Ok(tensor.clone());
        }
        if inner.device() != target && wanted.is_none_or(|d| d == inner.dtype()) {
            // Another device: a copy, as `.to(device)` makes.
            return PyTensor::to(tensor, &target.to_string());
        }
    }
    // With a dtype, objects numpy must convert (lists, scalars, buffers, arrays of a dtype
    // opbridge has no kernel for) are converted by numpy to it directly, with numpy's checks:
    // `[2**40]` as int32 is an error, never a wrapped value. Arrays of a supported dtype are
    // converted below, into the tensor, after its allocation (a huge broadcast view fails first).
    let converted;
    let obj = match wanted {
        Some(dtype) if !is_supported_ndarray(obj) => {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", np_ffi::descr(py, dtype))?;
            converted = crate::convert::numpy(py)?.call_method("asarray", (obj,), Some(&kwargs)).map_err(|e| {
                let error = argument_error(format!("asarray: obj cannot be converted to {dtype}: {e}"));
                error.set_cause(py, Some(e));
                error
            })?;
            &converted
        }
        _ => obj,
    };
    let host = HostArray::extract("asarray", "obj", obj, &DType::ALL)?;
    let dtype = wanted.unwrap_or(host.dtype);
    let ctx = DeviceContext::get(target).map_err(to_pyerr)?;
    let stream = ctx.current_stream().map_err(to_pyerr)?;
    // Allocated before anything is copied: a huge input (a broadcast view of a few elements
    // that is terabytes logically) fails here, at no cost.
    let shape = host.shape().to_vec();
    let tensor = py.detach(|| Tensor::empty(ctx, &shape, dtype, stream.id())).map_err(to_pyerr)?;
    let layout = host.layout();
    let ready = host.dtype == dtype && layout.is_c_contiguous() && layout.is_aligned() && host.is_native();
    if !ctx.device().host_accessible() {
        // Memory the host cannot write is filled from one normalized host copy, staged through
        // pinned memory; waited for, so the array may change as soon as asarray returns.
        let host = host.normalized(dtype)?;
        let bytes = np_ffi::contiguous_bytes(&host.array)?;
        py.detach(|| tensor.upload(&stream, bytes)).map_err(to_pyerr)?;
        return Bound::new(py, PyTensor::new(Arc::new(tensor)));
    }
    if ready {
        let host = host.normalized(dtype)?;
        let (src, dst, bytes) = (DevicePtr(host.layout().data), tensor.data_ptr(), tensor.nbytes());
        // A host-to-device copy on the current stream (after any earlier work that used this
        // pool block), waited for before returning: the numpy buffer is free to change as soon
        // as asarray returns (cudaMemcpy semantics). The tensor is new: no other stream knows it.
        py.detach(|| -> opbridge_runtime::Result<()> {
            stream.copy(dst, src, bytes, CopyKind::HostToDevice)?;
            stream.record_new_event()?.synchronize()
        })
        .map_err(to_pyerr)?;
        return Bound::new(py, PyTensor::new(Arc::new(tensor)));
    }
    // Strided, broadcast, unaligned, byte-swapped or of another dtype: numpy converts it in
    // one pass straight into the tensor's memory (a broadcast axis is read, never expanded
    // first). The block may still be in use by earlier work on the stream: wait for that.
    py.detach(|| stream.record_new_event()?.synchronize()).map_err(to_pyerr)?;
    let tensor = Bound::new(py, PyTensor::new(Arc::new(tensor)))?;
    let view = np_ffi::tensor_array(&tensor)?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("casting", "unsafe")?;
    crate::convert::numpy(py)?.call_method("copyto", (view, &host.array), Some(&kwargs))?;
    Ok(tensor)
}

/// An ndarray of a dtype opbridge supports (converted into the tensor without numpy's help).
fn is_supported_ndarray(obj: &Bound<'_, PyAny>) -> bool {
    np_ffi::as_ndarray(obj).is_some_and(|a| np_ffi::dtype_of_num(np_ffi::layout(a).type_num).is_some())
}

/// A shape argument: an int or a sequence of ints, each in `0..=isize::MAX` (the layout's own
/// check then refuses a total size beyond the address space).
fn shape_arg(shape: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let dims: Vec<Bound<'_, PyAny>> = if shape.hasattr("__index__")? {
        vec![shape.clone()]
    } else if shape.is_instance_of::<pyo3::types::PyString>() || shape.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(argument_error(format!("shape must be an int or a tuple of ints, got {shape:?}")));
    } else {
        match shape.try_iter() {
            Ok(items) => items.collect::<PyResult<_>>()?,
            Err(_) => {
                return Err(argument_error(format!(
                    "shape must be an int or a tuple of ints, got {}",
                    crate::convert::type_name(shape)
                )))
            }
        }
    };
    dims.iter()
        .enumerate()
        .map(|(i, d)| crate::convert::int_arg(&format!("shape[{i}]"), d, 0, isize::MAX as i128).map(|d| d as usize))
        .collect()
}

fn alloc_tensor(
    py: Python<'_>,
    shape: &Bound<'_, PyAny>,
    dtype: Option<&Bound<'_, PyAny>>,
    device: Option<&str>,
) -> PyResult<(Tensor, opbridge_runtime::Stream)> {
    let shape = shape_arg(shape)?;
    let dtype = parse_dtype(py, dtype)?;
    let ctx = DeviceContext::get(parse_device(device)?).map_err(to_pyerr)?;
    let stream = ctx.current_stream().map_err(to_pyerr)?;
    let tensor = py.detach(|| Tensor::empty(ctx, &shape, dtype, stream.id())).map_err(to_pyerr)?;
    Ok((tensor, stream))
}

/// A new uninitialized tensor from the device pool. ``dtype`` defaults to float32.
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, device=None))]
pub fn empty<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    device: Option<&str>,
) -> PyResult<Bound<'py, PyTensor>> {
    let (tensor, stream) = alloc_tensor(py, shape, dtype, device)?;
    tensor.mark_allocated_on(&stream).map_err(to_pyerr)?;
    Bound::new(py, PyTensor::new(Arc::new(tensor)))
}

/// A new zero-filled tensor from the device pool (the fill is enqueued on the current stream).
#[pyfunction]
#[pyo3(signature = (shape, dtype=None, device=None))]
pub fn zeros<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    device: Option<&str>,
) -> PyResult<Bound<'py, PyTensor>> {
    let (tensor, stream) = alloc_tensor(py, shape, dtype, device)?;
    tensor.fill_zeros(&stream).map_err(to_pyerr)?;
    Bound::new(py, PyTensor::new(Arc::new(tensor)))
}

/// A tensor sharing the memory of any DLPack producer (numpy, PyTorch CPU tensors, ...):
/// zero-copy. A ``Tensor`` is returned as is.
///
/// Example:
///     >>> a = np.arange(3.0); t = ob.from_dlpack(a)
///     >>> np.shares_memory(t.numpy(), a)
///     True
#[pyfunction]
pub fn from_dlpack<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTensor>> {
    if let Ok(tensor) = obj.cast::<PyTensor>() {
        return Ok(tensor.clone());
    }
    if !obj.hasattr("__dlpack__")? {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "from_dlpack: {} does not implement __dlpack__",
            obj.get_type().name()?
        )));
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("max_version", (1, 0))?;
    let capsule = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(capsule) => capsule,
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) => obj.call_method0("__dlpack__")?,
        Err(e) => return Err(e),
    };
    let (tensor, read_only) = dlpack::import(&capsule)?;
    Bound::new(py, PyTensor { inner: Arc::new(tensor), read_only })
}

/// A new numpy array with the contents of `tensor` (on a device whose memory the host cannot
/// read): contiguous tensors are copied straight into the array's memory.
fn download<'py>(
    py: Python<'py>,
    tensor: &Arc<Tensor>,
    ctx: &'static Arc<DeviceContext>,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    if !tensor.is_contiguous() {
        return Err(device_error(format!(
            "numpy(): the tensor on {} is not contiguous; make it contiguous on the device first",
            tensor.device()
        )));
    }
    let stream = ctx.current_stream().map_err(to_pyerr)?;
    np_ffi::filled_array(py, tensor.dtype(), tensor.shape(), |out| tensor.download(&stream, out).map_err(to_pyerr))
}
