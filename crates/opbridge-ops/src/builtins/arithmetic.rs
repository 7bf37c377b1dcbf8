//! Elementwise operators with numpy broadcasting and arbitrary strides: binary arithmetic,
//! unary math and activations, dtype casts and layout copies.
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use opbridge_runtime::DType;

use super::{kernel, required};
use crate::error::{OpError, Result};
use crate::kernels::binary::{
    axpy as axpy_kernel, binary, binary_contiguous, binary_lane_accepts, binary_result_dtype, BinaryOp,
};
use crate::kernels::broadcast::broadcast_shapes;
use crate::kernels::cast::cast_view;
use crate::kernels::unary::{unary, unary_contiguous, unary_lane_accepts, unary_result_dtype, UnaryOp};
use crate::registry::{OpBuilder, OpDef};
use crate::schema::{AttrValue, Meta};
use crate::view::TensorView;

const FLOATS: [DType; 3] = [DType::F16, DType::F32, DType::F64];

pub fn all() -> Result<Vec<OpDef>> {
    let mut ops = Vec::new();
    for op in BinaryOp::ALL {
        ops.push(binary_op(op)?);
    }
    for op in UnaryOp::ALL {
        // The two gelu forms are one operator with `approximate=`, as in PyTorch.
        if !matches!(op, UnaryOp::GeluErf | UnaryOp::GeluTanh) {
            ops.push(unary_op(op)?);
        }
    }
    ops.push(axpy()?);
    ops.push(gelu()?);
    ops.push(cast()?);
    ops.push(contiguous()?);
    ops.push(transpose()?);
    Ok(ops)
}

fn binary_doc(op: BinaryOp) -> &'static str {
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
    let shape = broadcast_shapes(&[&a.shape, &b.shape]).map_err(|message| OpError::Shape {
        op,
        expected: "broadcastable shapes".into(),
        got: message,
    })?;
    Ok(Meta { dtype, shape: shape.into() })
}

fn binary_op(op: BinaryOp) -> Result<OpDef> {
    let name = op.name();
    OpBuilder::new(name, 1)
        .doc(binary_doc(op))
        .input("a")
        .input("b")
        .cast(move |inputs, _| {
            let dtype = binary_result_dtype(op, required(inputs, 0).dtype, required(inputs, 1).dtype);
            Ok(vec![Some(dtype), Some(dtype)])
        })
        .infer(move |inputs, _| {
            let (a, b) = (required(inputs, 0), required(inputs, 1));
            Ok(vec![broadcast_meta(name, a, b, binary_result_dtype(op, a.dtype, b.dtype))?])
        })
        .cpu(move |inputs, outputs, _| {
            let (a, b) = (inputs[0].as_ref().expect("a"), inputs[1].as_ref().expect("b"));
            // SAFETY: views valid per the registry's contract; the output is disjoint from the
            // inputs or exactly one of them (`in_place_ok`).
            unsafe { binary(op, a, b, &outputs[0]) }.map_err(kernel(name))
        })
        .in_place_ok()
        .lane(
            move |dtype| binary_lane_accepts(op, dtype),
            move |dtype, inputs, out, len| {
                // SAFETY: the lane's contract (see `Lane::run`), which is `binary_contiguous`'s.
                unsafe { binary_contiguous(op, dtype, inputs[0], inputs[1], out, len) };
                Ok(())
            },
        )
        .build()
}

/// BLAS's axpy, `alpha * x + y`: a float attribute on a binary elementwise op (the built-in
/// twin of the example plugins' `scale_add`, which `benchmarks/bench_plugin.py` compares).
fn axpy() -> Result<OpDef> {
    OpBuilder::new("axpy", 1)
        .doc("Elementwise `alpha * x + y` (BLAS's axpy), with broadcasting; float dtypes.")
        .input("x")
        .input("y")
        .attr("alpha", Some(AttrValue::Float(1.0)), "factor of x")
        .dtypes(&FLOATS)
        .cast(|inputs, _| {
            let dtype = required(inputs, 0).dtype.promote(required(inputs, 1).dtype);
            Ok(vec![Some(dtype), Some(dtype)])
        })
        .infer(|inputs, _| {
            let (x, y) = (required(inputs, 0), required(inputs, 1));
            Ok(vec![broadcast_meta("axpy", x, y, x.dtype.promote(y.dtype))?])
        })
        .cpu(|inputs, outputs, attrs| {
            let alpha = attrs.float("alpha")?;
            let (x, y) = (inputs[0].as_ref().expect("x"), inputs[1].as_ref().expect("y"));
            // SAFETY: as for the binary operators.
            unsafe { axpy_kernel(alpha, x, y, &outputs[0]) }.map_err(kernel("axpy"))
        })
        .in_place_ok()
        .build()
}

fn unary_doc(op: UnaryOp) -> &'static str {
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

fn unary_op(op: UnaryOp) -> Result<OpDef> {
    let name = op.name();
    OpBuilder::new(name, 1)
        .doc(unary_doc(op))
        .input("x")
        .cast(move |inputs, _| Ok(vec![Some(unary_result_dtype(op, required(inputs, 0).dtype))]))
        .infer(move |inputs, _| {
            let x = required(inputs, 0);
            Ok(vec![Meta { dtype: unary_result_dtype(op, x.dtype), shape: x.shape.clone() }])
        })
        .cpu(move |inputs, outputs, _| {
            // SAFETY: as for the binary operators.
            unsafe { unary(op, inputs[0].as_ref().expect("x"), &outputs[0]) }.map_err(kernel(name))
        })
        .in_place_ok()
        .lane(
            move |dtype| unary_lane_accepts(op, dtype),
            move |dtype, inputs, out, len| unary_lane(op, dtype, inputs, out, len),
        )
        .build()
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
            op: "gelu",
            message: format!("gelu: expected approximate='none' or 'tanh', got {other:?}"),
        }),
    }
}

fn gelu() -> Result<OpDef> {
    OpBuilder::new("gelu", 1)
        .doc(
            "GELU activation: `x * Phi(x)` with the exact erf form, or the tanh approximation with approximate='tanh'.",
        )
        .input("x")
        .attr("approximate", Some(AttrValue::Str("none".into())), "'none' (erf form) or 'tanh'.")
        .dtypes(&FLOATS)
        .infer(|inputs, attrs| {
            gelu_form(attrs.str("approximate")?)?;
            Ok(vec![required(inputs, 0).clone()])
        })
        .cpu(|inputs, outputs, attrs| {
            let op = gelu_form(attrs.str("approximate")?)?;
            // SAFETY: as for the binary operators.
            unsafe { unary(op, inputs[0].as_ref().expect("x"), &outputs[0]) }.map_err(kernel("gelu"))
        })
        .in_place_ok()
        // The lane serves calls without attributes: the default, erf form.
        .lane(
            |dtype| unary_lane_accepts(UnaryOp::GeluErf, dtype),
            |dtype, inputs, out, len| unary_lane(UnaryOp::GeluErf, dtype, inputs, out, len),
        )
        .build()
}

fn target_dtype(attrs: &crate::schema::Attrs) -> Result<DType> {
    let name = attrs.str("dtype")?;
    DType::from_name(name).ok_or_else(|| OpError::unsupported_dtype("cast", &DType::ALL, name))
}

fn cast() -> Result<OpDef> {
    OpBuilder::new("cast", 1)
        .doc("A copy converted to `dtype` (numpy's `astype`): floats to ints truncate toward zero, ints wrap.")
        .input("x")
        .attr("dtype", None, "Target dtype name: float16, float32, float64, int32 or int64.")
        .infer(|inputs, attrs| Ok(vec![Meta { dtype: target_dtype(attrs)?, shape: required(inputs, 0).shape.clone() }]))
        .cpu(|inputs, outputs, _| {
            // SAFETY: views valid per the registry's contract; the output is disjoint.
            unsafe { cast_view(inputs[0].as_ref().expect("x"), &outputs[0]) }.map_err(kernel("cast"))
        })
        .build()
}

fn contiguous() -> Result<OpDef> {
    OpBuilder::new("contiguous", 1)
        .doc("A C-contiguous copy of `x` (numpy's `ascontiguousarray`, always copying).")
        .input("x")
        .infer(|inputs, _| Ok(vec![required(inputs, 0).clone()]))
        .cpu(|inputs, outputs, _| {
            // SAFETY: as for `cast`.
            unsafe { cast_view(inputs[0].as_ref().expect("x"), &outputs[0]) }.map_err(kernel("contiguous"))
        })
        .build()
}

/// The permutation `axes` (default: reversed), checked like numpy's `transpose`.
fn permutation(ndim: usize, axes: &crate::schema::AttrValue) -> Result<Vec<usize>> {
    let bad = |message: String| OpError::Shape {
        op: "transpose",
        expected: format!("a permutation of 0..{ndim}"),
        got: message,
    };
    let axes: Vec<i64> = match axes {
        AttrValue::None => return Ok((0..ndim).rev().collect()),
        AttrValue::Ints(v) => v.clone(),
        other => return Err(bad(format!("{other}"))),
    };
    if axes.len() != ndim {
        return Err(bad(format!("{axes:?}")));
    }
    let mut seen = vec![false; ndim];
    let mut perm = Vec::with_capacity(ndim);
    for &axis in &axes {
        let a = if axis < 0 { axis + ndim as i64 } else { axis };
        if a < 0 || a >= ndim as i64 || seen[a as usize] {
            return Err(bad(format!("{axes:?}")));
        }
        seen[a as usize] = true;
        perm.push(a as usize);
    }
    Ok(perm)
}

fn transpose() -> Result<OpDef> {
    OpBuilder::new("transpose", 1)
        .doc("A contiguous copy of `x` with its axes permuted (`axes`, default reversed), like `np.transpose(x, axes).copy()`.")
        .input("x")
        .attr("axes", Some(AttrValue::None), "Permutation of the axes; None reverses them.")
        .infer(|inputs, attrs| {
            let x = required(inputs, 0);
            let perm = permutation(x.shape.len(), attrs.get("axes").unwrap_or(&AttrValue::None))?;
            Ok(vec![Meta { dtype: x.dtype, shape: perm.iter().map(|&a| x.shape[a]).collect() }])
        })
        .cpu(|inputs, outputs, attrs| {
            let x = inputs[0].as_ref().expect("x");
            let perm = permutation(x.ndim(), attrs.get("axes").unwrap_or(&AttrValue::None))?;
            let permuted = TensorView {
                data: x.data,
                dtype: x.dtype,
                shape: perm.iter().map(|&a| x.shape[a]).collect(),
                strides: perm.iter().map(|&a| x.strides[a]).collect(),
            };
            // SAFETY: a permutation of a valid view is valid; the output is disjoint.
            unsafe { cast_view(&permuted, &outputs[0]) }.map_err(kernel("transpose"))
        })
        .build()
}
