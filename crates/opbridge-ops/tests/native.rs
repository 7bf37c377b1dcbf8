//! Operators written with the plugin SDK's `Op` trait and registered in-process (the way every
//! built-in is): the loader's descriptor checks apply, calls reach the trait's functions, host
//! errors come back unchanged, SDK errors map by status, and the registry lists and dispatches
//! them like any other operator.

use std::cell::Cell;
use std::sync::Arc;

use opbridge_ops::native;
use opbridge_ops::{AttrValue, Meta, OpError, Operator, Registry, Source, TensorView};
use opbridge_plugin_sdk::{Attr, Attrs, DType, Error, Inputs, Op, Result, Tensor, TensorMut};
use opbridge_runtime::DType as RuntimeDType;

thread_local! {
    /// Shape-function calls made on this thread (each test runs on its own thread).
    static INFER_CALLS: Cell<usize> = const { Cell::new(0) };
}

fn infer_calls() -> usize {
    INFER_CALLS.with(Cell::get)
}

/// `out = x * scale (+ bias)`, with every ABI 2 feature: an optional input, a string, an int
/// list and a None-able attribute, an input-dtype rule (ints computed in float64), in place.
struct Affine;

impl Op for Affine {
    const NAME: &'static str = "affine";
    const VERSION: u32 = 2;
    const DOC: &'static str = "  x * scale + bias  ";
    const INPUTS: &'static [&'static str] = &["x", "bias"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["bias"];
    const ATTRS: &'static [Attr] = &[
        Attr::float("scale", 1.0),
        Attr::str("mode", "plain").doc("'plain' or 'negate'"),
        Attr::ints("pad", &[1, 2]),
        Attr::int("limit", 0).default_none(),
    ];
    const DTYPES: &'static [DType] = &[DType::F64, DType::I32];
    const INPUT_DTYPES: Option<opbridge_plugin_sdk::InputDtypesFn> =
        Some(|inputs, _| Ok(inputs.iter().map(|m| m.map(|_| DType::F64)).collect()));
    #[allow(unsafe_code)] // the in-place opt-in is an `unsafe` contract (see `InPlace::new`)
                          // SAFETY: `run` collects its inputs into buffers before it takes the output's slice.
    const IN_PLACE: Option<opbridge_plugin_sdk::InPlace> = Some(unsafe { opbridge_plugin_sdk::InPlace::new() });

    fn infer(inputs: &Inputs<'_, Meta2>, attrs: &Attrs<'_>) -> Result<Vec<Meta2>> {
        INFER_CALLS.with(|c| c.set(c.get() + 1));
        match attrs.str("mode")? {
            "plain" | "negate" => {}
            other => return Err(Error::invalid_argument(format!("unknown mode {other:?}"))),
        }
        if attrs.opt_int("limit")? == Some(-1) {
            // A host error travels as the cause and comes back as itself.
            return Err(OpError::Shape { op: "affine".into(), expected: "a limit".into(), got: "-1".into() }.into());
        }
        if let Some(bias) = inputs.opt(1) {
            if bias.shape != inputs[0].shape {
                return Err(Error::shape(format!(
                    "expected bias of shape {:?}, got {:?}",
                    inputs[0].shape, bias.shape
                )));
            }
        }
        Ok(vec![Meta2::new(DType::F64, &inputs[0].shape)])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _: &mut [u8],
    ) -> Result<()> {
        let scale = attrs.float("scale")? * if attrs.str("mode")? == "negate" { -1.0 } else { 1.0 };
        let x: Vec<f64> = inputs[0].values::<f64>()?.collect();
        let bias: Vec<f64> = match inputs.opt(1) {
            Some(b) => b.values::<f64>()?.collect(),
            None => vec![attrs.ints("pad")?.iter().sum::<i64>() as f64; x.len()],
        };
        for ((o, x), b) in outputs[0].as_mut_slice::<f64>()?.iter_mut().zip(x).zip(bias) {
            *o = x * scale + b;
        }
        Ok(())
    }
}

type Meta2 = opbridge_plugin_sdk::Meta;

fn attrs(op: &dyn Operator, given: &[(&str, AttrValue)]) -> opbridge_ops::Attrs {
    op.schema().bind_attrs(given.iter().cloned()).unwrap()
}

fn f64_view(data: &mut [f64]) -> TensorView {
    TensorView::contiguous(data.as_mut_ptr() as usize, RuntimeDType::F64, &[data.len()])
}

#[test]
fn the_schema_comes_from_the_trait_constants_through_the_loader_checks() {
    let op = native::op::<Affine>().unwrap();
    let schema = op.schema();
    assert_eq!((schema.name.as_str(), schema.version, schema.doc.as_str()), ("affine", 2, "x * scale + bias"));
    assert_eq!(
        schema.signature(),
        "affine(x, bias=None, *, scale=1.0, mode=\"plain\", pad=[1, 2], limit=None, out=None)"
    );
    assert_eq!(schema.dtypes, vec![DType::F64, DType::I32]);
    assert!(op.in_place_ok());
    assert!(op.lane().is_none());
}

#[test]
fn calls_reach_the_trait_with_defaults_optional_inputs_and_dtype_rules() {
    let op = native::op::<Affine>().unwrap();
    let meta = Some(Meta::new(DType::F64, &[3]));

    let plain = attrs(&op, &[("scale", AttrValue::Int(2))]);
    assert_eq!(op.infer(&[meta.clone(), None], &plain).unwrap(), vec![Meta::new(DType::F64, &[3])]);
    let i32_meta = Some(Meta::new(DType::I32, &[3]));
    assert_eq!(op.input_dtypes(&[i32_meta, None], &plain).unwrap(), vec![Some(DType::F64), None]);

    let (mut x, mut out) = (vec![1.0, 2.0, 3.0], vec![0.0; 3]);
    op.run_cpu(&[Some(f64_view(&mut x)), None], &[f64_view(&mut out)], &plain).unwrap();
    assert_eq!(out, [5.0, 7.0, 9.0], "2x + sum(pad)");

    let mut bias = vec![10.0, 20.0, 30.0];
    let negate = attrs(&op, &[("mode", AttrValue::Str("negate".into()))]);
    op.run_cpu(&[Some(f64_view(&mut x)), Some(f64_view(&mut bias))], &[f64_view(&mut out)], &negate).unwrap();
    assert_eq!(out, [9.0, 18.0, 27.0]);

    // In place: the output is the input.
    let view = f64_view(&mut x);
    op.run_cpu(&[Some(view.clone()), None], &[view], &plain).unwrap();
    assert_eq!(x, [5.0, 7.0, 9.0]);
}

#[test]
fn errors_keep_their_kind_and_host_errors_come_back_unchanged() {
    let op = native::op::<Affine>().unwrap();
    let x = Some(Meta::new(DType::F64, &[3]));

    let err = op.infer(&[x.clone(), None], &attrs(&op, &[("mode", AttrValue::Str("odd".into()))])).unwrap_err();
    assert!(matches!(err, OpError::Argument { .. }), "{err:?}");
    assert_eq!(err.to_string(), "affine: unknown mode \"odd\"");

    let err = op.infer(&[x.clone(), None], &attrs(&op, &[("limit", AttrValue::Int(-1))])).unwrap_err();
    assert!(matches!(err, OpError::Shape { ref got, .. } if got == "-1"), "{err:?}");
    assert_eq!(err.to_string(), "affine: expected a limit, got -1");

    let short = Some(Meta::new(DType::F64, &[2]));
    let err = op.infer(&[x.clone(), short], &attrs(&op, &[])).unwrap_err();
    assert_eq!(err.to_string(), "affine: expected bias of shape [3], got [2]");
    assert!(matches!(err, OpError::Shape { .. }));

    // Attribute values are checked against the declared kinds before the trait sees them.
    for (name, value) in [
        ("pad", AttrValue::Str("no".into())),
        ("mode", AttrValue::None),
        ("scale", AttrValue::Str("2".into())),
        ("limit", AttrValue::Float(1.5)),
    ] {
        let err = op.infer(&[x.clone(), None], &attrs(&op, &[(name, value)])).unwrap_err();
        assert!(matches!(err, OpError::InvalidAttribute { .. }), "{name}: {err:?}");
        assert!(err.to_string().contains(&format!("expected {name} to be")), "{err}");
    }
}

#[test]
fn a_repeated_call_signature_reuses_the_shape_function_result() {
    let op = native::op::<Affine>().unwrap();
    let x = Some(Meta::new(DType::F64, &[4]));
    let plain = attrs(&op, &[]);
    let before = infer_calls();
    for _ in 0..5 {
        op.infer(&[x.clone(), None], &plain).unwrap();
    }
    assert_eq!(infer_calls() - before, 1, "5 equal calls, 1 shape-function call");
    let other = attrs(&op, &[("scale", AttrValue::Float(3.0))]);
    let changed = infer_calls();
    op.infer(&[x.clone(), None], &other).unwrap();
    assert!(infer_calls() > changed, "a new attribute value reruns infer");
    // Floats compare by bits: -0.0 is another value than 0.0 to a pure function.
    op.infer(&[x.clone(), None], &attrs(&op, &[("scale", AttrValue::Float(0.0))])).unwrap();
    let zero = infer_calls();
    op.infer(&[x, None], &attrs(&op, &[("scale", AttrValue::Float(-0.0))])).unwrap();
    assert!(infer_calls() > zero, "-0.0 reruns infer after 0.0");
}

struct BadOptional;

impl Op for BadOptional {
    const NAME: &'static str = "bad_optional";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["y"];
    const DTYPES: &'static [DType] = &[DType::F32];

    fn infer(inputs: &Inputs<'_, Meta2>, _: &Attrs<'_>) -> Result<Vec<Meta2>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(_: &Inputs<'_, Tensor<'_>>, _: &mut [TensorMut<'_>], _: &Attrs<'_>, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
}

struct BadName;

impl Op for BadName {
    const NAME: &'static str = "bad name";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = &[Attr::int("x", 0)];
    const DTYPES: &'static [DType] = &[DType::F32];

    fn infer(inputs: &Inputs<'_, Meta2>, _: &Attrs<'_>) -> Result<Vec<Meta2>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(_: &Inputs<'_, Tensor<'_>>, _: &mut [TensorMut<'_>], _: &Attrs<'_>, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
}

struct Clash;

impl Op for Clash {
    const NAME: &'static str = "clash";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = &[Attr::int("x", 0)];
    const DTYPES: &'static [DType] = &[DType::F32];

    fn infer(inputs: &Inputs<'_, Meta2>, _: &Attrs<'_>) -> Result<Vec<Meta2>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(_: &Inputs<'_, Tensor<'_>>, _: &mut [TensorMut<'_>], _: &Attrs<'_>, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
}

#[test]
fn declarations_a_plugin_could_not_make_are_refused() {
    let message = |e: OpError| match e {
        OpError::InvalidOperator { message, .. } => message,
        other => panic!("{other:?}"),
    };
    assert!(message(native::op::<BadOptional>().unwrap_err()).contains("optional input \"y\""));
    assert!(message(native::op::<BadName>().unwrap_err()).contains("not an identifier"));
    assert!(message(native::op::<Clash>().unwrap_err()).contains("\"x\" is used twice"));
}

#[test]
fn the_registry_lists_and_dispatches_native_operators() {
    let registry = Registry::default();
    let entry = native::register::<Affine>(&registry, Source::Builtin).unwrap();
    assert!(Arc::ptr_eq(&registry.get("affine", None).unwrap(), &entry));
    assert!(Arc::ptr_eq(&registry.get("affine", Some(2)).unwrap(), &entry));
    let err = native::register::<Affine>(&registry, Source::Builtin).unwrap_err();
    assert!(matches!(err, OpError::DuplicateOperator { version: 2, .. }), "{err:?}");
    let err = registry.get("affine", Some(1)).unwrap_err();
    assert_eq!(err.to_string(), "operator \"affine\" has no version 1; available versions: 2");
    let err = registry.get("affin", None).unwrap_err();
    assert!(err.to_string().contains("available: affine"), "{err}");
    let listed = registry.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].versions[0].2, vec![DType::F64, DType::I32]);
}

/// Probes the adapter's edges: `rule` picks what `INPUT_DTYPES` answers and whether `infer`
/// panics; `run` checks the workspace it gets.
struct Probe;

impl Op for Probe {
    const NAME: &'static str = "probe";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x", "y"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["y"];
    const ATTRS: &'static [Attr] = &[Attr::str("rule", "keep")];
    const DTYPES: &'static [DType] = &[DType::F32, DType::F64];
    const INPUT_DTYPES: Option<opbridge_plugin_sdk::InputDtypesFn> = Some(|inputs, attrs| {
        Ok(match attrs.str("rule")? {
            "f16" => vec![Some(DType::F16); inputs.len()],
            _ => vec![None; inputs.len()],
        })
    });
    const WORKSPACE: Option<opbridge_plugin_sdk::WorkspaceFn> = Some(|inputs, _| inputs[0].shape[0] * 8 + 1);

    fn infer(inputs: &Inputs<'_, Meta2>, attrs: &Attrs<'_>) -> Result<Vec<Meta2>> {
        if attrs.str("rule")? == "panic" {
            return Ok(vec![inputs[1].clone()]); // `y` is absent: `Inputs` panics
        }
        Ok(vec![inputs[0].clone()])
    }

    fn run(inputs: &Inputs<'_, Tensor<'_>>, outputs: &mut [TensorMut<'_>], _: &Attrs<'_>, ws: &mut [u8]) -> Result<()> {
        assert_eq!(ws.len(), inputs[0].len() * 8 + 1);
        assert_eq!(ws.as_ptr() as usize % 64, 0, "64-byte aligned");
        assert!(ws.iter().all(|&b| b == 0), "zeroed");
        let x: Vec<f64> = inputs[0].values::<f64>()?.collect();
        outputs[0].as_mut_slice::<f64>()?.copy_from_slice(&x);
        Ok(())
    }
}

#[test]
fn input_dtype_rules_keep_present_inputs_and_stay_within_the_declared_dtypes() {
    let op = native::op::<Probe>().unwrap();
    let x = Some(Meta::new(DType::F32, &[2]));
    assert_eq!(op.input_dtypes(&[x.clone(), None], &attrs(&op, &[])).unwrap(), vec![Some(DType::F32), None]);
    let err = op.input_dtypes(&[x, None], &attrs(&op, &[("rule", AttrValue::Str("f16".into()))])).unwrap_err();
    assert!(matches!(err, OpError::Kernel { .. }), "{err:?}");
    assert!(err.to_string().contains("chose float16 for input \"x\"; the operator declares float32, float64"), "{err}");
}

#[test]
fn a_panicking_operator_gives_an_error_not_an_unwind() {
    let op = native::op::<Probe>().unwrap();
    let x = Some(Meta::new(DType::F64, &[2]));
    let err = op.infer(&[x, None], &attrs(&op, &[("rule", AttrValue::Str("panic".into()))])).unwrap_err();
    assert!(matches!(err, OpError::Kernel { .. }), "{err:?}");
    assert!(err.to_string().contains("panicked: input 1 was not passed"), "{err}");
}

#[test]
fn kernels_get_the_workspace_they_ask_for() {
    let op = native::op::<Probe>().unwrap();
    let (mut x, mut out) = (vec![1.0, 2.0, 3.0], vec![0.0; 3]);
    op.run_cpu(&[Some(f64_view(&mut x)), None], &[f64_view(&mut out)], &attrs(&op, &[])).unwrap();
    assert_eq!(out, x);
}

#[test]
fn builtin_kernel_refusals_come_back_typed_with_the_operator_name() {
    use opbridge_ops::cpu::KernelError;
    use opbridge_ops::ErrorKind;

    let registry = Registry::new();
    opbridge_ops::register_builtins(&registry).unwrap();
    let bag = registry.get("embedding_bag", None).unwrap();
    let mut weight = [0f32; 10];
    let (mut indices, mut offsets) = ([0i64, 5], [0i64, 1]);
    let mut out = [0f32; 4];
    let view = |ptr: usize, dtype, shape: &[usize]| TensorView::contiguous(ptr, dtype, shape);
    let err = bag
        .op
        .run_cpu(
            &[
                Some(view(weight.as_mut_ptr() as usize, RuntimeDType::F32, &[5, 2])),
                Some(view(indices.as_mut_ptr() as usize, RuntimeDType::I64, &[2])),
                Some(view(offsets.as_mut_ptr() as usize, RuntimeDType::I64, &[2])),
            ],
            &[view(out.as_mut_ptr() as usize, RuntimeDType::F32, &[2, 2])],
            &attrs(&*bag.op, &[]),
        )
        .unwrap_err();
    assert!(
        matches!(
            &err,
            OpError::CpuKernel { op, error: KernelError::IndexOutOfRange { position: 1, index: 5, rows: 5 } }
                if &**op == "embedding_bag"
        ),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "embedding_bag: indices[1] = 5 is out of range for weight with 5 rows (valid: 0..5)");
    assert_eq!(err.kind(), ErrorKind::Argument);

    let pow = registry.get("pow", None).unwrap();
    let (mut a, mut b, mut c) = ([2i32, 3], [1i32, -1], [0i32; 2]);
    let err = pow
        .op
        .run_cpu(
            &[
                Some(view(a.as_mut_ptr() as usize, RuntimeDType::I32, &[2])),
                Some(view(b.as_mut_ptr() as usize, RuntimeDType::I32, &[2])),
            ],
            &[view(c.as_mut_ptr() as usize, RuntimeDType::I32, &[2])],
            &attrs(&*pow.op, &[]),
        )
        .unwrap_err();
    assert_eq!(err.to_string(), "pow: Integers to negative integer powers are not allowed.");
    assert_eq!(err.kind(), ErrorKind::Argument);

    // Shape helpers shared by `infer` report through the same variant, classified as shapes.
    let add = registry.get("add", None).unwrap();
    let metas = [Some(Meta::new(DType::F32, &[3])), Some(Meta::new(DType::F32, &[4]))];
    let err = add.op.infer(&metas, &attrs(&*add.op, &[])).unwrap_err();
    assert_eq!(err.to_string(), "add: shapes (3,) and (4,) cannot be broadcast together: dimension -1 is 3 vs 4");
    assert_eq!(err.kind(), ErrorKind::Shape);
}
