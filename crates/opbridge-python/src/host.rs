//! The synchronous numpy path: validate numpy arrays, normalize the odd ones once, allocate
//! outputs, and run CPU kernels directly on numpy's buffers (GIL released for large inputs).

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use opbridge_runtime::DType;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice, PyTuple};

use crate::convert::numpy;
use crate::errors::{argument_error, dtype_error};
use crate::ffi::numpy as np_ffi;

/// Kernels touching at least this many bytes run with the GIL released: releasing costs about
/// 140 ns (DESIGN.md), which pays off from roughly 16K float32 elements.
pub const GIL_RELEASE_BYTES: usize = 64 * 1024;

/// Outputs at least this large come from the caching pool (no page faults on reuse, which is
/// what makes fresh large outputs faster than numpy's); smaller ones from numpy's allocator,
/// which is cheaper per call for small arrays.
pub const POOL_OUTPUT_MIN_BYTES: usize = 256 * 1024;

/// A numpy array argument with a dtype opbridge supports.
#[derive(Debug)]
pub struct HostArray<'py> {
    pub array: Bound<'py, PyUntypedArray>,
    pub dtype: DType,
    layout: np_ffi::Layout,
}

impl<'py> HostArray<'py> {
    /// Accepts an ndarray, or anything numpy can turn into one (buffer protocol, DLPack,
    /// sequences). Unsupported dtypes raise `DTypeError` naming the supported ones; ndarray
    /// subclasses with semantics of their own `ArgumentError` (see [`refuse_subclass`]).
    pub fn extract(op: &str, name: &str, obj: &Bound<'py, PyAny>, supported: &[DType]) -> PyResult<HostArray<'py>> {
        let array = as_array(op, name, obj)?;
        let layout = np_ffi::layout(&array);
        match np_ffi::dtype_of_num(layout.type_num).filter(|d| supported.contains(d)) {
            Some(dtype) => Ok(HostArray { array, dtype, layout }),
            None => {
                let names: Vec<&str> = supported.iter().map(|d| d.name()).collect();
                Err(dtype_error(format!("{op}: expected {name} of dtype {}, got {}", names.join(", "), array.dtype())))
            }
        }
    }

    fn from_array(array: Bound<'py, PyUntypedArray>, dtype: DType) -> HostArray<'py> {
        let layout = np_ffi::layout(&array);
        HostArray { array, dtype, layout }
    }

    pub fn shape(&self) -> &[usize] {
        self.array.shape()
    }

    pub fn layout(&self) -> np_ffi::Layout {
        self.layout
    }

    pub fn is_native(&self) -> bool {
        self.layout.is_native()
    }

    /// C-contiguous, aligned, native byte order and of `dtype`: `self` when it already is, else
    /// one copy made by numpy (strided, unaligned, byte-swapped and mixed-dtype inputs pay
    /// exactly that copy).
    pub fn normalized(self, dtype: DType) -> PyResult<HostArray<'py>> {
        if self.dtype == dtype && self.layout().is_c_contiguous() && self.layout().is_aligned() && self.is_native() {
            return Ok(self);
        }
        Ok(HostArray::from_array(converted(&self.array, dtype)?, dtype))
    }

    /// An input a kernel reads in place (any strides), of `dtype`: `self` when it already is
    /// (aligned, native, of `dtype`), else one copy made by numpy. Broadcast axes (stride 0)
    /// stay broadcast: only the unique elements are converted, never the logical size.
    pub fn converted(self, dtype: DType) -> PyResult<HostArray<'py>> {
        let size = dtype.size() as isize;
        let readable = self.dtype == dtype
            && self.is_native()
            && self.layout.is_aligned()
            && self.array.strides().iter().all(|s| s % size == 0);
        if readable {
            return Ok(self);
        }
        match self.broadcast_axes()? {
            Some(unique) => rebroadcast(&self.array, &unique, dtype),
            None => self.normalized(dtype),
        }
    }

    /// A private snapshot of an input (the tensor path, taken at the call) in `dtype`: native,
    /// aligned, C-contiguous except that broadcast axes (stride 0) stay broadcast, so a
    /// broadcast view costs its unique elements, not its logical size.
    pub fn snapshot(self, dtype: DType) -> PyResult<HostArray<'py>> {
        match self.broadcast_axes()? {
            Some(unique) => rebroadcast(&self.array, &unique, dtype),
            None => {
                let kwargs = PyDict::new(self.array.py());
                kwargs.set_item("dtype", np_ffi::descr(self.array.py(), dtype))?;
                kwargs.set_item("order", "C")?;
                let copy = numpy(self.array.py())?.call_method("array", (&self.array,), Some(&kwargs))?;
                Ok(HostArray::from_array(copy.cast_into()?, dtype))
            }
        }
    }

    /// When the array repeats its elements along some axis (stride 0, length > 1): the view
    /// of its unique elements (those axes cut to length 1).
    fn broadcast_axes(&self) -> PyResult<Option<Bound<'py, PyAny>>> {
        let shape = self.array.shape();
        let strides = self.array.strides();
        if !shape.iter().zip(strides).any(|(&d, &s)| s == 0 && d > 1) {
            return Ok(None);
        }
        let py = self.array.py();
        let index = PyTuple::new(
            py,
            shape.iter().zip(strides).map(|(&d, &s)| {
                let end = if s == 0 && d > 1 { Some(1) } else { None };
                PySlice::new(py, 0, end.unwrap_or(d as isize), 1)
            }),
        )?;
        Ok(Some(self.array.get_item(index)?))
    }
}

/// A C-contiguous, aligned, native-byte-order copy of `array` converted to `dtype` (one copy,
/// made by numpy).
pub fn converted<'py>(array: &Bound<'py, PyUntypedArray>, dtype: DType) -> PyResult<Bound<'py, PyUntypedArray>> {
    let py = array.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item("dtype", np_ffi::descr(py, dtype))?;
    kwargs.set_item("order", "C")?;
    // `numpy.array` always copies (`ascontiguousarray` would hand back an unaligned contiguous
    // array as is).
    Ok(numpy(py)?.call_method("array", (array,), Some(&kwargs))?.cast_into()?)
}

/// `unique` (an array's unique elements, its broadcast axes of length 1) copied once in
/// `dtype`, then broadcast back to `of`'s shape (a read-only view with stride 0 there).
fn rebroadcast<'py>(
    of: &Bound<'py, PyUntypedArray>,
    unique: &Bound<'py, PyAny>,
    dtype: DType,
) -> PyResult<HostArray<'py>> {
    let py = of.py();
    let np = numpy(py)?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("dtype", np_ffi::descr(py, dtype))?;
    kwargs.set_item("order", "C")?;
    let copy = np.call_method("array", (unique,), Some(&kwargs))?;
    let view = np.call_method1("broadcast_to", (copy, of.shape()))?;
    Ok(HostArray::from_array(view.cast_into()?, dtype))
}

/// `obj` as an ndarray: itself, or numpy's conversion (DLPack producers through
/// `numpy.from_dlpack`, everything else through `numpy.asarray`). ndarray subclasses are
/// checked by [`refuse_subclass`].
pub fn as_array<'py>(op: &str, name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Some(array) = np_ffi::as_exact_ndarray(obj) {
        return Ok(array.clone());
    }
    if let Some(array) = np_ffi::as_ndarray(obj) {
        refuse_subclass(op, name, array)?;
        return Ok(array.clone());
    }
    let np = numpy(obj.py())?;
    let converted = if obj.hasattr("__dlpack__")? {
        np.call_method1("from_dlpack", (obj,))
    } else {
        np.call_method1("asarray", (obj,))
    };
    // numpy's own refusal (a ragged list: ValueError; an object it cannot read: TypeError...)
    // becomes the argument's error, with numpy's as its cause.
    converted.and_then(|a| Ok(a.cast_into::<PyUntypedArray>()?)).map_err(|e| {
        let error = argument_error(format!("{op}: {name} cannot be converted to an array: {e}"));
        error.set_cause(obj.py(), Some(e));
        error
    })
}

/// The hooks through which an ndarray subclass gives its values a meaning of its own (a
/// masked array's mask, `numpy.matrix`'s products): a subclass that defines none of them is
/// plain memory.
const SUBCLASS_HOOKS: [&str; 5] =
    ["__array_ufunc__", "__array_function__", "__array_finalize__", "__array_wrap__", "__array_prepare__"];

/// ndarray subclasses: opbridge computes on an array's memory and returns plain ndarrays, so
/// it accepts only subclasses that are plain memory — `numpy.memmap` (and its subclasses
/// that add no hook), and subclasses that define none of numpy's hooks ([`SUBCLASS_HOOKS`],
/// e.g. ``class A(np.ndarray): pass``). Any other (`numpy.ma.MaskedArray`, `numpy.matrix`,
/// unit-carrying arrays, ...) is an `ArgumentError` naming the type, rather than a result
/// that silently ignores its meaning.
pub fn refuse_subclass(op: &str, name: &str, array: &Bound<'_, PyUntypedArray>) -> PyResult<()> {
    let py = array.py();
    let ty = array.get_type();
    let ndarray = np_ffi::ndarray_type(py);
    let memmap = numpy(py)?.getattr(pyo3::intern!(py, "memmap"))?;
    for cls in ty.mro().iter() {
        if cls.is(ndarray) || cls.is(&memmap) {
            return Ok(());
        }
        let dict = cls.getattr(pyo3::intern!(py, "__dict__"))?;
        for hook in SUBCLASS_HOOKS {
            if dict.contains(hook)? {
                return Err(argument_error(format!(
                    "{op}: {name} is a {}, an ndarray subclass whose semantics opbridge does not keep \
                     (it defines {hook}); pass numpy.asarray(x) to compute on its plain data{}",
                    ty.fully_qualified_name()?,
                    if cls
                        .getattr("__module__")
                        .and_then(|m| m.extract::<String>())
                        .is_ok_and(|m| m.starts_with("numpy.ma"))
                    {
                        ", or x.filled(value) to fill the masked elements"
                    } else {
                        ""
                    }
                )));
            }
        }
    }
    Ok(())
}

/// Validates an `out=` array: an ndarray (an accepted subclass, see [`refuse_subclass`]),
/// writeable, C-contiguous, aligned, native byte order. Shape and dtype are the op's schema
/// checks. Nothing is converted: an `out=` that cannot be written in place is an error.
pub fn check_out<'py>(op: &str, out: &Bound<'py, PyAny>) -> PyResult<HostArray<'py>> {
    let Some(array) = np_ffi::as_ndarray(out) else {
        return Err(argument_error(format!(
            "{op}: expected out to be a numpy.ndarray, got {}",
            out.get_type().name()?
        )));
    };
    let out = HostArray::extract(op, "out", array.as_any(), &DType::ALL)?;
    let layout = out.layout();
    if !layout.is_writeable() {
        return Err(argument_error(format!("{op}: out is read-only")));
    }
    if !layout.is_c_contiguous() || !layout.is_aligned() || !out.is_native() {
        return Err(argument_error(format!(
            "{op}: expected a C-contiguous, aligned out in native byte order, got dtype {} with strides {:?} at address {:#x}",
            out.array.dtype(),
            out.array.strides(),
            layout.data
        )));
    }
    Ok(out)
}

/// A new C-contiguous output array: pool memory for large ones, numpy's for small ones.
pub fn new_output<'py>(py: Python<'py>, dtype: DType, shape: &[usize]) -> PyResult<HostArray<'py>> {
    let bytes = shape
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            crate::errors::shape_error(format!("an output of shape {shape:?} and dtype {dtype} is too large"))
        })?;
    let array = if bytes >= POOL_OUTPUT_MIN_BYTES {
        np_ffi::pooled_array(py, dtype, shape)?
    } else {
        np_ffi::empty(py, dtype, shape)?
    };
    Ok(HostArray::from_array(array, dtype))
}

/// Runs `work`, without the GIL when it touches enough memory to be worth it.
pub fn run<T: Send>(py: Python<'_>, bytes: usize, work: impl FnOnce() -> T + Send) -> T {
    if bytes >= GIL_RELEASE_BYTES {
        py.detach(work)
    } else {
        work()
    }
}
