//! The SDK as a host sees it: its declarations match the C header, and the generated entry
//! point and trampolines turn safe Rust into the ABI (results, errors, panics, strided inputs).

use std::ffi::{c_char, c_void, CStr};
use std::path::Path;
use std::process::Command;

use opbridge_plugin_sdk::{
    export_plugin, sys, Attr, Attrs, DType, Error, Meta, Op, Result, Tensor, TensorMut, WorkspaceFn,
};

struct AddK;

impl Op for AddK {
    const NAME: &'static str = "add_k";
    const VERSION: u32 = 3;
    const DOC: &'static str = "x + k";
    const INPUTS: &'static [&'static str] = &["x"];
    const ATTRS: &'static [Attr] = &[Attr::int("k", 1).doc("the increment"), Attr::bool("explode", false).required()];
    const DTYPES: &'static [DType] = &[DType::F64, DType::I64];

    fn infer(inputs: &[Meta], _attrs: &Attrs<'_>) -> Result<Vec<Meta>> {
        if inputs[0].shape.len() != 1 {
            return Err(Error::shape("1-D only"));
        }
        Ok(vec![inputs[0].clone()])
    }

    const WORKSPACE: Option<WorkspaceFn> = Some(|inputs, _attrs| inputs[0].shape[0] * 8);

    fn run(inputs: &[Tensor<'_>], outputs: &mut [TensorMut<'_>], attrs: &Attrs<'_>, ws: &mut [u8]) -> Result<()> {
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
    assert_eq!(info.abi_version, 1);
    assert_eq!(text(info.name), "sdk_test");
    assert_eq!(info.n_ops, 1);
    // SAFETY: one descriptor, kept alive by the SDK.
    let desc = unsafe { &*info.ops };
    assert_eq!((text(desc.name).as_str(), desc.version, text(desc.doc).as_str()), ("add_k", 3, "x + k"));
    assert_eq!((desc.n_inputs, desc.n_outputs, desc.n_attrs, desc.n_dtypes), (1, 1, 2, 2));
    // SAFETY: arrays of the declared lengths.
    let (attrs, dtypes) =
        unsafe { (std::slice::from_raw_parts(desc.attrs, 2), std::slice::from_raw_parts(desc.dtypes, 2)) };
    assert_eq!((text(attrs[0].name).as_str(), attrs[0].kind, attrs[0].required, attrs[0].default_int), ("k", 0, 0, 1));
    assert_eq!((text(attrs[1].name).as_str(), attrs[1].kind, attrs[1].required), ("explode", 2, 1));
    assert_eq!(text(attrs[0].doc), "the increment");
    assert_eq!(dtypes, [DType::F64.to_dl(), DType::I64.to_dl()]);
    // SAFETY: one name.
    assert_eq!(text(unsafe { *desc.input_names }), "x");

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
    assert_eq!((info.abi_version, info.n_ops), (1, 0));
}

struct Call {
    values: Vec<sys::OpbAttrValue>,
    names: Vec<*const c_char>,
}

impl Call {
    fn new(k: i64, explode: bool) -> Call {
        Call {
            values: vec![
                sys::OpbAttrValue { kind: sys::OPB_ATTR_INT, reserved: 0, i: k, f: 0.0 },
                sys::OpbAttrValue { kind: sys::OPB_ATTR_BOOL, reserved: 0, i: explode as i64, f: 0.0 },
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
