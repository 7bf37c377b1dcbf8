//! An opbridge operator library in Rust: `scale_add`, in two versions, float32 and float64.
//!
//! - v1: `out = a * alpha + b`
//! - v2: `out = a * alpha + b * beta`
//!
//! Build: `cargo build --release --manifest-path examples/plugins/rust/Cargo.toml`, then
//! `opbridge.load_library("target/release/libscale_add_rs.so")`.

use std::ops::{Add, Mul};

use opbridge_plugin_sdk::{
    export_plugin, Attr, Attrs, DType, Element, Error, Inputs, Meta, Op, Result, Tensor, TensorMut,
};

/// Shape function of both versions: `a` and `b` of one dtype and shape; `out` is the same.
fn same_as_inputs(inputs: &Inputs<'_, Meta>) -> Result<Vec<Meta>> {
    let (a, b) = (&inputs[0], &inputs[1]);
    if a.dtype != b.dtype {
        return Err(Error::dtype(format!("scale_add: a is {} but b is {}", a.dtype, b.dtype)));
    }
    if a.shape != b.shape {
        return Err(Error::shape(format!("scale_add: a has shape {:?} but b has {:?}", a.shape, b.shape)));
    }
    Ok(vec![a.clone()])
}

/// `out = a * alpha + b * beta` for one element type; strided inputs are read in C order.
fn scale_add<T>(a: &Tensor<'_>, b: &Tensor<'_>, out: &mut TensorMut<'_>, alpha: T, beta: T) -> Result<()>
where
    T: Element + Mul<Output = T> + Add<Output = T>,
{
    let out = out.as_mut_slice::<T>()?;
    match (a.as_slice::<T>(), b.as_slice::<T>()) {
        (Ok(a), Ok(b)) => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = x * alpha + y * beta;
            }
        }
        _ => {
            for ((o, x), y) in out.iter_mut().zip(a.values::<T>()?).zip(b.values::<T>()?) {
                *o = x * alpha + y * beta;
            }
        }
    }
    Ok(())
}

fn run(inputs: &Inputs<'_, Tensor<'_>>, outputs: &mut [TensorMut<'_>], alpha: f64, beta: f64) -> Result<()> {
    if !alpha.is_finite() || !beta.is_finite() {
        // A kernel-side check, to show how kernels report errors (ArgumentError in Python).
        return Err(Error::invalid_argument("scale_add: alpha and beta must be finite"));
    }
    let (a, b, out) = (&inputs[0], &inputs[1], &mut outputs[0]);
    match a.dtype() {
        DType::F32 => scale_add(a, b, out, alpha as f32, beta as f32),
        DType::F64 => scale_add(a, b, out, alpha, beta),
        other => Err(Error::dtype(format!("scale_add: {other} is not supported"))),
    }
}

/// scale_add v1: `out = a * alpha + b`.
pub struct ScaleAddV1;

impl Op for ScaleAddV1 {
    const NAME: &'static str = "scale_add";
    const VERSION: u32 = 1;
    const DOC: &'static str = "out = a * alpha + b (Rust example plugin).";
    const INPUTS: &'static [&'static str] = &["a", "b"];
    const ATTRS: &'static [Attr] = &[Attr::float("alpha", 1.0).doc("factor of a")];
    const DTYPES: &'static [DType] = &[DType::F32, DType::F64];

    fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        same_as_inputs(inputs)
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _ws: &mut [u8],
    ) -> Result<()> {
        run(inputs, outputs, attrs.float("alpha")?, 1.0)
    }
}

/// scale_add v2: `out = a * alpha + b * beta`.
pub struct ScaleAddV2;

impl Op for ScaleAddV2 {
    const NAME: &'static str = "scale_add";
    const VERSION: u32 = 2;
    const DOC: &'static str = "out = a * alpha + b * beta (Rust example plugin).";
    const INPUTS: &'static [&'static str] = &["a", "b"];
    const ATTRS: &'static [Attr] =
        &[Attr::float("alpha", 1.0).doc("factor of a"), Attr::float("beta", 1.0).doc("factor of b")];
    const DTYPES: &'static [DType] = &[DType::F32, DType::F64];

    fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        same_as_inputs(inputs)
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _ws: &mut [u8],
    ) -> Result<()> {
        run(inputs, outputs, attrs.float("alpha")?, attrs.float("beta")?)
    }
}

export_plugin!("scale_add_rs": ScaleAddV1, ScaleAddV2);
