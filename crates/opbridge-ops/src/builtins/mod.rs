//! The built-in operators, each a type implementing the plugin SDK's `Op` trait: the API plugin
//! authors use. `crate::native` registers them in-process, after the loader's own descriptor
//! checks; elementwise ones add the host's fast lane. [`register_builtins`] puts them into any
//! registry; [`global`] is the process-wide default registry that holds them (what Python uses).
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use std::sync::{Arc, OnceLock};

use opbridge_plugin_sdk::{Attrs, DType, InPlace, Inputs, Meta, Op, Tensor, TensorMut};

use crate::cpu::elementwise::{self, Alias};
use crate::cpu::matmul as mm;
use crate::cpu::KernelError;
use crate::error::{OpError, Result};
use crate::native::{self, view, view_mut};
use crate::registry::{Batching, Operator, Registry, Source, ViewLane};
use crate::view::{Dims, TensorView};

mod arithmetic;
mod reductions;

/// In-place calls for elementwise built-ins.
// SAFETY: built-in kernels never make references into tensors: they work on `TensorView`s
// (raw addresses, `native::view`), and each kernel supports an output equal to an input.
const IN_PLACE_OK: Option<InPlace> = Some(unsafe { InPlace::new() });

/// The SDK's result type, which built-ins return (host `OpError`s convert with `?`).
type OpResult<T> = opbridge_plugin_sdk::Result<T>;

/// Registers every built-in operator in `registry`.
pub fn register_builtins(registry: &Registry) -> Result<()> {
    let mut ops: Vec<Arc<dyn Operator>> = vec![vector_add_op()?, matmul_op()?];
    ops.extend(arithmetic::all()?);
    ops.extend(reductions::all()?);
    for op in ops {
        registry.register(op, Source::Builtin)?;
    }
    Ok(())
}

/// The process-wide default registry, with the built-in operators: what the Python package
/// calls and loads libraries into. Other hosts (a server) own registries of their own.
pub fn global() -> &'static Arc<Registry> {
    static GLOBAL: OnceLock<Arc<Registry>> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let registry = Registry::new();
        register_builtins(&registry).expect("built-in operators are valid and distinct");
        registry
    })
}

/// Checks `vector_add` arguments; returns the result dtype (numpy's for `a + b`).
fn check_vector_add(a: (DType, &[usize]), b: (DType, &[usize])) -> Result<DType> {
    if a.1 != b.1 {
        return Err(OpError::Shape {
            op: "vector_add".into(),
            expected: format!("inputs of equal shape (a has {:?})", a.1),
            got: format!("b of shape {:?}", b.1),
        });
    }
    Ok(a.0.promote(b.0))
}

/// Checks `matmul` arguments; returns `(m, k, n, result dtype)`.
fn check_matmul(a: (DType, &[usize]), b: (DType, &[usize])) -> Result<(usize, usize, usize, DType)> {
    const OP: &str = "matmul";
    for (name, (dtype, _)) in [("a", a), ("b", b)] {
        if !mm::MATMUL_DTYPES.contains(&dtype) {
            return Err(OpError::unsupported_dtype(OP, &mm::MATMUL_DTYPES, format!("{dtype} for {name}")));
        }
    }
    let (&[m, k], &[k2, n]) = (a.1, b.1) else {
        return Err(OpError::Shape {
            op: OP.into(),
            expected: "2-D operands (m, k) and (k, n)".into(),
            got: format!("a of shape {:?} and b of shape {:?}", a.1, b.1),
        });
    };
    if k != k2 {
        return Err(OpError::Shape {
            op: OP.into(),
            expected: format!("b with {k} rows to match a's shape {:?}", a.1),
            got: format!("b of shape {:?}", b.1),
        });
    }
    Ok((m, k, n, a.0.promote(b.0)))
}

/// The add kernel's aliasing mode from the addresses of equal-length contiguous operands (each
/// either disjoint from the output or exactly it: the in-place contract).
fn alias_of(a: usize, b: usize, out: usize) -> Alias {
    match (a == out, b == out) {
        (true, true) => Alias::OutIsBoth,
        (true, false) => Alias::OutIsA,
        (false, true) => Alias::OutIsB,
        (false, false) => Alias::None,
    }
}

/// `vector_add` with its fast lane: every dtype, both inputs and the output of one dtype.
fn vector_add_op() -> Result<Arc<dyn Operator>> {
    Ok(Arc::new(
        native::op::<VectorAdd>()?
            .with_lane(
                |_| true,
                |dtype, inputs, out, len| {
                    let alias = alias_of(inputs[0], inputs[1], out);
                    // SAFETY: the lane's contract (see `Lane::run`): contiguous, aligned operands of
                    // `len` elements of `dtype`, the output disjoint from each input or exactly it.
                    unsafe {
                        elementwise::add(
                            dtype,
                            inputs[0] as *const u8,
                            inputs[1] as *const u8,
                            out as *mut u8,
                            len,
                            alias,
                        )
                    };
                    Ok(())
                },
            )
            // Its input-dtype rule (`promote_both`) is exactly numpy's promotion of the two.
            .with_lane_promotion(DType::promote)
            .with_batching(Batching::ELEMENTWISE),
    ))
}

// matmul declares no batching: the GEMM kernel sums a one-row product in another order than
// the same row among others (from about 512 terms), so a merged call would not give the calls
// alone bit for bit.

/// Maps a CPU kernel's refusal to `OpError::CpuKernel`, naming the operator `op`.
fn kernel(op: &str) -> impl Fn(KernelError) -> OpError + '_ {
    move |error| OpError::cpu_kernel(op, error)
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
        let dtype = check_vector_add((a.dtype, &a.shape), (b.dtype, &b.shape))?;
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
        let alias = alias_of(a.data, b.data, out.data);
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
        let (m, _, n, dtype) = check_matmul((a.dtype, &a.shape), (b.dtype, &b.shape))?;
        Ok(vec![Meta::new(dtype, &[m, n])])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        matmul_views(&view(&inputs[0]), &view(&inputs[1]), &view_mut(&mut outputs[0]));
        Ok(())
    }
}

/// `a @ b` for 2-D views of one float dtype (any strides) into a contiguous `(m, n)` output
/// disjoint from them: what both the operator and its view lane run.
fn matmul_views(a: &TensorView, b: &TensorView, out: &TensorView) {
    let (m, k, n) = (a.shape[0], a.shape[1], b.shape[1]);
    let mat =
        |v: &TensorView| mm::MatRef { ptr: v.data as *const u8, row_stride: v.strides[0], col_stride: v.strides[1] };
    if k == 0 {
        // An empty sum: zeros, as numpy gives.
        // SAFETY: the output is a contiguous (m, n) block (both callers' contract).
        unsafe { std::ptr::write_bytes(out.data as *mut u8, 0, out.numel() * out.dtype.size()) };
    } else if m > 0 && n > 0 {
        // SAFETY: views valid per the registry's contract (or the view lane's, the same); the
        // output is disjoint from both inputs.
        unsafe { mm::matmul(out.dtype, m, n, k, mat(a), mat(b), mat(out)) };
    }
}

/// `matmul` v1 with its view lane: two 2-D operands of one float dtype with matching inner
/// dimensions (everything else, promotion and errors included, takes the generic path).
fn matmul_op() -> Result<Arc<dyn Operator>> {
    Ok(Arc::new(native::op::<Matmul>()?.with_view_lane(ViewLane {
        accepts: |dtype| mm::MATMUL_DTYPES.contains(&dtype),
        out_dtype: |dtype| dtype,
        shape: Box::new(|shapes| match shapes {
            [&[m, k], &[k2, n]] if k == k2 => Some(Dims::from_slice(&[m, n])),
            _ => None,
        }),
        work_bytes: |shapes, dtype| match shapes {
            [&[m, k], &[_, n]] => m.saturating_mul(n).saturating_mul(k).saturating_mul(dtype.size()),
            _ => 0,
        },
        run: Box::new(|inputs, out| {
            matmul_views(&inputs[0], &inputs[1], out);
            Ok(())
        }),
    })))
}
