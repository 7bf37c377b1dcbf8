//! The built-in operators, each a type implementing the plugin SDK's `Op` trait: the API plugin
//! authors use. `crate::native` registers them in-process, after the loader's own descriptor
//! checks; elementwise ones add the host's fast lane.
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use opbridge_plugin_sdk::{Attrs, DType, InPlace, Inputs, Meta, Op, Tensor, TensorMut};

use crate::cpu::{elementwise, matmul as mm};
use crate::error::Result;
use crate::native::{self, view, view_mut};
use crate::registry::{Operator, Registry, Source};
use crate::{check_matmul, check_vector_add, Alias};

mod arithmetic;
mod reductions;

/// In-place calls for elementwise built-ins.
// SAFETY: built-in kernels never make references into tensors: they work on `TensorView`s
// (raw addresses, `native::view`), and each kernel supports an output equal to an input.
const IN_PLACE_OK: Option<InPlace> = Some(unsafe { InPlace::new() });

/// The SDK's result type, which built-ins return (host `OpError`s convert with `?`).
type OpResult<T> = opbridge_plugin_sdk::Result<T>;

/// Registers every built-in operator.
pub fn register_all(registry: &Registry) -> Result<()> {
    let mut ops: Vec<std::sync::Arc<dyn Operator>> =
        vec![std::sync::Arc::new(native::op::<VectorAdd>()?), std::sync::Arc::new(native::op::<Matmul>()?)];
    ops.extend(arithmetic::all()?);
    ops.extend(reductions::all()?);
    for op in ops {
        registry.register(op, Source::Builtin)?;
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

/// Both inputs converted to numpy's result type of `a + b`.
fn promote_both(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Option<DType>>> {
    let dtype = inputs[0].dtype.promote(inputs[1].dtype);
    Ok(vec![Some(dtype), Some(dtype)])
}

struct VectorAdd;

impl Op for VectorAdd {
    const NAME: &'static str = "vector_add";
    const VERSION: u32 = 1;
    const DOC: &'static str =
        "Elementwise sum of two arrays of the same shape; the result dtype is numpy's for `a + b`.";
    const INPUTS: &'static [&'static str] = &["a", "b"];
    const DTYPES: &'static [DType] = &DType::ALL;
    const INPUT_DTYPES: Option<opbridge_plugin_sdk::InputDtypesFn> = Some(promote_both);
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let (a, b) = (&inputs[0], &inputs[1]);
        let dtype = check_vector_add((a.dtype, &a.shape), (b.dtype, &b.shape), None)?;
        Ok(vec![Meta::new(dtype, &a.shape)])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (a, b, out) = (view(&inputs[0]), view(&inputs[1]), view_mut(&mut outputs[0]));
        if !(a.is_contiguous() && b.is_contiguous()) {
            // SAFETY: views valid per the registry's contract; `out` is disjoint from the
            // inputs or exactly one of them (`IN_PLACE`).
            return Ok(unsafe { crate::cpu::binary::binary(crate::cpu::binary::BinaryOp::Add, &a, &b, &out) }
                .map_err(kernel("vector_add"))?);
        }
        let alias = match (a.data == out.data, b.data == out.data) {
            (true, true) => Alias::OutIsBoth,
            (true, false) => Alias::OutIsA,
            (false, true) => Alias::OutIsB,
            (false, false) => Alias::None,
        };
        // SAFETY: contiguous views of `numel` elements of the output dtype; the output is
        // disjoint from the inputs or exactly one of them (`IN_PLACE`).
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
    }
}

struct Matmul;

impl Op for Matmul {
    const NAME: &'static str = "matmul";
    const VERSION: u32 = 1;
    const DOC: &'static str = "Matrix product of 2-D float arrays: (m, k) @ (k, n) -> (m, n).";
    const INPUTS: &'static [&'static str] = &["a", "b"];
    const DTYPES: &'static [DType] = &mm::MATMUL_DTYPES;
    const INPUT_DTYPES: Option<opbridge_plugin_sdk::InputDtypesFn> = Some(promote_both);

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let (a, b) = (&inputs[0], &inputs[1]);
        let (m, _, n, dtype) = check_matmul((a.dtype, &a.shape), (b.dtype, &b.shape), None)?;
        Ok(vec![Meta::new(dtype, &[m, n])])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (a, b, out) = (view(&inputs[0]), view(&inputs[1]), view_mut(&mut outputs[0]));
        let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
        let mat = |v: &crate::view::TensorView| mm::MatRef {
            ptr: v.data as *const u8,
            row_stride: v.strides[0],
            col_stride: v.strides[1],
        };
        if k == 0 {
            // SAFETY: the output is a contiguous (m, n) block.
            unsafe { std::ptr::write_bytes(out.data as *mut u8, 0, out.numel() * out.dtype.size()) };
        } else if m > 0 && n > 0 {
            // SAFETY: views valid per the registry's contract; the output is disjoint.
            unsafe { mm::matmul(out.dtype, m, n, k, mat(&a), mat(&b), mat(&out)) };
        }
        Ok(())
    }
}
