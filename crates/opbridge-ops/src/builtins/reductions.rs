//! Reductions, normalizations, embedding bags and batched matmul.
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use opbridge_runtime::DType;

use super::{kernel, required};
use crate::error::{OpError, Result};
use crate::kernels::batched::{batched_matmul, matmul_shapes};
use crate::kernels::embedding::{embedding_bag, BagMode};
use crate::kernels::nn;
use crate::kernels::reduce::{normalize_axis, reduce, reduce_result_dtype, reduce_shape, ReduceOp};
use crate::registry::{OpBuilder, OpDef};
use crate::schema::{AttrValue, Attrs, Meta};

const FLOATS: [DType; 3] = [DType::F16, DType::F32, DType::F64];
const INTS: [DType; 2] = [DType::I32, DType::I64];

fn shape_error(op: &'static str) -> impl Fn(String) -> OpError {
    move |message| OpError::Shape { op, expected: "a valid axis and shape".into(), got: message }
}

pub fn all() -> Result<Vec<OpDef>> {
    let mut ops = Vec::new();
    for op in ReduceOp::ALL {
        ops.push(reduction(op)?);
    }
    ops.push(softmax("softmax", false)?);
    ops.push(softmax("log_softmax", true)?);
    ops.push(layer_norm()?);
    ops.push(rms_norm()?);
    ops.push(embedding()?);
    ops.push(batched()?);
    Ok(ops)
}

fn axis_of(attrs: &Attrs) -> Result<Option<isize>> {
    Ok(attrs.opt_int("axis")?.map(|a| a as isize))
}

fn reduction_doc(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "Sum over `axis` (all axes when None), pairwise like numpy; int32 sums give int64.",
        ReduceOp::Mean => "Arithmetic mean over `axis` (all when None); integers give float64; empty gives nan.",
        ReduceOp::Max => "Maximum over `axis` (all when None); NaN propagates; empty is an error.",
        ReduceOp::Min => "Minimum over `axis` (all when None); NaN propagates; empty is an error.",
        ReduceOp::ArgMax => "Index of the first maximum over `axis` (flat index when None), as int64.",
    }
}

fn reduction(op: ReduceOp) -> Result<OpDef> {
    let name = op.name();
    let mut builder = OpBuilder::new(name, 1).doc(reduction_doc(op)).input("x");
    builder = builder.attr("axis", Some(AttrValue::None), "Axis to reduce (negative counts from the end); None: all.");
    if op != ReduceOp::ArgMax {
        builder = builder.attr("keepdims", Some(AttrValue::Bool(false)), "Keep reduced axes with size 1.");
    }
    builder
        .infer(move |inputs, attrs| {
            let x = required(inputs, 0);
            let keepdims = op != ReduceOp::ArgMax && attrs.bool("keepdims")?;
            let shape = reduce_shape(&x.shape, axis_of(attrs)?, keepdims).map_err(shape_error(name))?;
            Ok(vec![Meta { dtype: reduce_result_dtype(op, x.dtype), shape: shape.into() }])
        })
        .cpu(move |inputs, outputs, attrs| {
            // SAFETY: views valid per the registry's contract; the output is disjoint.
            unsafe { reduce(op, inputs[0].as_ref().expect("x"), axis_of(attrs)?, &outputs[0]) }.map_err(kernel(name))
        })
        .build()
}

fn softmax(name: &'static str, log: bool) -> Result<OpDef> {
    let doc = if log {
        "log(softmax(x)) along `axis`, computed stably as `x - max - log(sum(exp(x - max)))`."
    } else {
        "Softmax along `axis`: `exp(x - max) / sum(exp(x - max))`, numerically stable."
    };
    OpBuilder::new(name, 1)
        .doc(doc)
        .input("x")
        .attr("axis", Some(AttrValue::Int(-1)), "Axis to normalize over.")
        .dtypes(&FLOATS)
        .infer(move |inputs, attrs| {
            let x = required(inputs, 0);
            normalize_axis(attrs.int("axis")? as isize, x.shape.len().max(1)).map_err(shape_error(name))?;
            Ok(vec![x.clone()])
        })
        .cpu(move |inputs, outputs, attrs| {
            let (x, axis) = (inputs[0].as_ref().expect("x"), attrs.int("axis")? as isize);
            // SAFETY: as for the reductions; `out` may be exactly `x` (in place).
            let done = unsafe {
                if log {
                    nn::log_softmax(x, axis, &outputs[0])
                } else {
                    nn::softmax(x, axis, &outputs[0])
                }
            };
            done.map_err(kernel(name))
        })
        .in_place_ok()
        .build()
}

/// Checks an optional per-feature parameter of shape `(last,)`.
fn check_param(op: &'static str, what: &str, x: &Meta, param: Option<&Meta>) -> Result<()> {
    let Some(p) = param else { return Ok(()) };
    let last = x.shape.last().copied().unwrap_or(1);
    if p.shape.as_slice() != [last] {
        return Err(OpError::Shape {
            op,
            expected: format!("{what} of shape ({last},)"),
            got: format!("{:?}", p.shape),
        });
    }
    Ok(())
}

/// Optional parameters take x's dtype (one conversion, like numpy's promotion would need).
fn params_like_x(inputs: &[Option<Meta>], _: &Attrs) -> Result<Vec<Option<DType>>> {
    let dtype = required(inputs, 0).dtype;
    Ok(inputs.iter().map(|m| m.as_ref().map(|_| dtype)).collect())
}

fn layer_norm() -> Result<OpDef> {
    OpBuilder::new("layer_norm", 1)
        .doc("Normalizes over the last axis: `(x - mean) / sqrt(var + eps) * weight + bias` (biased variance, as torch).")
        .input("x")
        .optional_input("weight")
        .optional_input("bias")
        .attr("eps", Some(AttrValue::Float(1e-5)), "Added to the variance.")
        .dtypes(&FLOATS)
        .cast(params_like_x)
        .infer(|inputs, _| {
            let x = required(inputs, 0);
            check_param("layer_norm", "weight", x, inputs[1].as_ref())?;
            check_param("layer_norm", "bias", x, inputs[2].as_ref())?;
            Ok(vec![x.clone()])
        })
        .cpu(|inputs, outputs, attrs| {
            let x = inputs[0].as_ref().expect("x");
            // SAFETY: as for softmax.
            unsafe { nn::layer_norm(x, inputs[1].as_ref(), inputs[2].as_ref(), attrs.float("eps")?, &outputs[0]) }
                .map_err(kernel("layer_norm"))
        })
        .in_place_ok()
        .build()
}

fn rms_norm() -> Result<OpDef> {
    OpBuilder::new("rms_norm", 1)
        .doc("Root-mean-square normalization over the last axis: `x / sqrt(mean(x**2) + eps) * weight`.")
        .input("x")
        .optional_input("weight")
        .attr("eps", Some(AttrValue::Float(1e-6)), "Added to the mean square.")
        .dtypes(&FLOATS)
        .cast(params_like_x)
        .infer(|inputs, _| {
            let x = required(inputs, 0);
            check_param("rms_norm", "weight", x, inputs[1].as_ref())?;
            Ok(vec![x.clone()])
        })
        .cpu(|inputs, outputs, attrs| {
            let x = inputs[0].as_ref().expect("x");
            // SAFETY: as for softmax.
            unsafe { nn::rms_norm(x, inputs[1].as_ref(), attrs.float("eps")?, &outputs[0]) }.map_err(kernel("rms_norm"))
        })
        .in_place_ok()
        .build()
}

fn bag_mode(attrs: &Attrs) -> Result<BagMode> {
    match attrs.str("mode")? {
        "sum" => Ok(BagMode::Sum),
        "mean" => Ok(BagMode::Mean),
        "max" => Ok(BagMode::Max),
        other => Err(OpError::Argument {
            op: "embedding_bag",
            message: format!("embedding_bag: expected mode 'sum', 'mean' or 'max', got {other:?}"),
        }),
    }
}

fn embedding() -> Result<OpDef> {
    OpBuilder::new("embedding_bag", 1)
        .doc(
            "Sums (or averages, or maxes) rows of `weight` (num_embeddings, dim) picked by `indices`, one bag per \
             entry of `offsets` (bag starts, as torch.nn.functional.embedding_bag). Out-of-range indices and \
             invalid offsets are errors, checked before any row is read.",
        )
        .input("weight")
        .input("indices")
        .input("offsets")
        .attr("mode", Some(AttrValue::Str("sum".into())), "'sum', 'mean' or 'max'.")
        .infer(|inputs, attrs| {
            bag_mode(attrs)?;
            let (w, idx, off) = (required(inputs, 0), required(inputs, 1), required(inputs, 2));
            if !FLOATS.contains(&w.dtype) {
                return Err(OpError::unsupported_dtype("embedding_bag", &FLOATS, format!("{} for weight", w.dtype)));
            }
            for (what, m) in [("indices", idx), ("offsets", off)] {
                if !INTS.contains(&m.dtype) {
                    return Err(OpError::unsupported_dtype("embedding_bag", &INTS, format!("{} for {what}", m.dtype)));
                }
                if m.shape.len() != 1 {
                    return Err(OpError::Shape {
                        op: "embedding_bag",
                        expected: format!("1-D {what}"),
                        got: format!("{:?}", m.shape),
                    });
                }
            }
            let [_, dim] = w.shape[..] else {
                return Err(OpError::Shape {
                    op: "embedding_bag",
                    expected: "2-D weight".into(),
                    got: format!("{:?}", w.shape),
                });
            };
            Ok(vec![Meta { dtype: w.dtype, shape: [off.shape[0], dim].as_slice().into() }])
        })
        .cpu(|inputs, outputs, attrs| {
            let get = |i: usize| inputs[i].as_ref().expect("required input");
            // SAFETY: views valid per the registry's contract; every index is checked by the
            // kernel before any row is read; the output is disjoint.
            unsafe { embedding_bag(get(0), get(1), get(2), bag_mode(attrs)?, &outputs[0]) }
                .map_err(kernel("embedding_bag"))
        })
        .build()
}

fn batched() -> Result<OpDef> {
    OpBuilder::new("matmul", 2)
        .doc(
            "Matrix product with numpy's `@` rules: 1-D operands are promoted, batch dimensions broadcast. \
             float16 accumulates in float32; integers wrap.",
        )
        .input("a")
        .input("b")
        .cast(|inputs, _| {
            let dtype = required(inputs, 0).dtype.promote(required(inputs, 1).dtype);
            Ok(vec![Some(dtype), Some(dtype)])
        })
        .infer(|inputs, _| {
            let (a, b) = (required(inputs, 0), required(inputs, 1));
            let shape = matmul_shapes(&a.shape, &b.shape).map_err(|message| OpError::Shape {
                op: "matmul",
                expected: "shapes valid for `@`".into(),
                got: message,
            })?;
            Ok(vec![Meta { dtype: a.dtype.promote(b.dtype), shape: shape.into() }])
        })
        .cpu(|inputs, outputs, _| {
            let (a, b) = (inputs[0].as_ref().expect("a"), inputs[1].as_ref().expect("b"));
            // SAFETY: views valid per the registry's contract; the output is disjoint (matmul is
            // not `in_place_ok`, so overlapping outputs are computed aside).
            unsafe { batched_matmul(a, b, &outputs[0]) }.map_err(kernel("matmul"))
        })
        .build()
}
