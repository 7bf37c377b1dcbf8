//! Every built-in operator that declares how its calls merge along axis 0 (`Operator::batching`,
//! which a server's dynamic batching relies on) keeps the promise: a merged call, split back,
//! equals each call alone bit for bit, for random row counts and trailing sizes, in every float
//! dtype. And the declaration refuses the calls it must refuse.

use opbridge_ops::registry::Batching;
use opbridge_ops::{AttrValue, Attrs, Entry, Meta, TensorView};
use opbridge_runtime::DType;

/// A small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> usize {
        (self.next() % n) as usize
    }

    /// Bytes of `count` values of `dtype` in [0.25, 2.25): positive, so `log`, `sqrt` and
    /// `pow` stay defined.
    fn values(&mut self, dtype: DType, count: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(count * dtype.size());
        for _ in 0..count {
            let x = 0.25 + (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0;
            match dtype {
                DType::F16 => bytes.extend(half::f16::from_f64(x).to_le_bytes()),
                DType::F32 => bytes.extend((x as f32).to_le_bytes()),
                DType::F64 => bytes.extend(x.to_le_bytes()),
                other => panic!("no values of {other}"),
            }
        }
        bytes
    }
}

/// The input shapes of one call with `rows` rows, given the trailing size `d`.
fn shapes(op: &str, batching: &Batching, inputs: usize, rows: usize, d: usize) -> Vec<Vec<usize>> {
    match op {
        "layer_norm" => vec![vec![rows, d], vec![d], vec![d]],
        "rms_norm" => vec![vec![rows, d], vec![d]],
        _ => {
            assert!(batching.shared.is_empty(), "{op}: add its shapes to this test");
            vec![vec![rows, 3, d]; inputs]
        }
    }
}

/// Runs `entry` on host buffers; returns each output's bytes.
fn run(entry: &Entry, attrs: &Attrs, inputs: &[(Vec<usize>, Vec<u8>)], dtype: DType) -> Vec<Vec<u8>> {
    let metas: Vec<Option<Meta>> = inputs.iter().map(|(shape, _)| Some(Meta::new(dtype, shape))).collect();
    let plan = opbridge_ops::dispatch::plan(entry, &metas, attrs).expect("plan");
    let views: Vec<Option<TensorView>> = inputs
        .iter()
        .map(|(shape, bytes)| Some(TensorView::contiguous(bytes.as_ptr() as usize, dtype, shape)))
        .collect();
    let mut outputs: Vec<Vec<u8>> =
        plan.outputs.iter().map(|m| vec![0u8; m.shape.iter().product::<usize>() * m.dtype.size()]).collect();
    let out_views: Vec<TensorView> = outputs
        .iter_mut()
        .zip(&plan.outputs)
        .map(|(bytes, m)| TensorView::contiguous(bytes.as_mut_ptr() as usize, m.dtype, &m.shape))
        .collect();
    assert!(plan.inputs.iter().all(|d| *d == Some(dtype)), "{}: inputs converted", entry.schema().name);
    entry.op.run_cpu(&views, &out_views, attrs).expect("run");
    outputs
}

#[test]
fn merged_calls_split_back_bit_for_bit() {
    let registry = opbridge_ops::global();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut checked = Vec::new();
    for info in registry.list() {
        for (version, ..) in &info.versions {
            let entry = registry.get(&info.name, Some(*version)).unwrap();
            let Some(batching) = entry.op.batching() else { continue };
            let schema = entry.schema();
            // Defaults, but cast needs its target (a narrowing one: rounding must split back too).
            let given: &[(&str, AttrValue)] =
                if info.name == "cast" { &[("dtype", AttrValue::Str("float16".into()))] } else { &[] };
            let attrs = schema.bind_attrs(given.iter().cloned()).unwrap();
            for &dtype in schema.dtypes.iter().filter(|d| d.is_float()) {
                for _ in 0..6 {
                    // Rows of up to 70 elements, and now and then long ones (where kernels
                    // switch to blocked or vectorized paths).
                    let width = if rng.below(4) == 0 { 500 + rng.below(700) } else { 1 + rng.below(70) };
                    let parts: Vec<usize> = (0..2 + rng.below(6)).map(|_| 1 + rng.below(40)).collect();
                    let total: usize = parts.iter().sum();
                    // Shared inputs: one set of bytes for every call.
                    let template = shapes(&info.name, &batching, schema.inputs.len(), total, width);
                    let shared: Vec<Vec<u8>> = template.iter().map(|s| rng.values(dtype, s.iter().product())).collect();
                    let mut calls = Vec::new();
                    for &rows in &parts {
                        let call: Vec<(Vec<usize>, Vec<u8>)> =
                            shapes(&info.name, &batching, schema.inputs.len(), rows, width)
                                .into_iter()
                                .enumerate()
                                .map(|(i, shape)| {
                                    let bytes = if batching.shared.contains(&i) {
                                        shared[i].clone()
                                    } else {
                                        rng.values(dtype, shape.iter().product())
                                    };
                                    (shape, bytes)
                                })
                                .collect();
                        let metas: Vec<Option<Meta>> = call.iter().map(|(s, _)| Some(Meta::new(dtype, s))).collect();
                        assert_eq!(batching.rows_of(&metas, &attrs), Some(rows), "{} {dtype}", info.name);
                        calls.push(call);
                    }
                    let merged: Vec<(Vec<usize>, Vec<u8>)> = (0..schema.inputs.len())
                        .map(|i| {
                            if batching.shared.contains(&i) {
                                return calls[0][i].clone();
                            }
                            let mut shape = calls[0][i].0.clone();
                            shape[0] = total;
                            (shape, calls.iter().flat_map(|c| c[i].1.iter().copied()).collect())
                        })
                        .collect();
                    let whole = run(&entry, &attrs, &merged, dtype);
                    let alone: Vec<Vec<Vec<u8>>> = calls.iter().map(|c| run(&entry, &attrs, c, dtype)).collect();
                    for (k, bytes) in whole.iter().enumerate() {
                        let split: Vec<u8> = alone.iter().flat_map(|outs| outs[k].iter().copied()).collect();
                        assert!(
                            *bytes == split,
                            "{} v{version} {dtype}: merged output {k} differs (rows {parts:?}, width {width})",
                            info.name
                        );
                    }
                }
            }
            checked.push(info.name.clone());
        }
    }
    for expected in ["add", "exp", "sigmoid", "vector_add", "softmax", "layer_norm", "rms_norm", "cast"] {
        assert!(checked.iter().any(|n| n == expected), "{expected} declares no batching; checked {checked:?}");
    }
}

#[test]
fn calls_that_would_mix_rows_are_refused() {
    let registry = opbridge_ops::global();
    let meta = |shape: &[usize]| Some(Meta::new(DType::F32, shape));
    let declared = |name: &str| {
        let entry = registry.get(name, None).unwrap();
        let attrs = entry.schema().bind_attrs(std::iter::empty::<(&str, AttrValue)>()).unwrap();
        (entry.op.batching().expect(name), attrs, entry)
    };
    let (add, attrs, _) = declared("add");
    assert_eq!(add.rows_of(&[meta(&[4, 3]), meta(&[4, 3])], &attrs), Some(4));
    assert_eq!(add.rows_of(&[meta(&[4, 3]), meta(&[3])], &attrs), None, "broadcasting");
    assert_eq!(add.rows_of(&[meta(&[1, 3]), meta(&[4, 3])], &attrs), None, "broadcasting along axis 0");
    assert_eq!(add.rows_of(&[meta(&[]), meta(&[])], &attrs), None, "scalars have no rows");

    let (softmax, _, entry) = declared("softmax");
    let axis = |a: i64| entry.schema().bind_attrs([("axis", AttrValue::Int(a))]).unwrap();
    assert_eq!(softmax.rows_of(&[meta(&[4, 3])], &axis(-1)), Some(4));
    assert_eq!(softmax.rows_of(&[meta(&[4, 3])], &axis(1)), Some(4));
    assert_eq!(softmax.rows_of(&[meta(&[4, 3])], &axis(0)), None, "softmax along the batch axis");
    assert_eq!(softmax.rows_of(&[meta(&[4, 3])], &axis(-2)), None);
    assert_eq!(softmax.rows_of(&[meta(&[4])], &axis(-1)), None, "a 1-D softmax is one row");

    // The GEMM kernel sums a one-row product in another order than the same row among others
    // (from about 512 terms): merged matmul calls would not split back bit for bit.
    for version in [1, 2] {
        assert!(registry.get("matmul", Some(version)).unwrap().op.batching().is_none(), "matmul v{version}");
    }

    assert!(registry.get("transpose", None).unwrap().op.batching().is_none(), "transpose mixes axes");
    assert!(registry.get("sum", None).unwrap().op.batching().is_none());
}
