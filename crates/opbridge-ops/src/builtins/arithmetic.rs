//! Elementwise operators with numpy broadcasting and arbitrary strides: binary arithmetic,
//! unary math and activations, dtype casts and layout copies.
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use std::sync::Arc;

use opbridge_plugin_sdk::{Attr, Attrs, DType, InPlace, InputDtypesFn, Inputs, Meta, Op, Tensor, TensorMut};

use super::{kernel, promote_both, OpResult, IN_PLACE_OK};
use crate::cpu::binary::{
    axpy as axpy_kernel, binary, binary_contiguous, binary_lane_accepts, binary_result_dtype, BinaryOp,
};
use crate::cpu::broadcast::broadcast_shapes;
use crate::cpu::cast::cast_view;
use crate::cpu::unary::{unary, unary_contiguous, unary_lane_accepts, unary_result_dtype, UnaryOp};
use crate::error::{OpError, Result};
use crate::native::{self, view, view_mut};
use crate::registry::{Batching, Operator};
use crate::view::TensorView;

const FLOATS: [DType; 3] = [DType::F16, DType::F32, DType::F64];

pub fn all() -> Result<Vec<Arc<dyn Operator>>> {
    Ok(vec![
        binary_op::<0>()?,
        binary_op::<1>()?,
        binary_op::<2>()?,
        binary_op::<3>()?,
        binary_op::<4>()?,
        binary_op::<5>()?,
        binary_op::<6>()?,
        // `UnaryOp::ALL` less the two gelu forms (8, 9): one operator with `approximate=`, as
        // in PyTorch (`Unary` refuses them at compile time).
        unary_op::<0>()?,
        unary_op::<1>()?,
        unary_op::<2>()?,
        unary_op::<3>()?,
        unary_op::<4>()?,
        unary_op::<5>()?,
        unary_op::<6>()?,
        unary_op::<7>()?,
        unary_op::<10>()?,
        Arc::new(native::op::<Axpy>()?.with_batching(Batching::ELEMENTWISE)),
        Arc::new(
            native::op::<Gelu>()?
                .with_lane(
                    // The lane serves calls without attributes: the default, erf form.
                    |dtype| unary_lane_accepts(UnaryOp::GeluErf, dtype),
                    |dtype, inputs, out, len| unary_lane(UnaryOp::GeluErf, dtype, inputs, out, len),
                )
                .with_batching(Batching::ELEMENTWISE),
        ),
        Arc::new(native::op::<Cast>()?.with_batching(Batching::ELEMENTWISE)),
        Arc::new(native::op::<Contiguous>()?),
        Arc::new(native::op::<Transpose>()?),
    ])
}

// Every binary and unary kernel op has its operator above.
const _: () = assert!(BinaryOp::ALL.len() == 7 && UnaryOp::ALL.len() == 11);

const fn binary_doc(op: BinaryOp) -> &'static str {
    match op {
        BinaryOp::Add => "Elementwise `a + b` (numpy's `np.add`), with broadcasting. Integers wrap on overflow.",
        BinaryOp::Sub => "Elementwise `a - b` (numpy's `np.subtract`), with broadcasting.",
        BinaryOp::Mul => "Elementwise `a * b` (numpy's `np.multiply`), with broadcasting.",
        BinaryOp::Div => "Elementwise true division `a / b` (numpy's `np.divide`); integers give float64.",
        BinaryOp::Maximum => "Elementwise maximum (numpy's `np.maximum`); NaN propagates.",
        BinaryOp::Minimum => "Elementwise minimum (numpy's `np.minimum`); NaN propagates.",
        BinaryOp::Pow => "Elementwise `a ** b` (numpy's `np.power`); negative integer powers of integers are an error.",
    }
}

/// The output of a binary elementwise op: `a` and `b` broadcast together, of `dtype`.
fn broadcast_meta(op: &'static str, a: &Meta, b: &Meta, dtype: DType) -> Result<Meta> {
    let shape = broadcast_shapes(&[&a.shape, &b.shape]).map_err(kernel(op))?;
    Ok(Meta { dtype, shape })
}

/// The binary operator `BinaryOp::ALL[K]`, with its fast lane.
fn binary_op<const K: usize>() -> Result<Arc<dyn Operator>> {
    let op = Binary::<K>::OP;
    Ok(Arc::new(
        native::op::<Binary<K>>()?
            .with_lane(
                move |dtype| binary_lane_accepts(op, dtype),
                move |dtype, inputs, out, len| {
                    // SAFETY: the lane's contract (see `Lane::run`), which is `binary_contiguous`'s.
                    unsafe { binary_contiguous(op, dtype, inputs[0], inputs[1], out, len) };
                    Ok(())
                },
            )
            .with_batching(Batching::ELEMENTWISE),
    ))
}

/// The binary operator `BinaryOp::ALL[K]`.
struct Binary<const K: usize>;

impl<const K: usize> Binary<K> {
    const OP: BinaryOp = BinaryOp::ALL[K];

    fn input_dtypes(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Option<DType>>> {
        let dtype = binary_result_dtype(Self::OP, inputs[0].dtype, inputs[1].dtype);
        Ok(vec![Some(dtype), Some(dtype)])
    }
}

impl<const K: usize> Op for Binary<K> {
    const NAME: &'static str = Self::OP.name();
    const VERSION: u32 = 1;
    const DOC: &'static str = binary_doc(Self::OP);
    const INPUTS: &'static [&'static str] = &["a", "b"];
    const DTYPES: &'static [DType] = &DType::ALL;
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(Self::input_dtypes);
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let (a, b) = (&inputs[0], &inputs[1]);
        Ok(vec![broadcast_meta(Self::NAME, a, b, binary_result_dtype(Self::OP, a.dtype, b.dtype))?])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (a, b, out) = (view(&inputs[0]), view(&inputs[1]), view_mut(&mut outputs[0]));
        // SAFETY: views valid per the registry's contract; the output is disjoint from the
        // inputs or exactly one of them (`IN_PLACE`).
        Ok(unsafe { binary(Self::OP, &a, &b, &out) }.map_err(kernel(Self::NAME))?)
    }
}

/// BLAS's axpy, `alpha * x + y`: a float attribute on a binary elementwise op (the built-in
/// twin of the example plugins' `scale_add`, which `benchmarks/bench_plugin.py` compares).
struct Axpy;

impl Op for Axpy {
    const NAME: &'static str = "axpy";
    const VERSION: u32 = 1;
    const DOC: &'static str = "Elementwise `alpha * x + y` (BLAS's axpy), with broadcasting; float dtypes.";
    const INPUTS: &'static [&'static str] = &["x", "y"];
    const ATTRS: &'static [Attr] = &[Attr::float("alpha", 1.0).doc("factor of x")];
    const DTYPES: &'static [DType] = &FLOATS;
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(promote_both);
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let (x, y) = (&inputs[0], &inputs[1]);
        Ok(vec![broadcast_meta(Self::NAME, x, y, x.dtype.promote(y.dtype))?])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let alpha = attrs.float("alpha")?;
        let (x, y, out) = (view(&inputs[0]), view(&inputs[1]), view_mut(&mut outputs[0]));
        // SAFETY: as for the binary operators.
        Ok(unsafe { axpy_kernel(alpha, &x, &y, &out) }.map_err(kernel(Self::NAME))?)
    }
}

const fn unary_doc(op: UnaryOp) -> &'static str {
    match op {
        UnaryOp::Neg => "Elementwise `-x`.",
        UnaryOp::Abs => "Elementwise absolute value (`abs` of the most negative integer wraps, as in numpy).",
        UnaryOp::Exp => "Elementwise `e ** x`; integers give float64.",
        UnaryOp::Log => "Elementwise natural logarithm: log(0) = -inf, log(x < 0) = nan; integers give float64.",
        UnaryOp::Sqrt => "Elementwise square root: sqrt(x < 0) = nan; integers give float64.",
        UnaryOp::Relu => "Elementwise `max(x, 0)`; NaN propagates.",
        UnaryOp::Sigmoid => "Elementwise logistic `1 / (1 + e ** -x)`, computed without overflow.",
        UnaryOp::Tanh => "Elementwise hyperbolic tangent.",
        UnaryOp::Silu => "Elementwise `x * sigmoid(x)` (SiLU / swish).",
        UnaryOp::GeluErf | UnaryOp::GeluTanh => "GELU.",
    }
}

/// The unary operator `UnaryOp::ALL[K]`, with its fast lane.
fn unary_op<const K: usize>() -> Result<Arc<dyn Operator>> {
    let op = Unary::<K>::OP;
    Ok(Arc::new(
        native::op::<Unary<K>>()?
            .with_lane(
                move |dtype| unary_lane_accepts(op, dtype),
                move |dtype, inputs, out, len| unary_lane(op, dtype, inputs, out, len),
            )
            .with_batching(Batching::ELEMENTWISE),
    ))
}

/// The unary operator `UnaryOp::ALL[K]` (not a gelu form: those are [`Gelu`]).
struct Unary<const K: usize>;

impl<const K: usize> Unary<K> {
    const OP: UnaryOp = {
        let op = UnaryOp::ALL[K];
        assert!(!matches!(op, UnaryOp::GeluErf | UnaryOp::GeluTanh), "the gelu forms are the `gelu` operator");
        op
    };

    fn input_dtypes(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Option<DType>>> {
        Ok(vec![Some(unary_result_dtype(Self::OP, inputs[0].dtype))])
    }
}

impl<const K: usize> Op for Unary<K> {
    const NAME: &'static str = Self::OP.name();
    const VERSION: u32 = 1;
    const DOC: &'static str = unary_doc(Self::OP);
    const INPUTS: &'static [&'static str] = &["x"];
    const DTYPES: &'static [DType] = &DType::ALL;
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(Self::input_dtypes);
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let x = &inputs[0];
        Ok(vec![Meta::new(unary_result_dtype(Self::OP, x.dtype), &x.shape)])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (x, out) = (view(&inputs[0]), view_mut(&mut outputs[0]));
        // SAFETY: as for the binary operators.
        Ok(unsafe { unary(Self::OP, &x, &out) }.map_err(kernel(Self::NAME))?)
    }
}

fn unary_lane(op: UnaryOp, dtype: DType, inputs: &[usize], out: usize, len: usize) -> Result<()> {
    // SAFETY: the lane's contract (see `Lane::run`), which is `unary_contiguous`'s.
    unsafe { unary_contiguous(op, dtype, inputs[0], out, len) }.map_err(kernel(op.name()))
}

fn gelu_form(approximate: &str) -> Result<UnaryOp> {
    match approximate {
        "none" => Ok(UnaryOp::GeluErf),
        "tanh" => Ok(UnaryOp::GeluTanh),
        other => Err(OpError::Argument {
            op: "gelu".into(),
            message: format!("expected approximate='none' or 'tanh', got {other:?}"),
        }),
    }
}

struct Gelu;

impl Op for Gelu {
    const NAME: &'static str = "gelu";
    const VERSION: u32 = 1;
    const DOC: &'static str =
        "GELU activation: `x * Phi(x)` with the exact erf form, or the tanh approximation with approximate='tanh'.";
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = &[Attr::str("approximate", "none").doc("'none' (erf form) or 'tanh'.")];
    const DTYPES: &'static [DType] = &FLOATS;
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        gelu_form(attrs.str("approximate")?)?;
        Ok(vec![inputs[0].clone()])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let op = gelu_form(attrs.str("approximate")?)?;
        let (x, out) = (view(&inputs[0]), view_mut(&mut outputs[0]));
        // SAFETY: as for the binary operators.
        Ok(unsafe { unary(op, &x, &out) }.map_err(kernel(Self::NAME))?)
    }
}

struct Cast;

impl Op for Cast {
    const NAME: &'static str = "cast";
    const VERSION: u32 = 1;
    const DOC: &'static str =
        "A copy converted to `dtype` (numpy's `astype`): floats to ints truncate toward zero, ints wrap.";
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] =
        &[Attr::str("dtype", "").required().doc("Target dtype name: float16, float32, float64, int32 or int64.")];
    const DTYPES: &'static [DType] = &DType::ALL;

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let name = attrs.str("dtype")?;
        let dtype = DType::from_name(name).ok_or_else(|| OpError::unsupported_dtype("cast", &DType::ALL, name))?;
        Ok(vec![Meta::new(dtype, &inputs[0].shape)])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        copy_into(Self::NAME, &inputs[0], &mut outputs[0])
    }
}

/// `out = x` converted to `out`'s dtype and layout (`cast` and `contiguous`).
fn copy_into(op: &'static str, x: &Tensor<'_>, out: &mut TensorMut<'_>) -> OpResult<()> {
    let (x, out) = (view(x), view_mut(out));
    // SAFETY: views valid per the registry's contract; the output is disjoint.
    Ok(unsafe { cast_view(&x, &out) }.map_err(kernel(op))?)
}

struct Contiguous;

impl Op for Contiguous {
    const NAME: &'static str = "contiguous";
    const VERSION: u32 = 1;
    const DOC: &'static str = "A C-contiguous copy of `x` (numpy's `ascontiguousarray`, always copying).";
    const INPUTS: &'static [&'static str] = &["x"];
    const DTYPES: &'static [DType] = &DType::ALL;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        copy_into(Self::NAME, &inputs[0], &mut outputs[0])
    }
}

/// The permutation `axes` (`None`: reversed), checked like numpy's `transpose`.
fn permutation(ndim: usize, axes: Option<&[i64]>) -> Result<Vec<usize>> {
    let Some(axes) = axes else {
        return Ok((0..ndim).rev().collect());
    };
    let bad = || OpError::Shape {
        op: "transpose".into(),
        expected: format!("a permutation of 0..{ndim}"),
        got: format!("{axes:?}"),
    };
    if axes.len() != ndim {
        return Err(bad());
    }
    let mut seen = vec![false; ndim];
    let mut perm = Vec::with_capacity(ndim);
    for &axis in axes {
        let a = if axis < 0 { axis + ndim as i64 } else { axis };
        if a < 0 || a >= ndim as i64 || seen[a as usize] {
            return Err(bad());
        }
        seen[a as usize] = true;
        perm.push(a as usize);
    }
    Ok(perm)
}

struct Transpose;

impl Op for Transpose {
    const NAME: &'static str = "transpose";
    const VERSION: u32 = 1;
    const DOC: &'static str = concat!(
        "A contiguous copy of `x` with its axes permuted (`axes`, default reversed), ",
        "like `np.transpose(x, axes).copy()`."
    );
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] =
        &[Attr::ints("axes", &[]).default_none().doc("Permutation of the axes; None reverses them.")];
    const DTYPES: &'static [DType] = &DType::ALL;

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let x = &inputs[0];
        let perm = permutation(x.shape.len(), attrs.opt_ints("axes")?)?;
        Ok(vec![Meta { dtype: x.dtype, shape: perm.iter().map(|&a| x.shape[a]).collect() }])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (x, out) = (view(&inputs[0]), view_mut(&mut outputs[0]));
        let perm = permutation(x.ndim(), attrs.opt_ints("axes")?)?;
        let permuted = TensorView {
            data: x.data,
            dtype: x.dtype,
            shape: perm.iter().map(|&a| x.shape[a]).collect(),
            strides: perm.iter().map(|&a| x.strides[a]).collect(),
        };
        // SAFETY: a permutation of a valid view is valid; the output is disjoint.
        Ok(unsafe { cast_view(&permuted, &out) }.map_err(kernel(Self::NAME))?)
    }
}
