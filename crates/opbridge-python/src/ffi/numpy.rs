//! Direct access to numpy arrays through numpy's C API: reading an array's layout costs a few
//! field loads, with none of the borrow tracking of rust-numpy's typed arrays (which the call
//! overhead targets cannot afford; aliasing is checked by the ops layer instead).

use std::os::raw::c_int;
use std::sync::Arc;

use numpy::npyffi::{self, npy_intp, NPY_ARRAY_ALIGNED, NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE, PY_ARRAY_API};
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use opbridge_runtime::{Buffer, DType, DeviceContext, StreamId, Tensor};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use smallvec::SmallVec;

/// numpy's dtype descriptor for a runtime dtype (made once per process, then shared).
pub fn descr(py: Python<'_>, dtype: DType) -> Bound<'_, PyArrayDescr> {
    static DESCRS: PyOnceLock<[Py<PyArrayDescr>; 5]> = PyOnceLock::new();
    let all = DESCRS.get_or_init(py, || {
        DType::ALL.map(|d| {
            match d {
                DType::F16 => numpy::dtype::<half::f16>(py),
                DType::F32 => numpy::dtype::<f32>(py),
                DType::F64 => numpy::dtype::<f64>(py),
                DType::I32 => numpy::dtype::<i32>(py),
                DType::I64 => numpy::dtype::<i64>(py),
            }
            .unbind()
        })
    });
    let index = DType::ALL.iter().position(|&d| d == dtype).expect("every dtype is in ALL");
    all[index].bind(py).clone()
}

/// numpy's `ndarray` type object, looked up once per process (rust-numpy's check goes through
/// the API capsule on every call).
pub fn ndarray_type(py: Python<'_>) -> &Bound<'_, pyo3::types::PyType> {
    static NDARRAY: PyOnceLock<Py<pyo3::types::PyType>> = PyOnceLock::new();
    NDARRAY
        .get_or_init(py, || {
            // SAFETY: numpy's API returns its (immortal) ndarray type object; we keep a reference.
            unsafe {
                Bound::from_borrowed_ptr(py, npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type).cast())
                    .cast_into_unchecked::<pyo3::types::PyType>()
                    .unbind()
            }
        })
        .bind(py)
}

/// `obj` as an ndarray (or a subclass: callers decide which subclasses they accept).
pub fn as_ndarray<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyUntypedArray>> {
    let ndarray = ndarray_type(obj.py()).as_ptr().cast::<pyo3::ffi::PyTypeObject>();
    // SAFETY: reading the type of a live object and comparing type objects.
    let is_array = unsafe {
        let ty = pyo3::ffi::Py_TYPE(obj.as_ptr());
        ty == ndarray || pyo3::ffi::PyType_IsSubtype(ty, ndarray) != 0
    };
    // SAFETY: just checked to be an ndarray instance.
    is_array.then(|| unsafe { obj.cast_unchecked::<PyUntypedArray>() })
}

/// `obj` as an ndarray of exactly that type (no subclass): the fast lane's test, one pointer
/// comparison.
pub fn as_exact_ndarray<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> Option<&'a Bound<'py, PyUntypedArray>> {
    let ndarray = ndarray_type(obj.py()).as_ptr().cast::<pyo3::ffi::PyTypeObject>();
    // SAFETY: reading the type of a live object and comparing type objects.
    let is_array = unsafe { pyo3::ffi::Py_TYPE(obj.as_ptr()) == ndarray };
    // SAFETY: just checked to be an ndarray instance.
    is_array.then(|| unsafe { obj.cast_unchecked::<PyUntypedArray>() })
}

/// A numpy array's layout, read once per call.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub data: usize,
    pub flags: c_int,
    /// numpy's type number and byte order character of the element type.
    pub type_num: c_int,
    pub byteorder: u8,
}

pub fn layout(array: &Bound<'_, PyUntypedArray>) -> Layout {
    let raw = array.as_array_ptr();
    // SAFETY: `array` is a live ndarray (checked by its type); `data`, `flags` and `descr` are
    // plain fields of its object struct, and `type_num`/`byteorder` fields of the descriptor
    // prefix common to numpy 1 and 2, read while attached to the interpreter.
    unsafe {
        let fields = &*npyffi::_PyArray_GET_ITEM_DATA(raw.cast_const());
        let descr = &*npyffi::_PyDataType_GET_ITEM_DATA(fields.descr);
        Layout {
            data: fields.data as usize,
            flags: fields.flags,
            type_num: descr.type_num,
            byteorder: descr.byteorder as u8,
        }
    }
}

/// The runtime dtype for a numpy type number (builtin types only: structured and subarray
/// dtypes have other numbers).
pub fn dtype_of_num(type_num: c_int) -> Option<DType> {
    use npyffi::NPY_TYPES as T;
    let long_is_64 = std::mem::size_of::<std::os::raw::c_long>() == 8;
    match type_num {
        n if n == T::NPY_HALF as c_int => Some(DType::F16),
        n if n == T::NPY_FLOAT as c_int => Some(DType::F32),
        n if n == T::NPY_DOUBLE as c_int => Some(DType::F64),
        n if n == T::NPY_INT as c_int => Some(DType::I32),
        n if n == T::NPY_LONGLONG as c_int => Some(DType::I64),
        n if n == T::NPY_LONG as c_int => Some(if long_is_64 { DType::I64 } else { DType::I32 }),
        _ => None,
    }
}

impl Layout {
    pub fn is_c_contiguous(&self) -> bool {
        self.flags & NPY_ARRAY_C_CONTIGUOUS != 0
    }

    pub fn is_writeable(&self) -> bool {
        self.flags & NPY_ARRAY_WRITEABLE != 0
    }

    /// Data and strides aligned to the element size (what kernels reading typed slices need;
    /// numpy arrays over a byte buffer at an odd offset are not).
    pub fn is_aligned(&self) -> bool {
        self.flags & NPY_ARRAY_ALIGNED != 0
    }

    /// Native byte order ('=' or '|'; or the explicit character of this machine's order).
    pub fn is_native(&self) -> bool {
        let explicit_native = if cfg!(target_endian = "little") { b'<' } else { b'>' };
        matches!(self.byteorder, b'=' | b'|') || self.byteorder == explicit_native
    }
}

/// A new C-contiguous array, memory from numpy's allocator.
pub fn empty<'py>(py: Python<'py>, dtype: DType, shape: &[usize]) -> PyResult<Bound<'py, PyUntypedArray>> {
    // With no data, numpy reads `flags` as the memory order: 0 is C order.
    new_array(py, dtype, shape, None, std::ptr::null_mut(), 0, None)
}

/// The base object of numpy arrays whose memory is a pool block: when numpy frees the array,
/// this object dies and the block returns to the pool.
#[pyclass(module = "opbridge", frozen)]
#[derive(Debug)]
pub struct PooledMemory {
    buffer: Buffer,
}

impl PooledMemory {
    fn new(buffer: Buffer) -> PooledMemory {
        PooledMemory { buffer }
    }
}

#[pymethods]
impl PooledMemory {
    #[getter]
    fn nbytes(&self) -> usize {
        self.buffer.len()
    }

    fn __repr__(&self) -> String {
        format!("PooledMemory({:?})", self.buffer)
    }
}

/// A new C-contiguous, writable array in a block of the CPU device's caching pool (host
/// memory), whose base is a [`PooledMemory`]: the block returns to the pool when numpy frees
/// the array.
pub fn pooled_array<'py>(py: Python<'py>, dtype: DType, shape: &[usize]) -> PyResult<Bound<'py, PyUntypedArray>> {
    let bytes = shape.iter().try_fold(dtype.size(), |n, &d| n.checked_mul(d)).filter(|&b| b <= isize::MAX as usize);
    let bytes = bytes.ok_or_else(|| {
        crate::errors::shape_error(format!("an output of shape {shape:?} and dtype {dtype} is too large"))
    })?;
    let ctx = DeviceContext::cpu();
    // Detached: under memory pressure the pool waits for streams whose host functions may
    // need the GIL.
    let buffer = py.detach(|| ctx.pool().allocate(bytes, StreamId::HOST)).map_err(crate::errors::to_pyerr)?;
    let data = buffer.ptr().0;
    let owner = Bound::new(py, PooledMemory::new(buffer))?;
    // SAFETY: `data` is a 64-byte-aligned block of host memory (the CPU device's pool) of at
    // least `bytes` bytes, owned by `owner`, which numpy keeps as the array's base until the
    // array dies.
    unsafe { wrap(py, dtype, shape, None, data, true, owner.into_any()) }
}

/// A frozen Python object that holds a tensor for its whole life (`opbridge.Tensor`), so a
/// numpy array over the tensor's memory may take it as its base.
pub trait TensorOwner: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync {
    fn tensor(&self) -> &Arc<Tensor>;
    /// The memory must not be written (a read-only DLPack import): the array is read-only.
    fn read_only(&self) -> bool;
}

/// A numpy array sharing the memory of `owner`'s tensor, with `owner` as its base. The tensor
/// must be in host-accessible memory; callers wait for the work that writes it first.
pub fn tensor_array<'py, T: TensorOwner>(owner: &Bound<'py, T>) -> PyResult<Bound<'py, PyUntypedArray>> {
    let py = owner.py();
    let this = owner.get();
    let tensor = this.tensor();
    let ctx = DeviceContext::get(tensor.device()).map_err(crate::errors::to_pyerr)?;
    if !ctx.device().host_accessible() {
        return Err(crate::errors::device_error(format!(
            "numpy(): the tensor is on {}, whose memory the host cannot read",
            tensor.device()
        )));
    }
    let strides: SmallVec<[isize; 8]> = tensor.strides().iter().map(|&s| s * tensor.dtype().size() as isize).collect();
    // SAFETY: the tensor's layout was validated against its storage when it was made, and its
    // memory is host memory (checked above). `owner` is frozen and holds the tensor for its
    // whole life, and numpy keeps it as the array's base until the array dies.
    unsafe {
        wrap(
            py,
            tensor.dtype(),
            tensor.shape(),
            Some(&strides),
            tensor.data_ptr().0,
            !this.read_only(),
            owner.clone().into_any(),
        )
    }
}

/// A C-contiguous array over `data`, kept alive by `owner` (set as the array's base).
///
/// # Safety
/// `data` must be valid for `prod(shape)` elements of `dtype`, aligned, and stay valid as long
/// as `owner` lives; writable unless `writeable` is false.
unsafe fn wrap<'py>(
    py: Python<'py>,
    dtype: DType,
    shape: &[usize],
    strides_bytes: Option<&[isize]>,
    data: usize,
    writeable: bool,
    owner: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let flags = if writeable { NPY_ARRAY_WRITEABLE } else { 0 };
    new_array(py, dtype, shape, strides_bytes, data as *mut std::ffi::c_void, flags, Some(owner))
}

fn new_array<'py>(
    py: Python<'py>,
    dtype: DType,
    shape: &[usize],
    strides_bytes: Option<&[isize]>,
    data: *mut std::ffi::c_void,
    flags: c_int,
    owner: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    // On the stack for the usual ranks: this runs on every call that makes an output (numpy
    // copies both lists, so they only need to outlive the call).
    let mut dims: SmallVec<[npy_intp; 8]> = shape.iter().map(|&d| d as npy_intp).collect();
    let mut strides: Option<SmallVec<[npy_intp; 8]>> =
        strides_bytes.map(|s| s.iter().map(|&v| v as npy_intp).collect());
    let strides_ptr = strides.as_mut().map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
    // SAFETY: numpy's documented constructor. `descr` is a new reference that the call steals;
    // `dims`/`strides` outlive the call (numpy copies them); `data` is either null (numpy
    // allocates) or valid per `wrap`'s contract.
    unsafe {
        let array_type = npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type);
        let raw = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            array_type,
            descr(py, dtype).into_dtype_ptr(),
            shape.len() as c_int,
            dims.as_mut_ptr(),
            strides_ptr,
            data,
            flags,
            std::ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr_or_err(py, raw)?;
        if let Some(owner) = owner {
            // SetBaseObject steals the reference to `owner`, also on failure.
            if PY_ARRAY_API.PyArray_SetBaseObject(py, raw.cast(), owner.into_ptr()) < 0 {
                return Err(PyErr::fetch(py));
            }
        }
        Ok(array.cast_into_unchecked())
    }
}

/// The bytes of a C-contiguous, aligned array of native byte order (what
/// `HostArray::normalized` returns), borrowed for as long as `array` is.
pub fn contiguous_bytes<'a>(array: &'a Bound<'_, PyUntypedArray>) -> PyResult<&'a [u8]> {
    let layout = layout(array);
    if !layout.is_c_contiguous() {
        return Err(crate::errors::argument_error("expected a C-contiguous array".into()));
    }
    let len = array.len() * array.dtype().itemsize();
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: a live C-contiguous ndarray holds `len` bytes from `data`; `array` keeps it alive
    // for the borrow. numpy may let other code write it meanwhile (it is the caller's array), as
    // a host-to-device copy from a numpy array always allows.
    Ok(unsafe { std::slice::from_raw_parts(layout.data as *const u8, len) })
}

/// A new C-contiguous array of `dtype` and `shape` whose bytes `fill` writes (a device-to-host
/// copy, a staged call), run with the GIL released.
pub fn filled_array<'py, E: Into<PyErr> + Send>(
    py: Python<'py>,
    dtype: DType,
    shape: &[usize],
    fill: impl FnOnce(&mut [u8]) -> Result<(), E> + Send,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    let array = empty(py, dtype, shape)?;
    let len = array.len() * array.dtype().itemsize();
    let data = layout(&array).data;
    let out: &mut [u8] = if len == 0 {
        &mut []
    } else {
        // SAFETY: `empty` made a C-contiguous array of `len` bytes that no other code has seen
        // (it is returned only after `fill`), so this is the only reference to its memory while
        // `fill` runs; `array` keeps it alive until then.
        unsafe { std::slice::from_raw_parts_mut(data as *mut u8, len) }
    };
    py.detach(|| fill(out)).map_err(Into::into)?;
    Ok(array)
}
