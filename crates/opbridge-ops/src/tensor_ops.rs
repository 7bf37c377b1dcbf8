//! Operators on runtime tensors: checked on the caller's thread, enqueued on a stream.
#![allow(unsafe_code)]

use std::sync::Arc;

use opbridge_runtime::{DType, DeviceContext, Stream, Tensor};

use crate::cpu::{cast, elementwise, matmul as mm};
use crate::error::{OpError, Result};
use crate::view::TensorView;
use crate::{check_matmul, check_vector_add, overlap, Alias, Overlap};

fn same_device(op: &'static str, tensors: &[&Tensor], stream: &Stream) -> Result<&'static Arc<DeviceContext>> {
    for t in tensors {
        if t.device() != stream.device() {
            return Err(OpError::Device {
                op,
                message: format!(
                    "expected tensors on {} (the stream's device), got one on {}",
                    stream.device(),
                    t.device()
                ),
            });
        }
    }
    Ok(DeviceContext::get(stream.device())?)
}

/// The bytes a tensor's elements span, whatever its strides.
fn byte_range(t: &Tensor) -> (usize, usize) {
    crate::view::TensorView::of_tensor(t).byte_span()
}

/// A contiguous tensor of `dtype` with `t`'s values: `t` itself when it already is one, else a
/// copy enqueued on `stream` (the one documented copy for strided or mismatched inputs).
pub fn contiguous(t: &Arc<Tensor>, dtype: DType, stream: &Stream) -> Result<Arc<Tensor>> {
    if t.is_contiguous() && t.dtype() == dtype {
        return Ok(Arc::clone(t));
    }
    let ctx = same_device("contiguous", &[t], stream)?;
    let converted = Tensor::empty(ctx, t.shape(), dtype, stream.id())?;
    let (src, dst) = (TensorView::of_tensor(t), TensorView::of_tensor(&converted));
    Tensor::launch(
        stream,
        &[t],
        &[&converted],
        Box::new(move || {
            // SAFETY: `src` is `t`'s validated layout; `dst` is a fresh contiguous block of the
            // same shape; stream order keeps both alive and unaliased until this kernel has run.
            unsafe { cast::cast_view(&src, &dst) }
        }),
    )?;
    Ok(Arc::new(converted))
}

/// `a + b` on `stream`. Returns the new tensor, or `None` when it wrote into `out`.
pub fn vector_add(
    a: &Arc<Tensor>,
    b: &Arc<Tensor>,
    out: Option<&Arc<Tensor>>,
    stream: &Stream,
) -> Result<Option<Arc<Tensor>>> {
    const OP: &str = "vector_add";
    let mut all = vec![a.as_ref(), b.as_ref()];
    all.extend(out.map(|o| o.as_ref()));
    let ctx = same_device(OP, &all, stream)?;
    let dtype = check_vector_add((a.dtype(), a.shape()), (b.dtype(), b.shape()), out.map(|o| (o.dtype(), o.shape())))?;
    if let Some(o) = out {
        if !o.is_contiguous() {
            return Err(OpError::Argument { op: OP, message: "out must be contiguous".into() });
        }
    }
    let result = match out {
        Some(o) => Arc::clone(o),
        None => Arc::new(Tensor::empty(ctx, a.shape(), dtype, stream.id())?),
    };
    // Inputs that partially overlap the output would be read after being written: copy them.
    let prepare = |t: &Arc<Tensor>| -> Result<Arc<Tensor>> {
        let t = contiguous(t, dtype, stream)?;
        if overlap(byte_range(&t), byte_range(&result)) == Overlap::Partial {
            let copy = Arc::new(Tensor::empty(ctx, t.shape(), dtype, stream.id())?);
            copy_tensor(&t, &copy, stream)?;
            return Ok(copy);
        }
        Ok(t)
    };
    let (a, b) = (prepare(a)?, prepare(b)?);
    let out_range = byte_range(&result);
    let alias = match (overlap(byte_range(&a), out_range), overlap(byte_range(&b), out_range)) {
        (Overlap::Same, Overlap::Same) => Alias::OutIsBoth,
        (Overlap::Same, _) => Alias::OutIsA,
        (_, Overlap::Same) => Alias::OutIsB,
        _ => Alias::None,
    };
    let (pa, pb, po, n) = (a.data_ptr().0, b.data_ptr().0, result.data_ptr().0, result.numel());
    Tensor::launch(
        stream,
        &[&a, &b],
        &[&result],
        Box::new(move || {
            // SAFETY: contiguous blocks of `n` elements of `dtype`, checked above; `alias`
            // describes their exact relation; stream order keeps them alive.
            unsafe { elementwise::add(dtype, pa as *const u8, pb as *const u8, po as *mut u8, n, alias) };
            Ok(())
        }),
    )?;
    Ok(if out.is_some() { None } else { Some(result) })
}

/// Enqueues a byte copy of contiguous `src` into contiguous `dst` (same size) on `stream`.
pub fn copy_tensor(src: &Tensor, dst: &Tensor, stream: &Stream) -> Result<()> {
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

/// `a @ b` for 2-D tensors on `stream`. Returns the new tensor, or `None` when it wrote `out`.
pub fn matmul(
    a: &Arc<Tensor>,
    b: &Arc<Tensor>,
    out: Option<&Arc<Tensor>>,
    stream: &Stream,
) -> Result<Option<Arc<Tensor>>> {
    const OP: &str = "matmul";
    let mut all = vec![a.as_ref(), b.as_ref()];
    all.extend(out.map(|o| o.as_ref()));
    let ctx = same_device(OP, &all, stream)?;
    let (m, k, n, dtype) =
        check_matmul((a.dtype(), a.shape()), (b.dtype(), b.shape()), out.map(|o| (o.dtype(), o.shape())))?;
    let a = if a.dtype() == dtype { Arc::clone(a) } else { contiguous(a, dtype, stream)? };
    let b = if b.dtype() == dtype { Arc::clone(b) } else { contiguous(b, dtype, stream)? };
    let result = match out {
        // gemm cannot write over its inputs: compute aside, then copy into an aliasing out.
        Some(o)
            if [&a, &b].iter().any(|t| overlap(byte_range(t), byte_range(o)) != Overlap::Disjoint)
                || !o.is_contiguous() =>
        {
            Arc::new(Tensor::empty(ctx, &[m, n], dtype, stream.id())?)
        }
        Some(o) => Arc::clone(o),
        None => Arc::new(Tensor::empty(ctx, &[m, n], dtype, stream.id())?),
    };
    let operand = |t: &Tensor| (t.data_ptr().0, t.strides()[0], t.strides()[1]);
    let (pa, pb) = (operand(&a), operand(&b));
    let po = (result.data_ptr().0, n as isize, 1isize);
    Tensor::launch(
        stream,
        &[&a, &b],
        &[&result],
        Box::new(move || {
            let mat = |(ptr, row_stride, col_stride): (usize, isize, isize)| mm::MatRef {
                ptr: ptr as *const u8,
                row_stride,
                col_stride,
            };
            // SAFETY: operand layouts were validated when the tensors were made; `result` is a
            // fresh or checked-disjoint contiguous (m, n) block; stream order keeps all alive.
            unsafe { mm::matmul(dtype, m, n, k, mat(pa), mat(pb), mat(po)) };
            Ok(())
        }),
    )?;
    match out {
        Some(o) if !Arc::ptr_eq(o, &result) => {
            copy_into(&result, o, stream)?;
            Ok(None)
        }
        Some(_) => Ok(None),
        None => Ok(Some(result)),
    }
}

/// Copies contiguous `src` into `dst` of the same shape and dtype, whatever `dst`'s strides.
fn copy_into(src: &Tensor, dst: &Tensor, stream: &Stream) -> Result<()> {
    if dst.is_contiguous() {
        return copy_tensor(src, dst, stream);
    }
    Err(OpError::Argument { op: "matmul", message: "out must be contiguous".into() })
}
