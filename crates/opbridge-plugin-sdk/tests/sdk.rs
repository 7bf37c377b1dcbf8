//! The SDK as a host sees it: its declarations match the C header, and the generated entry
//! point and trampolines turn safe Rust into the ABI (results, errors, panics, strided inputs).
#![allow(unsafe_code)] // the tests play the host: they call the C entry point and trampolines

use std::ffi::{c_char, c_void, CStr};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use opbridge_plugin_sdk::{
    describe, export_plugin, sys, Attr, Attrs, DType, Error, InputDtypesFn, Inputs, Meta, Op, Result, Tensor,
    TensorMut, WorkspaceFn,
};

struct AddK;

impl Op for AddK {
    const NAME: &'static str = "add_k";
    const VERSION: u32 = 3;
    const DOC: &'static str = "x + k";
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = &[Attr::int("k", 1).doc("the increment"), Attr::bool("explode", false).required()];
    const DTYPES: &'static [DType] = &[DType::F64, DType::I64];

    fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        if inputs[0].shape.len() != 1 {
            return Err(Error::shape("1-D only"));
        }
        Ok(vec![inputs[0].clone()])
    }

    const WORKSPACE: Option<WorkspaceFn> = Some(|inputs, _attrs| inputs[0].shape[0] * 8);

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        ws: &mut [u8],
    ) -> Result<()> {
        if attrs.bool("explode")? {
            panic!("boom");
        }
        assert_eq!(ws.len(), inputs[0].len() * 8);
        let k = attrs.int("k")? as f64;
        let out = outputs[0].as_mut_slice::<f64>()?;
        for (o, x) in out.iter_mut().zip(inputs[0].values::<f64>()?) {
            *o = x + k;
        }
        Ok(())
    }
}

export_plugin!("sdk_test": AddK);

fn init() -> (i32, sys::OpbPluginInfo) {
    let host = sys::OpbPluginHost {
        abi_version: sys::OPBRIDGE_PLUGIN_ABI_VERSION,
        reserved0: 0,
        runtime_version: c"test".as_ptr(),
        reserved: [std::ptr::null_mut(); 4],
    };
    let mut info = sys::OpbPluginInfo::zeroed();
    // SAFETY: valid host and info.
    let status = unsafe { opbridge_plugin_init(&host, &mut info) };
    (status, info)
}

fn text(p: *const c_char) -> String {
    // SAFETY: the SDK hands out NUL-terminated strings it keeps alive.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[test]
fn declarations_match_the_header() {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/opbridge/include");
    let mut program =
        String::from("#include <stdio.h>\n#include <stddef.h>\n#include <opbridge/plugin.h>\nint main(void) {\n");
    for (ty, field, _) in sys::layout() {
        let expr = if field == "sizeof" { format!("sizeof({ty})") } else { format!("offsetof({ty}, {field})") };
        program += &format!("  printf(\"{ty} {field} %zu\\n\", {expr});\n");
    }
    program += "  return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("opbridge-sdk-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("layout.c"), program).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(cc)
        .arg("-I")
        .arg(&include)
        .arg(dir.join("layout.c"))
        .arg("-o")
        .arg(dir.join("layout"))
        .output()
        .expect("a C compiler (cc or $CC)");
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let printed = String::from_utf8(Command::new(dir.join("layout")).output().unwrap().stdout).unwrap();
    let expected: String = sys::layout().iter().map(|(ty, field, n)| format!("{ty} {field} {n}\n")).collect();
    assert_eq!(printed, expected);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_entry_point_describes_the_ops() {
    let (status, info) = init();
    assert_eq!(status, sys::OPB_OK);
    assert_eq!(info.abi_version, 3);
    assert_eq!(text(info.name), "sdk_test");
    assert_eq!(info.n_ops, 1);
    // SAFETY: one descriptor, kept alive by the SDK.
    let desc = unsafe { &*info.ops };
    assert_eq!((text(desc.name).as_str(), desc.version, text(desc.doc).as_str()), ("add_k", 3, "x + k"));
    assert_eq!((desc.n_inputs, desc.n_outputs, desc.n_attrs, desc.n_dtypes), (1, 1, 2, 2));
    // SAFETY: arrays of the declared lengths.
    let (attrs, dtypes) =
        unsafe { (std::slice::from_raw_parts(desc.attrs, 2), std::slice::from_raw_parts(desc.dtypes, 2)) };
    assert_eq!((text(attrs[0].name).as_str(), attrs[0].kind, attrs[0].flags, attrs[0].default_int), ("k", 0, 0, 1));
    assert_eq!((text(attrs[1].name).as_str(), attrs[1].kind, attrs[1].flags), ("explode", 2, sys::OPB_ATTR_REQUIRED));
    // ABI 2's fields, at their defaults: no flags, all inputs required, no input-dtype callback.
    assert_eq!((desc.flags, desc.input_dtypes.is_none()), (0, true));
    // SAFETY: one flag per input.
    assert_eq!(unsafe { *desc.input_optional }, 0);
    assert_eq!(text(attrs[0].doc), "the increment");
    assert_eq!(dtypes, [DType::F64.to_dl(), DType::I64.to_dl()]);
    // SAFETY: one name.
    assert_eq!(text(unsafe { *desc.input_names }), "x");
    // ABI 3's: a CPU kernel and no device kernel.
    assert!(desc.cpu_kernel.is_some());
    assert_eq!((desc.n_device_kernels, desc.device_kernels.is_null()), (0, true));

    // Another ABI: only the version is written.
    let host = sys::OpbPluginHost {
        abi_version: 7,
        reserved0: 0,
        runtime_version: std::ptr::null(),
        reserved: [std::ptr::null_mut(); 4],
    };
    let mut info = sys::OpbPluginInfo::zeroed();
    // SAFETY: valid pointers.
    assert_eq!(unsafe { opbridge_plugin_init(&host, &mut info) }, sys::OPB_ERR_ABI_MISMATCH);
    assert_eq!((info.abi_version, info.n_ops), (3, 0));
}

struct Call {
    values: Vec<sys::OpbAttrValue>,
    names: Vec<*const c_char>,
}

impl Call {
    fn new(k: i64, explode: bool) -> Call {
        Call {
            values: vec![
                sys::OpbAttrValue { kind: sys::OPB_ATTR_INT, i: k, ..Default::default() },
                sys::OpbAttrValue { kind: sys::OPB_ATTR_BOOL, i: explode as i64, ..Default::default() },
            ],
            names: vec![c"k".as_ptr(), c"explode".as_ptr()],
        }
    }

    fn attrs(&self) -> sys::OpbAttrs {
        sys::OpbAttrs { count: 2, values: self.values.as_ptr(), names: self.names.as_ptr() }
    }
}

#[test]
fn trampolines_run_the_op_and_report_errors_and_panics() {
    let (_, info) = init();
    // SAFETY: one descriptor.
    let desc = unsafe { *info.ops };
    let (infer, kernel, ws) = (desc.infer.unwrap(), desc.cpu_kernel.unwrap(), desc.workspace_size.unwrap());
    let mut err = [0 as c_char; 256];

    // Shape function: OK, and a typed error with its message.
    let mut meta = sys::OpbMeta { dtype: DType::F64.to_dl(), ndim: 1, ..Default::default() };
    meta.shape[0] = 3;
    let call = Call::new(10, false);
    let mut out = sys::OpbMeta::default();
    // SAFETY: one input meta, one output meta, valid attrs and buffer.
    let status = unsafe { infer(&meta, 1, &mut out, 1, &call.attrs(), err.as_mut_ptr(), err.len()) };
    assert_eq!((status, out), (sys::OPB_OK, meta));
    let mut scalar = meta;
    scalar.ndim = 0;
    // SAFETY: as above.
    let status = unsafe { infer(&scalar, 1, &mut out, 1, &call.attrs(), err.as_mut_ptr(), err.len()) };
    assert_eq!((status, text(err.as_ptr())), (sys::OPB_ERR_SHAPE, "1-D only".to_string()));

    // Kernel over a strided input (every other element).
    // SAFETY: as above.
    let bytes = unsafe { ws(&meta, 1, &call.attrs()) };
    assert_eq!(bytes, 24);
    let mut workspace = vec![0u64; 3];
    let x = [1.0f64, -1.0, 2.0, -1.0, 3.0, -1.0];
    let mut y = [0.0f64; 3];
    let (mut shape, mut x_strides, mut y_strides) = ([3i64], [2i64], [1i64]);
    let tensor = |data: *mut c_void, strides: *mut i64, shape: *mut i64| sys::DLTensor {
        data,
        device: sys::DLDevice { device_type: sys::kDLCPU, device_id: 0 },
        ndim: 1,
        dtype: DType::F64.to_dl(),
        shape,
        strides,
        byte_offset: 0,
    };
    let input = tensor(x.as_ptr() as *mut c_void, x_strides.as_mut_ptr(), shape.as_mut_ptr());
    let mut output = tensor(y.as_mut_ptr().cast(), y_strides.as_mut_ptr(), shape.as_mut_ptr());
    let mut run = |call: &Call, output: &mut sys::DLTensor, err: &mut [c_char; 256]| {
        // SAFETY: valid tensors, attrs, workspace of the size asked for, and buffer.
        unsafe {
            kernel(
                &input,
                1,
                output,
                1,
                &call.attrs(),
                std::ptr::null_mut(),
                workspace.as_mut_ptr().cast(),
                bytes,
                err.as_mut_ptr(),
                err.len(),
            )
        }
    };
    assert_eq!(run(&call, &mut output, &mut err), sys::OPB_OK);
    assert_eq!(y, [11.0, 12.0, 13.0]);

    // A panic is caught and reported, never unwound into the host.
    assert_eq!(run(&Call::new(0, true), &mut output, &mut err), sys::OPB_ERR_FAILED);
    assert_eq!(text(err.as_ptr()), "panicked: boom");

    // A dtype the kernel reads wrongly: a typed error.
    output.dtype = DType::I64.to_dl();
    assert_eq!(run(&call, &mut output, &mut err), sys::OPB_ERR_DTYPE);
    assert!(text(err.as_ptr()).contains("int64 read as float64"));
}

#[test]
fn messages_are_truncated_to_the_buffer() {
    let (_, info) = init();
    // SAFETY: one descriptor.
    let infer = unsafe { (*info.ops).infer.unwrap() };
    let meta = sys::OpbMeta { dtype: DType::F64.to_dl(), ndim: 2, ..Default::default() };
    let call = Call::new(1, false);
    let mut out = sys::OpbMeta::default();
    let mut err = [1 as c_char; 4];
    // SAFETY: valid pointers; a 4-byte buffer.
    let status = unsafe { infer(&meta, 1, &mut out, 1, &call.attrs(), err.as_mut_ptr(), err.len()) };
    assert_eq!(status, sys::OPB_ERR_SHAPE);
    assert_eq!(text(err.as_ptr()), "1-D");
}

/// Every ABI 2 feature: `combine(x, y=None, *, mode="sum", offsets=[1, 2], scale=None)`, in
/// float64 (int32 inputs are converted first), in place allowed. `out[i] = x[i] (+ or max) y[i]
/// (0 when y is absent) + offsets[i % len] (times scale unless None)`.
struct Combine;

impl Op for Combine {
    const NAME: &'static str = "combine";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x", "y"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["y"];
    const ATTRS: &'static [Attr] =
        &[Attr::str("mode", "sum"), Attr::ints("offsets", &[1, 2]), Attr::int("scale", 0).default_none()];
    const DTYPES: &'static [DType] = &[DType::F64, DType::I32];
    const INPUT_DTYPES: Option<InputDtypesFn> = Some(|inputs, _attrs| {
        Ok(inputs.iter().map(|m| m.map(|m| if m.dtype == DType::I32 { DType::F64 } else { m.dtype })).collect())
    });
    // SAFETY: `run` collects its inputs into buffers before it takes the output's slice.
    const IN_PLACE: Option<opbridge_plugin_sdk::InPlace> = Some(unsafe { opbridge_plugin_sdk::InPlace::new() });

    fn infer(inputs: &Inputs<'_, Meta>, attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        if !matches!(attrs.str("mode")?, "sum" | "max") {
            return Err(Error::invalid_argument("mode must be \"sum\" or \"max\""));
        }
        // The shape function sees the caller's dtypes; the output says whether `y` was there
        // (a second dimension of 1) so that the test can tell.
        let x = &inputs[0];
        let extra = usize::from(inputs.opt(1).is_some());
        let mut shape = x.shape.clone();
        shape.push(extra);
        Ok(vec![Meta { dtype: DType::F64, shape }])
    }

    fn run(
        inputs: &Inputs<'_, Tensor<'_>>,
        outputs: &mut [TensorMut<'_>],
        attrs: &Attrs<'_>,
        _ws: &mut [u8],
    ) -> Result<()> {
        let max = attrs.str("mode")? == "max";
        let offsets = attrs.ints("offsets")?;
        let scale = attrs.opt_int("scale")?;
        let x: Vec<f64> = inputs[0].values::<f64>()?.collect();
        let y: Vec<f64> = match inputs.opt(1) {
            Some(y) => y.values::<f64>()?.collect(),
            None => vec![0.0; x.len()],
        };
        let out = outputs[0].as_mut_slice::<f64>()?;
        for (i, o) in out.iter_mut().enumerate() {
            let mut r = if max { x[i].max(y[i]) } else { x[i] + y[i] };
            if !offsets.is_empty() {
                r += offsets[i % offsets.len()] as f64;
            }
            if let Some(scale) = scale {
                r *= scale as f64;
            }
            *o = r;
        }
        Ok(())
    }
}

/// A call's attribute values for `Combine`, built the way the host builds them.
struct CombineCall {
    values: Vec<sys::OpbAttrValue>,
    names: Vec<*const c_char>,
    _mode: std::ffi::CString,
    _offsets: Vec<i64>,
}

impl CombineCall {
    fn new(mode: &str, offsets: &[i64], scale: Option<i64>) -> CombineCall {
        let mode = std::ffi::CString::new(mode).unwrap();
        let offsets = offsets.to_vec();
        let values = vec![
            sys::OpbAttrValue { kind: sys::OPB_ATTR_STR, s: mode.as_ptr(), ..Default::default() },
            sys::OpbAttrValue {
                kind: sys::OPB_ATTR_INTS,
                ints: offsets.as_ptr(),
                n_ints: offsets.len() as i64,
                ..Default::default()
            },
            match scale {
                Some(i) => sys::OpbAttrValue { kind: sys::OPB_ATTR_INT, i, ..Default::default() },
                None => sys::OpbAttrValue { kind: sys::OPB_ATTR_INT, is_none: 1, ..Default::default() },
            },
        ];
        CombineCall {
            values,
            names: vec![c"mode".as_ptr(), c"offsets".as_ptr(), c"scale".as_ptr()],
            _mode: mode,
            _offsets: offsets,
        }
    }

    fn attrs(&self) -> sys::OpbAttrs {
        sys::OpbAttrs { count: self.values.len(), values: self.values.as_ptr(), names: self.names.as_ptr() }
    }
}

fn meta(dtype: DType, shape: &[i64]) -> sys::OpbMeta {
    let mut m = sys::OpbMeta { dtype: dtype.to_dl(), ndim: shape.len() as i32, ..Default::default() };
    m.shape[..shape.len()].copy_from_slice(shape);
    m
}

fn absent_meta() -> sys::OpbMeta {
    sys::OpbMeta { ndim: sys::OPB_ABSENT, ..Default::default() }
}

#[test]
fn the_descriptor_carries_abi2_fields() {
    let described = describe::<Combine>();
    let desc = described.desc();
    assert_eq!(desc.flags, sys::OPB_OP_IN_PLACE_OK);
    assert!(desc.input_dtypes.is_some());
    // SAFETY: arrays of the declared lengths, kept alive by `described`.
    let (optional, attrs) =
        unsafe { (std::slice::from_raw_parts(desc.input_optional, 2), std::slice::from_raw_parts(desc.attrs, 3)) };
    assert_eq!(optional, [0, 1]);
    assert_eq!((text(attrs[0].name).as_str(), attrs[0].kind, attrs[0].flags), ("mode", sys::OPB_ATTR_STR, 0));
    assert_eq!(text(attrs[0].default_str), "sum");
    assert_eq!((attrs[1].kind, attrs[1].n_default_ints), (sys::OPB_ATTR_INTS, 2));
    // SAFETY: `n_default_ints` entries.
    assert_eq!(unsafe { std::slice::from_raw_parts(attrs[1].default_ints, 2) }, [1, 2]);
    assert_eq!(
        (attrs[2].kind, attrs[2].flags),
        (sys::OPB_ATTR_INT, sys::OPB_ATTR_NULLABLE | sys::OPB_ATTR_DEFAULT_NONE)
    );
}

#[test]
fn string_list_and_none_attributes_and_absent_inputs_reach_infer_and_run() {
    let described = describe::<Combine>();
    let desc = *described.desc();
    let (infer, kernel) = (desc.infer.unwrap(), desc.cpu_kernel.unwrap());
    let mut err = [0 as c_char; 256];

    // Shape function: an absent `y` arrives as absent, a present one as present.
    let infer_with = |inputs: &[sys::OpbMeta], call: &CombineCall, err: &mut [c_char; 256]| {
        let mut out = sys::OpbMeta::default();
        // SAFETY: two input metas, one output meta, valid attrs and buffer.
        let status = unsafe { infer(inputs.as_ptr(), 2, &mut out, 1, &call.attrs(), err.as_mut_ptr(), err.len()) };
        (status, out)
    };
    let sum = CombineCall::new("sum", &[1, 2], None);
    let (status, out) = infer_with(&[meta(DType::I32, &[3]), absent_meta()], &sum, &mut err);
    assert_eq!((status, out), (sys::OPB_OK, meta(DType::F64, &[3, 0])));
    let (status, out) = infer_with(&[meta(DType::F64, &[3]), meta(DType::F64, &[3])], &sum, &mut err);
    assert_eq!((status, out), (sys::OPB_OK, meta(DType::F64, &[3, 1])));
    // The string is read: an unknown mode is the op's error.
    let (status, _) =
        infer_with(&[meta(DType::F64, &[3]), absent_meta()], &CombineCall::new("prod", &[], None), &mut err);
    assert_eq!(
        (status, text(err.as_ptr()).as_str()),
        (sys::OPB_ERR_INVALID_ARGUMENT, "mode must be \"sum\" or \"max\"")
    );

    // Kernel: `y` present or absent (ndim OPB_ABSENT, null pointers), with every kind of value.
    let x = [1.0f64, 5.0, -2.0];
    let y = [4.0f64, 2.0, -3.0];
    let (mut shape, mut strides) = ([3i64], [1i64]);
    let (shape, strides) = (shape.as_mut_ptr(), strides.as_mut_ptr());
    let tensor = |data: *const f64| sys::DLTensor {
        data: data as *mut c_void,
        device: sys::DLDevice { device_type: sys::kDLCPU, device_id: 0 },
        ndim: 1,
        dtype: DType::F64.to_dl(),
        shape,
        strides,
        byte_offset: 0,
    };
    let absent = sys::DLTensor {
        data: std::ptr::null_mut(),
        device: sys::DLDevice { device_type: sys::kDLCPU, device_id: 0 },
        ndim: sys::OPB_ABSENT,
        dtype: sys::DLDataType::default(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    let run = |y: Option<&[f64; 3]>, call: &CombineCall| {
        let mut out = [0.0f64; 3];
        let inputs = [tensor(x.as_ptr()), y.map_or_else(|| sys::DLTensor { ..absent }, |y| tensor(y.as_ptr()))];
        let mut output = tensor(out.as_mut_ptr());
        let mut err = [0 as c_char; 256];
        // SAFETY: two input tensors (one may be absent), one output, valid attrs and buffer.
        let status = unsafe {
            kernel(
                inputs.as_ptr(),
                2,
                &mut output,
                1,
                &call.attrs(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        assert_eq!(status, sys::OPB_OK, "{}", text(err.as_ptr()));
        out
    };
    assert_eq!(run(Some(&y), &sum), [6.0, 9.0, -4.0]);
    assert_eq!(run(None, &sum), [2.0, 7.0, -1.0]);
    assert_eq!(run(Some(&y), &CombineCall::new("max", &[], None)), [4.0, 5.0, -2.0]);
    assert_eq!(run(Some(&y), &CombineCall::new("sum", &[10, 20, 30], None)), [15.0, 27.0, 25.0]);
    assert_eq!(run(None, &CombineCall::new("sum", &[], Some(3))), [3.0, 15.0, -6.0]);
}

#[test]
fn the_input_dtypes_trampoline_writes_the_dtypes() {
    let described = describe::<Combine>();
    let choose = described.desc().input_dtypes.unwrap();
    let call = CombineCall::new("sum", &[], None);
    let mut err = [0 as c_char; 256];
    let run = |inputs: [sys::OpbMeta; 2], err: &mut [c_char; 256]| {
        // Prefilled as the host does: the inputs' own dtypes, zeroed for absent ones.
        let mut dtypes = inputs.map(|m| if m.ndim == sys::OPB_ABSENT { Default::default() } else { m.dtype });
        // SAFETY: two metas, two writable dtypes, valid attrs and buffer.
        let status =
            unsafe { choose(inputs.as_ptr(), 2, dtypes.as_mut_ptr(), &call.attrs(), err.as_mut_ptr(), err.len()) };
        assert_eq!(status, sys::OPB_OK, "{}", text(err.as_ptr()));
        dtypes
    };
    let f64_ = DType::F64.to_dl();
    assert_eq!(run([meta(DType::I32, &[2]), absent_meta()], &mut err), [f64_, sys::DLDataType::default()]);
    assert_eq!(run([meta(DType::F64, &[2]), meta(DType::I32, &[2])], &mut err), [f64_, f64_]);
    assert_eq!(run([meta(DType::F64, &[2]), meta(DType::F64, &[2])], &mut err), [f64_, f64_]);
}

static GREEDY_SIZES: AtomicUsize = AtomicUsize::new(0);

/// An impure `WORKSPACE` (safe code may be): 16 bytes the first time it is asked, 1 MiB after.
/// `run` fills its workspace and writes the length it got.
struct Greedy;

impl Op for Greedy {
    const NAME: &'static str = "greedy";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const DTYPES: &'static [DType] = &[DType::F64];
    const WORKSPACE: Option<WorkspaceFn> =
        Some(|_, _| if GREEDY_SIZES.fetch_add(1, Ordering::Relaxed) == 0 { 16 } else { 1 << 20 });

    fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(_: &Inputs<'_, Tensor<'_>>, outputs: &mut [TensorMut<'_>], _: &Attrs<'_>, ws: &mut [u8]) -> Result<()> {
        ws.fill(0xab);
        outputs[0].as_mut_slice::<f64>()?[0] = ws.len() as f64;
        Ok(())
    }
}

#[test]
fn the_kernel_sees_exactly_the_workspace_the_host_passed() {
    let described = describe::<Greedy>();
    let desc = *described.desc();
    let (size, kernel) = (desc.workspace_size.unwrap(), desc.cpu_kernel.unwrap());
    let meta = meta(DType::F64, &[1]);
    let no_attrs = sys::OpbAttrs { count: 0, values: std::ptr::null(), names: std::ptr::null() };
    // SAFETY: one input meta, valid attrs.
    let bytes = unsafe { size(&meta, 1, &no_attrs) };
    assert_eq!(bytes, 16);
    // Every later question would get 1 MiB: the kernel must go by the host's size, not ask again.
    // A guard word after the 16 bytes shows whether the kernel wrote past them.
    let mut buffer = [0u64; 3];
    let (mut shape, mut strides) = ([1i64], [1i64]);
    let x = [0.0f64];
    let tensor = |data: *mut c_void, shape: *mut i64, strides: *mut i64| sys::DLTensor {
        data,
        device: sys::DLDevice { device_type: sys::kDLCPU, device_id: 0 },
        ndim: 1,
        dtype: DType::F64.to_dl(),
        shape,
        strides,
        byte_offset: 0,
    };
    let input = tensor(x.as_ptr() as *mut c_void, shape.as_mut_ptr(), strides.as_mut_ptr());
    let mut run = |workspace: *mut u64, workspace_size: usize| {
        let mut y = [-1.0f64];
        let mut output = tensor(y.as_mut_ptr().cast(), shape.as_mut_ptr(), strides.as_mut_ptr());
        let mut err = [0 as c_char; 256];
        // SAFETY: one input and one output tensor, valid attrs and buffer; `workspace` is null
        // or valid for `workspace_size` bytes.
        let status = unsafe {
            kernel(
                &input,
                1,
                &mut output,
                1,
                &no_attrs,
                std::ptr::null_mut(),
                workspace.cast(),
                workspace_size,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        (status, y[0], text(err.as_ptr()))
    };
    assert_eq!(run(buffer.as_mut_ptr(), bytes), (sys::OPB_OK, 16.0, String::new()));
    assert_eq!(buffer, [u64::from_ne_bytes([0xab; 8]), u64::from_ne_bytes([0xab; 8]), 0]);
    // A host passing less than was asked for: the slice is no longer than what it passed.
    buffer = [0; 3];
    assert_eq!(run(buffer.as_mut_ptr(), 8), (sys::OPB_OK, 8.0, String::new()));
    assert_eq!(buffer, [u64::from_ne_bytes([0xab; 8]), 0, 0]);
    // No workspace: an empty one; a size without a pointer is the host's error, reported.
    assert_eq!(run(std::ptr::null_mut(), 0), (sys::OPB_OK, 0.0, String::new()));
    assert_eq!(run(std::ptr::null_mut(), 16), (sys::OPB_ERR_FAILED, -1.0, "the host passed no workspace".to_string()));
    assert_eq!(GREEDY_SIZES.load(Ordering::Relaxed), 1, "the kernel asked WORKSPACE again");
}

/// Declares an optional input that is not one of its inputs.
struct BadOptional;

impl Op for BadOptional {
    const NAME: &'static str = "bad_optional";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const OPTIONAL_INPUTS: &'static [&'static str] = &["w"];
    const DTYPES: &'static [DType] = &[DType::F64];

    fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(_: &Inputs<'_, Tensor<'_>>, _: &mut [TensorMut<'_>], _: &Attrs<'_>, _: &mut [u8]) -> Result<()> {
        Ok(())
    }
}

#[test]
fn an_optional_input_that_is_not_an_input_makes_init_fail() {
    static CELL: opbridge_plugin_sdk::__private::PluginCell = opbridge_plugin_sdk::__private::PluginCell::new();
    let host = sys::OpbPluginHost {
        abi_version: sys::OPBRIDGE_PLUGIN_ABI_VERSION,
        reserved0: 0,
        runtime_version: c"test".as_ptr(),
        reserved: [std::ptr::null_mut(); 4],
    };
    let mut info = sys::OpbPluginInfo::zeroed();
    // SAFETY: valid host and info; what `export_plugin!` expands to, with another op list.
    let status = unsafe {
        opbridge_plugin_sdk::__private::init(&host, &mut info, &CELL, "bad", None, || vec![describe::<BadOptional>()])
    };
    assert_eq!((status, info.abi_version, info.n_ops), (sys::OPB_ERR_FAILED, 3, 0));
    let message = text(info.error);
    assert!(message.contains("optional input \"w\" of operator bad_optional is not one of its INPUTS"), "{message}");
}

/// A device-only operator: what its kernel saw, for the test to read back.
struct OnAscend;

static SEEN: std::sync::Mutex<Option<(String, usize, usize)>> = std::sync::Mutex::new(None);

impl Op for OnAscend {
    const NAME: &'static str = "on_ascend";
    const VERSION: u32 = 1;
    const INPUTS: &'static [&'static str] = &["x"];
    const DTYPES: &'static [DType] = &[DType::F32];
    const DEVICES: &'static [opbridge_plugin_sdk::Device] = &[opbridge_plugin_sdk::Device::Ascend];
    const CPU: bool = false;

    fn infer(inputs: &Inputs<'_, Meta>, _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        Ok(vec![inputs[0].clone()])
    }

    fn run(_: &Inputs<'_, Tensor<'_>>, _: &mut [TensorMut<'_>], _: &Attrs<'_>, _: &mut [u8]) -> Result<()> {
        unreachable!("CPU = false: the descriptor has no CPU kernel")
    }

    fn run_device(
        inputs: &Inputs<'_, opbridge_plugin_sdk::DeviceTensor>,
        outputs: &[opbridge_plugin_sdk::DeviceTensor],
        _attrs: &Attrs<'_>,
        launch: &opbridge_plugin_sdk::DeviceLaunch,
    ) -> Result<()> {
        let x = &inputs[0];
        if !x.is_contiguous() {
            return Err(Error::invalid_argument("contiguous inputs only"));
        }
        let what =
            format!("{}:{} {:?} {:?}", launch.device().name(), launch.device_id(), x.shape(), outputs[0].dtype());
        *SEEN.lock().unwrap() = Some((what, x.data_ptr() as usize, launch.stream() as usize));
        Ok(())
    }
}

#[test]
fn a_device_kernel_gets_device_tensors_and_the_stream() {
    let described = describe::<OnAscend>();
    let desc = described.desc();
    assert!(desc.cpu_kernel.is_none(), "CPU = false leaves the CPU kernel out");
    assert_eq!(desc.n_device_kernels, 1);
    // SAFETY: one device kernel, alive with `described`.
    let dk = unsafe { &*desc.device_kernels };
    assert_eq!((dk.device_type, dk.flags), (sys::OPB_DEVICE_ASCEND, 0));
    let kernel = dk.kernel.expect("a kernel");

    let mut shape = [2i64, 3];
    let shape_ptr = shape.as_mut_ptr();
    let mut strides = [3i64, 1];
    let tensor = |data: usize, strides: *mut i64| sys::DLTensor {
        data: data as *mut c_void,
        device: sys::DLDevice { device_type: sys::OPB_DEVICE_ASCEND, device_id: 1 },
        ndim: 2,
        dtype: DType::F32.to_dl(),
        shape: shape_ptr,
        strides,
        byte_offset: 16,
    };
    let x = tensor(0x1000, strides.as_mut_ptr());
    let mut out = [tensor(0x2000, strides.as_mut_ptr())];
    let attrs = sys::OpbAttrs { count: 0, values: std::ptr::null(), names: std::ptr::null() };
    let mut err = [0 as c_char; 256];
    let stream = 0xabc0usize as *mut c_void;
    // SAFETY: tensors with valid extents (their device addresses are never read), a valid error buffer.
    let status = unsafe {
        kernel(&x, 1, out.as_mut_ptr(), 1, &attrs, stream, std::ptr::null_mut(), 0, err.as_mut_ptr(), err.len())
    };
    assert_eq!(status, sys::OPB_OK, "{}", text(err.as_ptr()));
    let seen = SEEN.lock().unwrap().take().expect("the kernel ran");
    assert_eq!(seen, ("ascend:1 [2, 3] F32".to_string(), 0x1010, 0xabc0), "byte_offset folded into the address");

    // A strided input: the kernel's own error, as a status and a message.
    let mut transposed = [1i64, 2];
    let x = tensor(0x1000, transposed.as_mut_ptr());
    // SAFETY: as above.
    let status = unsafe {
        kernel(&x, 1, out.as_mut_ptr(), 1, &attrs, stream, std::ptr::null_mut(), 0, err.as_mut_ptr(), err.len())
    };
    assert_eq!((status, text(err.as_ptr()).as_str()), (sys::OPB_ERR_INVALID_ARGUMENT, "contiguous inputs only"));
}

static RELEASED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count_release() {
    RELEASED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn the_release_callback_reaches_the_host() {
    static CELL: opbridge_plugin_sdk::__private::PluginCell = opbridge_plugin_sdk::__private::PluginCell::new();
    let host = sys::OpbPluginHost {
        abi_version: sys::OPBRIDGE_PLUGIN_ABI_VERSION,
        reserved0: 0,
        runtime_version: c"test".as_ptr(),
        reserved: [std::ptr::null_mut(); 4],
    };
    let mut info = sys::OpbPluginInfo::zeroed();
    // SAFETY: valid host and info; what `export_plugin!(...; release = f)` expands to.
    let status = unsafe {
        opbridge_plugin_sdk::__private::init(&host, &mut info, &CELL, "rel", Some(count_release), || {
            vec![describe::<OnAscend>()]
        })
    };
    assert_eq!(status, sys::OPB_OK);
    let release = info.release.expect("set");
    // SAFETY: the host calls it once, with the library open.
    unsafe { release() };
    assert_eq!(RELEASED.load(Ordering::SeqCst), 1);
    // Without one, the entry point leaves it NULL.
    let (_, plain) = init();
    assert!(plain.release.is_none());
}
