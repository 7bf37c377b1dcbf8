//! The built-in operators, declared with the same API plugin authors use (`OpBuilder`).
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use std::sync::Arc;

use crate::error::Result;
use crate::kernels::{elementwise, matmul as mm};
use crate::registry::{OpBuilder, Registry, Source};
use crate::schema::Meta;
use crate::view::TensorView;
use crate::{check_matmul, check_vector_add, Alias};

mod arithmetic;
mod reductions;

/// Registers every built-in operator.
pub fn register_all(registry: &Registry) -> Result<()> {
    let mut ops = vec![vector_add()?, matmul()?];
    ops.extend(arithmetic::all()?);
    ops.extend(reductions::all()?);
    for op in ops {
        registry.register(Arc::new(op), Source::Builtin)?;
    }
    Ok(())
}

/// Maps a kernel's refusal to `OpError::Kernel`, without repeating the op name the kernel's
/// message may already start with.
fn kernel(op: &str) -> impl Fn(String) -> crate::error::OpError + '_ {
    move |message| {
        let message = message.strip_prefix(&format!("{op}: ")).map(str::to_string).unwrap_or(message);
        crate::error::OpError::Kernel { op: op.to_string(), message }
    }
}

fn required(inputs: &[Option<Meta>], i: usize) -> &Meta {
    inputs[i].as_ref().expect("required inputs are checked by the caller")
}

fn vector_add() -> Result<crate::registry::OpDef> {
    OpBuilder::new("vector_add", 1)
        .doc("Elementwise sum of two arrays of the same shape; the result dtype is numpy's for `a + b`.")
        .input("a")
        .input("b")
        .cast(|inputs, _| {
            let dtype = required(inputs, 0).dtype.promote(required(inputs, 1).dtype);
            Ok(vec![Some(dtype), Some(dtype)])
        })
        .infer(|inputs, _| {
            let (a, b) = (required(inputs, 0), required(inputs, 1));
            let dtype = check_vector_add((a.dtype, &a.shape), (b.dtype, &b.shape), None)?;
            Ok(vec![Meta::new(dtype, &a.shape)])
        })
        .cpu(|inputs, outputs, _| {
            let (a, b, out) = (inputs[0].as_ref().expect("a"), inputs[1].as_ref().expect("b"), &outputs[0]);
            if !(a.is_contiguous() && b.is_contiguous()) {
                // SAFETY: views valid per the registry's contract; `out` is disjoint from the
                // inputs or exactly one of them (`in_place_ok`).
                return unsafe { crate::kernels::binary::binary(crate::kernels::binary::BinaryOp::Add, a, b, out) }
                    .map_err(kernel("vector_add"));
            }
            let alias = match (a.data == out.data, b.data == out.data) {
                (true, true) => Alias::OutIsBoth,
                (true, false) => Alias::OutIsA,
                (false, true) => Alias::OutIsB,
                (false, false) => Alias::None,
            };
            // SAFETY: contiguous views of `numel` elements of the output dtype; the output is
            // disjoint from the inputs or exactly one of them (`in_place_ok`).
            unsafe {
                elementwise::add(
                    out.dtype,
                    a.data as *const u8,
                    b.data as *const u8,
                    out.data as *mut u8,
                    out.numel(),
                    alias,
                )
            };
            Ok(())
        })
        .in_place_ok()
        .build()
}

fn matmul() -> Result<crate::registry::OpDef> {
    OpBuilder::new("matmul", 1)
        .doc("Matrix product of 2-D float arrays: (m, k) @ (k, n) -> (m, n).")
        .input("a")
        .input("b")
        .dtypes(&mm::MATMUL_DTYPES)
        .cast(|inputs, _| {
            let dtype = required(inputs, 0).dtype.promote(required(inputs, 1).dtype);
            Ok(vec![Some(dtype), Some(dtype)])
        })
        .infer(|inputs, _| {
            let (a, b) = (required(inputs, 0), required(inputs, 1));
            let (m, _, n, dtype) = check_matmul((a.dtype, &a.shape), (b.dtype, &b.shape), None)?;
            Ok(vec![Meta::new(dtype, &[m, n])])
        })
        .cpu(|inputs, outputs, _| {
            let (a, b, out) = (inputs[0].as_ref().expect("a"), inputs[1].as_ref().expect("b"), &outputs[0]);
            let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
            let mat = |v: &TensorView| mm::MatRef {
                ptr: v.data as *const u8,
                row_stride: v.strides[0],
                col_stride: v.strides[1],
            };
            if k == 0 {
                // SAFETY: the output is a contiguous (m, n) block.
                unsafe { std::ptr::write_bytes(out.data as *mut u8, 0, out.numel() * out.dtype.size()) };
            } else if m > 0 && n > 0 {
                // SAFETY: views valid per the registry's contract; the output is disjoint.
                unsafe { mm::matmul(out.dtype, m, n, k, mat(a), mat(b), mat(out)) };
            }
            Ok(())
        })
        .build()
}
