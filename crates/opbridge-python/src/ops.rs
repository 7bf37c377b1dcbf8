//! `vector_add` and `matmul`: one entry point each, for numpy arrays (synchronous) and for
//! `Tensor`s (enqueued on the current stream).
#![allow(unsafe_code)] // raw numpy buffers handed to kernels; see the SAFETY notes.

use std::sync::Arc;

use numpy::PyUntypedArrayMethods;
use opbridge_ops::cpu::{elementwise, matmul as mm};
use opbridge_ops::{check_matmul, check_vector_add, overlap, Alias, Overlap, ADD_DTYPES};
use opbridge_runtime::{DType, DeviceContext};
use pyo3::prelude::*;

use crate::errors::to_pyerr;
use crate::host::{self, check_out, new_output, unalias, HostArray};
use crate::tensor::{as_out_tensor, as_tensor, PyTensor};

/// Whether any argument is an `opbridge.Tensor` (the async path). Plain ndarrays, the hot
/// case, are recognized first with one type comparison each.
fn involves_tensor(args: &[Option<&Bound<'_, PyAny>>]) -> bool {
    if args.iter().flatten().all(|a| crate::ffi::numpy::as_ndarray(a).is_some()) {
        return false;
    }
    args.iter().flatten().any(|a| a.is_instance_of::<PyTensor>())
}

/// Elementwise sum of two arrays of the same shape.
///
/// Args:
///     a: numpy array (or anything numpy converts, or an ``opbridge.Tensor``).
///     b: same shape as ``a``. dtypes float16, float32, float64, int32, int64; the result dtype
///         is numpy's for ``a + b``.
///     out: optional output: a writeable, C-contiguous array of the result's shape and dtype.
///         It may be ``a`` or ``b`` itself (in-place).
///
/// Returns:
///     A new array (or ``out``). With ``Tensor`` arguments, a ``Tensor`` enqueued on the
///     current stream; the call returns at once (a numpy argument beside a ``Tensor`` is
///     copied first, so it may change as soon as the call returns).
///
/// Raises:
///     ShapeError: shapes differ, or ``out`` has the wrong shape.
///     DTypeError: an unsupported dtype, or ``out`` of the wrong dtype.
///     ArgumentError: ``out`` is read-only or not C-contiguous.
///
/// Non-contiguous, byte-swapped or mixed-dtype inputs are copied once (by numpy) before the
/// kernel runs; contiguous native inputs are read in place. The GIL is released for inputs of
/// 64 KiB and more, and inputs of 128K elements and more use all cores.
///
/// Example:
///     >>> import numpy as np, opbridge as ob
///     >>> a = np.arange(4, dtype=np.float32)
///     >>> ob.vector_add(a, np.ones_like(a))
///     array([1., 2., 3., 4.], dtype=float32)
#[pyfunction]
#[pyo3(signature = (a, b, out=None))]
pub fn vector_add<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    const OP: &str = "vector_add";
    if involves_tensor(&[Some(a), Some(b), out]) {
        return tensor_call(py, OP, a, b, out, opbridge_ops::vector_add);
    }
    let a = HostArray::extract(OP, "a", a, &ADD_DTYPES)?;
    let b = HostArray::extract(OP, "b", b, &ADD_DTYPES)?;
    let out = out.map(|o| check_out(OP, o)).transpose()?;
    let dtype =
        check_vector_add((a.dtype, a.shape()), (b.dtype, b.shape()), out.as_ref().map(|o| (o.dtype, o.shape())))
            .map_err(to_pyerr)?;
    let a = unalias(a.normalized(dtype)?, out.as_ref())?;
    let b = unalias(b.normalized(dtype)?, out.as_ref())?;
    let result = match out {
        Some(out) => out,
        None => new_output(py, dtype, a.shape())?,
    };
    let out_range = result.range();
    let alias = match (overlap(a.range(), out_range), overlap(b.range(), out_range)) {
        (Overlap::Same, Overlap::Same) => Alias::OutIsBoth,
        (Overlap::Same, _) => Alias::OutIsA,
        (_, Overlap::Same) => Alias::OutIsB,
        _ => Alias::None,
    };
    let (pa, pb, po) = (a.layout().data, b.layout().data, result.layout().data);
    let n = numpy::PyUntypedArrayMethods::len(&result.array);
    host::run(py, result.nbytes(), || {
        // SAFETY: all three are C-contiguous native arrays of `n` elements of `dtype` (checked
        // or normalized above), kept alive by the bound references for the whole call; `out`
        // is writeable and either disjoint from or exactly equal to each input (`alias`).
        unsafe { elementwise::add(dtype, pa as *const u8, pb as *const u8, po as *mut u8, n, alias) }
    });
    Ok(result.array.into_any())
}

/// Matrix product of two 2-D float arrays: ``(m, k) @ (k, n) -> (m, n)``.
///
/// Args:
///     a, b: 2-D arrays of float16, float32 or float64 (mixed dtypes promote as numpy does);
///         any strides (transposed views are read in place).
///     out: optional writeable C-contiguous ``(m, n)`` array of the result dtype; it may
///         overlap the inputs (the product is then computed aside and copied in).
///
/// Uses a packed SIMD GEMM (the ``gemm`` crate) on all cores for large products; float16
/// accumulates in float32. The GIL is released while it runs.
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
    const OP: &str = "matmul";
    if involves_tensor(&[Some(a), Some(b), out]) {
        return tensor_call(py, OP, a, b, out, opbridge_ops::matmul);
    }
    let a = HostArray::extract(OP, "a", a, &mm::MATMUL_DTYPES)?;
    let b = HostArray::extract(OP, "b", b, &mm::MATMUL_DTYPES)?;
    let out = out.map(|o| check_out(OP, o)).transpose()?;
    let (m, k, n, dtype) =
        check_matmul((a.dtype, a.shape()), (b.dtype, b.shape()), out.as_ref().map(|o| (o.dtype, o.shape())))
            .map_err(to_pyerr)?;
    let a = strided_operand(a, dtype)?;
    let b = strided_operand(b, dtype)?;
    // gemm must not write over its inputs: with an overlapping out, compute aside first.
    let overlaps = |o: &HostArray<'_>| [&a, &b].iter().any(|x| spans_overlap(x, o));
    let (result, copy_into) = match out {
        Some(o) if overlaps(&o) => (new_output(py, dtype, &[m, n])?, Some(o)),
        Some(o) => (o, None),
        None => (new_output(py, dtype, &[m, n])?, None),
    };
    let mat = |x: &HostArray<'_>| {
        let s = x.array.strides();
        let size = dtype.size() as isize;
        mm::MatRef { ptr: x.layout().data as *const u8, row_stride: s[0] / size, col_stride: s[1] / size }
    };
    let (ma, mb, mo) = (mat(&a), mat(&b), mat(&result));
    let out_bytes = result.nbytes();
    host::run(py, m.saturating_mul(n).saturating_mul(k).saturating_mul(dtype.size()), move || {
        if k == 0 {
            // An empty sum: zeros, as numpy gives.
            // SAFETY: `mo` is the C-contiguous (m, n) output of `out_bytes` bytes.
            unsafe { std::ptr::write_bytes(mo.ptr as *mut u8, 0, out_bytes) };
        } else if m > 0 && n > 0 {
            // SAFETY: operands are live arrays whose element strides were checked to be whole
            // elements; the output is writeable, (m, n), and disjoint from both inputs.
            unsafe { mm::matmul(dtype, m, n, k, ma, mb, mo) };
        }
    });
    match copy_into {
        Some(o) => {
            host::numpy(py)?.call_method1("copyto", (&o.array, &result.array))?;
            Ok(o.array.into_any())
        }
        None => Ok(result.array.into_any()),
    }
}

/// A matmul operand gemm can read in place: native byte order, the right dtype, aligned data and
/// strides in whole elements (anything else is copied once).
fn strided_operand(x: HostArray<'_>, dtype: DType) -> PyResult<HostArray<'_>> {
    let size = dtype.size() as isize;
    if x.dtype == dtype && x.is_native() && x.layout().is_aligned() && x.array.strides().iter().all(|s| s % size == 0) {
        Ok(x)
    } else {
        x.normalized(dtype)
    }
}

/// Whether the memory spans of two arrays overlap (conservative for strided views).
fn spans_overlap(x: &HostArray<'_>, out: &HostArray<'_>) -> bool {
    let span = |h: &HostArray<'_>| {
        let start = h.layout().data as isize;
        let (mut low, mut high) = (start, start + h.dtype.size() as isize);
        for (&d, &s) in h.shape().iter().zip(h.array.strides()) {
            if d == 0 {
                return (0, 0);
            }
            let reach = (d as isize - 1) * s;
            if reach < 0 {
                low += reach
            } else {
                high += reach
            }
        }
        (low as usize, (high - low) as usize)
    };
    overlap(span(x), span(out)) != Overlap::Disjoint
}

type TensorOp = fn(
    &Arc<opbridge_runtime::Tensor>,
    &Arc<opbridge_runtime::Tensor>,
    Option<&Arc<opbridge_runtime::Tensor>>,
    &opbridge_runtime::Stream,
) -> opbridge_ops::Result<Option<Arc<opbridge_runtime::Tensor>>>;

/// The async path: arguments become tensors (numpy inputs are copied at the call, a numpy
/// `out=` is written in place and waited for), the op is enqueued on the current stream of
/// their device, and a `Tensor` comes back at once.
fn tensor_call<'py>(
    py: Python<'py>,
    op: &str,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    run: TensorOp,
) -> PyResult<Bound<'py, PyAny>> {
    let (ta, tb) = (as_tensor(op, a)?, as_tensor(op, b)?);
    let tout = out.map(|o| as_out_tensor(op, o)).transpose()?;
    if let Some(o) = &tout {
        if o.read_only {
            return Err(crate::errors::argument_error(format!("{op}: out is read-only")));
        }
    }
    let ctx = DeviceContext::get(ta.inner.device()).map_err(to_pyerr)?;
    let stream = ctx.current_stream().map_err(to_pyerr)?;
    let (a, b, o) = (Arc::clone(&ta.inner), Arc::clone(&tb.inner), tout.as_ref().map(|o| Arc::clone(&o.inner)));
    // Detached: allocating may wait for streams whose host functions need the GIL.
    let made = py.detach(|| run(&a, &b, o.as_ref(), &stream)).map_err(to_pyerr)?;
    match (made, out) {
        (Some(tensor), _) => Ok(Bound::new(py, PyTensor::new(tensor))?.into_any()),
        (None, Some(out)) if out.is_instance_of::<PyTensor>() => Ok(out.clone()),
        // out= was a numpy array: the caller expects it filled when the call returns.
        (None, Some(out)) => {
            let target = Arc::clone(&tout.expect("out was given").inner);
            py.detach(|| target.wait_ready()).map_err(to_pyerr)?;
            Ok(out.clone())
        }
        (None, None) => unreachable!("an op without out= returns its result"),
    }
}
