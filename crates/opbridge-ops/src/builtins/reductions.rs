//! Reductions, normalizations, embedding bags and batched matmul.
#![allow(unsafe_code)] // kernels run on views whose validity the registry's callers guarantee.

use std::sync::Arc;

use opbridge_plugin_sdk::{Attr, Attrs, DType, InPlace, InputDtypesFn, Inputs, Meta, Op, Tensor, TensorMut};

use super::{kernel, promote_both, OpResult, IN_PLACE_OK};
use crate::cpu::batched::{batched_matmul, matmul_shapes};
use crate::cpu::embedding::{embedding_bag, BagMode};
use crate::cpu::nn;
use crate::cpu::reduce::{normalize_axis, reduce, reduce_result_dtype, reduce_shape, ReduceOp};
use crate::error::{OpError, Result};
use crate::native::{self, view, view_mut};
use crate::registry::{Batching, Operator, ViewLane};
use crate::schema::{AttrValue, Attrs as HostAttrs, Meta as HostMeta};
use crate::view::Dims;

const FLOATS: [DType; 3] = [DType::F16, DType::F32, DType::F64];
const INTS: [DType; 2] = [DType::I32, DType::I64];

pub fn all() -> Result<Vec<Arc<dyn Operator>>> {
    fn arc<O: Op>() -> Result<Arc<dyn Operator>> {
        Ok(Arc::new(native::op::<O>()?))
    }
    fn batched<O: Op>(batching: Batching) -> Result<Arc<dyn Operator>> {
        Ok(Arc::new(native::op::<O>()?.with_batching(batching)))
    }
    const _: () = assert!(ReduceOp::ALL.len() == 5, "register every reduction below");
    Ok(vec![
        reduction::<0>()?,
        reduction::<1>()?,
        reduction::<2>()?,
        reduction::<3>()?,
        reduction::<4>()?,
        batched::<Softmax<false>>(SOFTMAX_ROWS)?,
        batched::<Softmax<true>>(SOFTMAX_ROWS)?,
        batched::<LayerNorm>(Batching { shared: &[1, 2], accepts: NORM_ROWS })?,
        batched::<RmsNorm>(Batching { shared: &[1], accepts: NORM_ROWS })?,
        Arc::new(native::op::<EmbeddingBag>()?.with_value_check(embedding_bag_values)),
        // No batching: see the note on matmul v1.
        arc::<BatchedMatmul>()?,
    ])
}

/// softmax over an axis other than 0 works row by row along axis 0.
const SOFTMAX_ROWS: Batching = Batching {
    shared: &[],
    accepts: |inputs, attrs| match (inputs, attrs.get("axis")) {
        ([Some(x)], Some(AttrValue::Int(axis))) => {
            let rank = x.shape.len() as i64;
            rank >= 2 && (-rank..rank).contains(axis) && axis.rem_euclid(rank) != 0
        }
        _ => false,
    },
};

/// The norms work over the last axis: rows along axis 0 when `x` has two axes or more.
const NORM_ROWS: fn(&[Option<HostMeta>], &HostAttrs) -> bool =
    |inputs, _| matches!(inputs.first(), Some(Some(x)) if x.shape.len() >= 2);

/// `ReduceOp::ALL[K]` with its view lane: `op(x)` over every axis of a non-empty `x` of any
/// dtype and strides, with the attributes' defaults (the call numpy users write most), skips the
/// generic description of the call (attribute binding, shape rule, plan): 0.7 µs of a 64K
/// float32 `argmax`'s 4 µs. Other calls, empty ones and errors take the generic path.
fn reduction<const K: usize>() -> Result<Arc<dyn Operator>> {
    Ok(Arc::new(native::op::<Reduction<K>>()?.with_view_lane(ViewLane {
        accepts: |_| true,
        out_dtype: |dtype| reduce_result_dtype(Reduction::<K>::OP, dtype),
        shape: Box::new(|shapes| match shapes {
            [x] if x.iter().all(|&d| d > 0) => Some(Dims::new()),
            _ => None,
        }),
        work_bytes: |shapes, dtype| {
            shapes.first().map_or(0, |x| x.iter().product::<usize>().saturating_mul(dtype.size()))
        },
        run: Box::new(|inputs, out| {
            // SAFETY: views valid per the view lane's contract; the output is disjoint.
            unsafe { reduce(Reduction::<K>::OP, &inputs[0], None, out) }.map_err(kernel(Reduction::<K>::NAME))
        }),
    })))
}

/// `ReduceOp::ALL[K]` (`sum`, `mean`, `max`, `min`, `argmax`).
struct Reduction<const K: usize>;

impl<const K: usize> Reduction<K> {
    const OP: ReduceOp = ReduceOp::ALL[K];
    const KEEPDIMS: bool = !matches!(Self::OP, ReduceOp::ArgMax);

    fn axis(attrs: &Attrs<'_>) -> OpResult<Option<isize>> {
        Ok(attrs.opt_int("axis")?.map(|a| a as isize))
    }
}

const AXIS_ATTR: Attr =
    Attr::int("axis", 0).default_none().doc("Axis to reduce (negative counts from the end); None: all.");
const REDUCE_ATTRS: &[Attr] = &[AXIS_ATTR, Attr::bool("keepdims", false).doc("Keep reduced axes with size 1.")];
/// argmax takes no `keepdims`.
const ARGMAX_ATTRS: &[Attr] = &[AXIS_ATTR];

const fn reduction_doc(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "Sum over `axis` (all axes when None), pairwise like numpy; int32 sums give int64.",
        ReduceOp::Mean => "Arithmetic mean over `axis` (all when None); integers give float64; empty gives nan.",
        ReduceOp::Max => "Maximum over `axis` (all when None); NaN propagates; empty is an error.",
        ReduceOp::Min => "Minimum over `axis` (all when None); NaN propagates; empty is an error.",
        ReduceOp::ArgMax => "Index of the first maximum over `axis` (flat index when None), as int64.",
    }
}

impl<const K: usize> Op for Reduction<K> {
    const NAME: &'static str = Self::OP.name();
    const VERSION: u32 = 1;
    const DOC: &'static str = reduction_doc(Self::OP);
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = if Self::KEEPDIMS { REDUCE_ATTRS } else { ARGMAX_ATTRS };
    const DTYPES: &'static [DType] = &DType::ALL;

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let x = &inputs[0];
        let keepdims = Self::KEEPDIMS && attrs.bool("keepdims")?;
        let shape = reduce_shape(&x.shape, Self::axis(attrs)?, keepdims).map_err(kernel(Self::NAME))?;
        Ok(vec![Meta { dtype: reduce_result_dtype(Self::OP, x.dtype), shape }])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (x, out) = (view(&inputs[0]), view_mut(&mut outputs[0]));
        // SAFETY: views valid per the registry's contract; the output is disjoint.
        Ok(unsafe { reduce(Self::OP, &x, Self::axis(attrs)?, &out) }.map_err(kernel(Self::NAME))?)
    }
}

/// `softmax`, or `log_softmax` when `LOG`.
struct Softmax<const LOG: bool>;

impl<const LOG: bool> Op for Softmax<LOG> {
    const NAME: &'static str = if LOG { "log_softmax" } else { "softmax" };
    const VERSION: u32 = 1;
    const DOC: &'static str = if LOG {
        "log(softmax(x)) along `axis`, computed stably as `x - max - log(sum(exp(x - max)))`."
    } else {
        "Softmax along `axis`: `exp(x - max) / sum(exp(x - max))`, numerically stable."
    };
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = &[Attr::int("axis", -1).doc("Axis to normalize over.")];
    const DTYPES: &'static [DType] = &FLOATS;
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let x = &inputs[0];
        normalize_axis(attrs.int("axis")? as isize, x.shape.len().max(1)).map_err(kernel(Self::NAME))?;
        Ok(vec![x.clone()])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (x, out, axis) = (view(&inputs[0]), view_mut(&mut outputs[0]), attrs.int("axis")? as isize);
        // SAFETY: as for the reductions; `out` may be exactly `x` (`IN_PLACE`).
        let done = unsafe {
            if LOG {
                nn::log_softmax(&x, axis, &out)
            } else {
                nn::softmax(&x, axis, &out)
            }
        };
        Ok(done.map_err(kernel(Self::NAME))?)
    }
}

/// Checks an optional per-feature parameter of shape `(last,)`.
fn check_param(op: &'static str, what: &str, x: &Meta, param: Option<&Meta>) -> Result<()> {
    let Some(p) = param else { return Ok(()) };
    let last = x.shape.last().copied().unwrap_or(1);
    if p.shape.as_slice() != [last] {
        return Err(OpError::Shape {
            op: op.into(),
            expected: format!("{what} of shape ({last},)"),
            got: format!("{:?}", p.shape),
        });
    }
    Ok(())
}

/// Optional parameters take x's dtype (one conversion, like numpy's promotion would need).
fn params_like_x(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Option<DType>>> {
    let dtype = inputs[0].dtype;
    Ok(inputs.iter().map(|m| m.map(|_| dtype)).collect())
}

struct LayerNorm;

impl Op for LayerNorm {
    const NAME: &'static str = "layer_norm";
    const VERSION: u32 = 1;
    const DOC: &'static str =
        "Normalizes over the last axis: `(x - mean) / sqrt(var + eps) * weight + bias` (biased variance, as torch).";
    const INPUTS: &'static [&'static str] = &["x", "weight", "bias"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["weight", "bias"];
    const ATTRS: &'static [Attr] = &[Attr::float("eps", 1e-5).doc("Added to the variance.")];
    const DTYPES: &'static [DType] = &FLOATS;
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(params_like_x);
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let x = &inputs[0];
        check_not_scalar(Self::NAME, x)?;
        check_param(Self::NAME, "weight", x, inputs.opt(1))?;
        check_param(Self::NAME, "bias", x, inputs.opt(2))?;
        Ok(vec![x.clone()])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (x, out) = (view(&inputs[0]), view_mut(&mut outputs[0]));
        let (weight, bias) = (inputs.opt(1).map(view), inputs.opt(2).map(view));
        // SAFETY: as for softmax.
        Ok(unsafe { nn::layer_norm(&x, weight.as_ref(), bias.as_ref(), attrs.float("eps")?, &out) }
            .map_err(kernel(Self::NAME))?)
    }
}

struct RmsNorm;

/// A norm over the last axis needs one: a 0-d `x` is a shape error at planning, on every device.
fn check_not_scalar(op: &'static str, x: &Meta) -> OpResult<()> {
    if x.shape.is_empty() {
        Err(OpError::Shape {
            op: op.into(),
            expected: "x with at least one dimension".into(),
            got: "shape ()".into(),
        })?;
    }
    Ok(())
}

impl Op for RmsNorm {
    const NAME: &'static str = "rms_norm";
    const VERSION: u32 = 1;
    const DOC: &'static str =
        "Root-mean-square normalization over the last axis: `x / sqrt(mean(x**2) + eps) * weight`.";
    const INPUTS: &'static [&'static str] = &["x", "weight"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["weight"];
    const ATTRS: &'static [Attr] = &[Attr::float("eps", 1e-6).doc("Added to the mean square.")];
    const DTYPES: &'static [DType] = &FLOATS;
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(params_like_x);
    const IN_PLACE: Option<InPlace> = IN_PLACE_OK;

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let x = &inputs[0];
        check_not_scalar(Self::NAME, x)?;
        check_param(Self::NAME, "weight", x, inputs.opt(1))?;
        Ok(vec![x.clone()])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (x, out, weight) = (view(&inputs[0]), view_mut(&mut outputs[0]), inputs.opt(1).map(view));
        // SAFETY: as for softmax.
        Ok(unsafe { nn::rms_norm(&x, weight.as_ref(), attrs.float("eps")?, &out) }.map_err(kernel(Self::NAME))?)
    }
}

struct EmbeddingBag;

/// `embedding_bag`'s index and offset checks on the host's bytes (see
/// `Operator::check_host_values`): a device's kernel reads the indices only when it runs.
fn embedding_bag_values(inputs: &[Option<(&[u8], crate::schema::Meta)>], _: &crate::schema::Attrs) -> Result<()> {
    let [Some((_, weight)), Some((indices, im)), Some((offsets, om))] = inputs else { return Ok(()) };
    let Some(&rows) = weight.shape.first() else { return Ok(()) };
    crate::cpu::embedding::check_bag_values(rows, (indices, im.dtype), (offsets, om.dtype))
        .map_err(|e| OpError::cpu_kernel("embedding_bag", e))
}

impl EmbeddingBag {
    fn mode(attrs: &Attrs<'_>) -> OpResult<BagMode> {
        match attrs.str("mode")? {
            "sum" => Ok(BagMode::Sum),
            "mean" => Ok(BagMode::Mean),
            "max" => Ok(BagMode::Max),
            other => Err(OpError::Argument {
                op: Self::NAME.into(),
                message: format!("expected mode 'sum', 'mean' or 'max', got {other:?}"),
            })?,
        }
    }
}

impl Op for EmbeddingBag {
    const NAME: &'static str = "embedding_bag";
    const VERSION: u32 = 1;
    const DOC: &'static str = "Sums (or averages, or maxes) rows of `weight` (num_embeddings, dim) picked by \
                               `indices`, one bag per entry of `offsets` (bag starts, as \
                               torch.nn.functional.embedding_bag). Out-of-range indices and invalid offsets are \
                               errors, checked before any row is read.";
    const INPUTS: &'static [&'static str] = &["weight", "indices", "offsets"];
    const ATTRS: &'static [Attr] = &[Attr::str("mode", "sum").doc("'sum', 'mean' or 'max'.")];
    const DTYPES: &'static [DType] = &DType::ALL;
    const INPUT_DTYPE_SETS: &'static [(&'static str, &'static [DType])] =
        &[("weight", &FLOATS), ("indices", &INTS), ("offsets", &INTS)];

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        Self::mode(attrs)?;
        let (w, idx, off) = (&inputs[0], &inputs[1], &inputs[2]);
        if !FLOATS.contains(&w.dtype) {
            Err(OpError::unsupported_dtype(Self::NAME, &FLOATS, format!("{} for weight", w.dtype)))?;
        }
        for (what, m) in [("indices", idx), ("offsets", off)] {
            if !INTS.contains(&m.dtype) {
                Err(OpError::unsupported_dtype(Self::NAME, &INTS, format!("{} for {what}", m.dtype)))?;
            }
            if m.shape.len() != 1 {
                Err(OpError::Shape {
                    op: Self::NAME.into(),
                    expected: format!("1-D {what}"),
                    got: format!("{:?}", m.shape),
                })?;
            }
        }
        let [_, dim] = w.shape[..] else {
            Err(OpError::Shape { op: Self::NAME.into(), expected: "2-D weight".into(), got: format!("{:?}", w.shape) })?
        };
        Ok(vec![Meta::new(w.dtype, &[off.shape[0], dim])])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (weight, indices, offsets) = (view(&inputs[0]), view(&inputs[1]), view(&inputs[2]));
        let out = view_mut(&mut outputs[0]);
        // SAFETY: views valid per the registry's contract; every index is checked by the kernel
        // before any row is read; the output is disjoint.
        Ok(unsafe { embedding_bag(&weight, &indices, &offsets, Self::mode(attrs)?, &out) }
            .map_err(kernel(Self::NAME))?)
    }
}

/// `matmul` version 2: numpy's `@`.
struct BatchedMatmul;

impl Op for BatchedMatmul {
    const NAME: &'static str = "matmul";
    const VERSION: u32 = 2;
    const DOC: &'static str = "Matrix product with numpy's `@` rules: 1-D operands are promoted, batch dimensions \
                               broadcast. float16 accumulates in float32; integers wrap.";
    const INPUTS: &'static [&'static str] = &["a", "b"];
    const DTYPES: &'static [DType] = &DType::ALL;
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(promote_both);

    fn infer(inputs: &Inputs<'_, Meta>, _: &Attrs<'_>) -> OpResult<Vec<Meta>> {
        let (a, b) = (&inputs[0], &inputs[1]);
        let shape = matmul_shapes(&a.shape, &b.shape).map_err(kernel(Self::NAME))?;
        Ok(vec![Meta { dtype: a.dtype.promote(b.dtype), shape }])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        _: &Attrs<'_>,
        _: &mut [u8],
    ) -> OpResult<()> {
        let (a, b, out) = (view(&inputs[0]), view(&inputs[1]), view_mut(&mut outputs[0]));
        // SAFETY: views valid per the registry's contract; the output is disjoint (matmul is not
        // `IN_PLACE`, so overlapping outputs are computed aside).
        Ok(unsafe { batched_matmul(&a, &b, &out) }.map_err(kernel(Self::NAME))?)
    }
}
