//! The plugin loader against real shared libraries, built from C sources with the system
//! compiler (`cc`, or `$CC`): ABI layout, validation at load time (each error leaves nothing
//! registered), calls, kernel errors, unload under concurrent calls, reload of a rebuilt file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use opbridge_ops::plugin::{sys, Library};
use opbridge_ops::{AttrValue, Meta, OpError, Registry, Source, TensorView};
use opbridge_runtime::DType;

/// Loads a library into the process-wide default registry (the one Python uses).
fn load(path: impl AsRef<std::path::Path>) -> opbridge_ops::Result<Library> {
    Library::load_into(std::sync::Arc::clone(opbridge_ops::global()), path)
}

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/opbridge/include")
}

fn scratch_dir() -> PathBuf {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "opbridge-plugin-test-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// Compiles C `source` into `out` with `args` (e.g. `-shared`), panicking with the compiler's
/// message on failure.
fn compile(source: &str, out: &Path, args: &[&str]) {
    let src = out.with_extension("c");
    std::fs::write(&src, source).unwrap();
    let output = Command::new(compiler())
        .args(["-O1", "-fPIC", "-Wall", "-I"])
        .arg(include_dir())
        .args(args)
        .arg(&src)
        .arg("-o")
        .arg(out)
        .output()
        .expect("a C compiler (cc or $CC) is needed by the plugin tests");
    assert!(output.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&output.stderr));
}

fn shared_library(source: &str, name: &str) -> PathBuf {
    let path = scratch_dir().join(format!("lib{name}.so"));
    compile(source, &path, &["-shared"]);
    path
}

/// A library with one operator `name` v`version`: `out = a + k` (float32, `k` an int attribute
/// default `bias`); `extra` is spliced into the descriptor (designated initializers) and `init`
/// replaces the entry point's body.
fn fixture(name: &str, version: u32, bias: i32, extra: &str, init: Option<&str>) -> String {
    let init = init.unwrap_or(
        "info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
         if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
         info->n_ops = 1; info->ops = ops; return OPB_OK;",
    );
    format!(
        r#"
#include <opbridge/plugin.h>
#include <stddef.h>
#include <unistd.h>
static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err, size_t len) {{
  (void)n_in; (void)n_out; (void)attrs;
  if (in[0].ndim != 1) return opb_fail(err, len, OPB_ERR_SHAPE, "{name}: 1-D input expected");
  out[0] = in[0];
  return OPB_OK;
}}
static int kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                  void *stream, void *ws, size_t ws_size, char *err, size_t len) {{
  (void)n_in; (void)n_out; (void)stream; (void)ws; (void)ws_size;
  long long k = opb_attr(attrs, "k")->i;
  if (k < 0) return opb_fail(err, len, OPB_ERR_INVALID_ARGUMENT, "{name}: k must not be negative");
  if (k == 99) return opb_fail(err, len, OPB_ERR_FAILED, "{name}: k = 99 is a kernel failure");
  if (opb_attr(attrs, "slow")->i) usleep(300000);
  const float *a = (const float *)in[0].data;
  float *o = (float *)out[0].data;
  for (int64_t i = 0; i < out[0].shape[0]; i++) o[i] = a[i * in[0].strides[0]] + (float)k;
  return OPB_OK;
}}
static const char *const inputs[] = {{"a"}};
static const DLDataType dtypes[] = {{OPB_FLOAT32}};
static const OpbAttrDesc attrs[] = {{
  {{.name = "k", .kind = OPB_ATTR_INT, .default_int = {bias}, .doc = "added to every element"}},
  {{.name = "slow", .kind = OPB_ATTR_BOOL, .doc = "sleep 300 ms in the kernel"}},
}};
static OpbOpDesc ops[] = {{{{
  .name = "{name}", .version = {version}, .doc = "a + k", .n_inputs = 1, .input_names = inputs,
  .n_outputs = 1, .n_attrs = 2, .attrs = attrs, .n_dtypes = 1, .dtypes = dtypes,
  .infer = infer, .cpu_kernel = kernel, {extra}
}}}};
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {{
  {init}
}}
"#
    )
}

fn load_err(path: &Path) -> String {
    match load(path) {
        Ok(lib) => panic!("{} loaded: {:?}", path.display(), lib.ops()),
        Err(error) => {
            assert!(matches!(error, OpError::Plugin { .. }), "{error:?}");
            error.to_string()
        }
    }
}

fn registered(name: &str) -> bool {
    opbridge_ops::global().get(name, None).is_ok()
}

/// Calls `name` (latest or `version`) on a float32 vector through the registry, as the bindings do.
fn call(name: &str, version: Option<u32>, a: &[f32], attrs: &[(&str, AttrValue)]) -> Result<Vec<f32>, OpError> {
    let entry = opbridge_ops::global().get(name, version)?;
    let _guard = entry.enter();
    call_entry(&entry, a, attrs)
}

fn call_entry(entry: &opbridge_ops::Entry, a: &[f32], attrs: &[(&str, AttrValue)]) -> Result<Vec<f32>, OpError> {
    let attrs = entry.schema().bind_attrs(attrs.iter().map(|(n, v)| (*n, v.clone())))?;
    let metas = entry.op.infer(&[Some(Meta::new(DType::F32, &[a.len()]))], &attrs)?;
    assert_eq!(metas, vec![Meta::new(DType::F32, &[a.len()])]);
    let mut out = vec![0f32; a.len()];
    let input = TensorView::contiguous(a.as_ptr() as usize, DType::F32, &[a.len()]);
    let output = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F32, &[a.len()]);
    entry.op.run_cpu(&[Some(input)], &[output], &attrs)?;
    Ok(out)
}

#[test]
fn rust_declarations_match_the_header() {
    let mut program =
        String::from("#include <stdio.h>\n#include <stddef.h>\n#include <opbridge/plugin.h>\nint main(void) {\n");
    for (ty, field, _) in sys::layout() {
        if field == "sizeof" {
            program += &format!("  printf(\"{ty} sizeof %zu\\n\", sizeof({ty}));\n");
        } else {
            program += &format!("  printf(\"{ty} {field} %zu\\n\", offsetof({ty}, {field}));\n");
        }
    }
    program += "  return 0;\n}\n";
    let exe = scratch_dir().join("layout");
    compile(&program, &exe, &[]);
    let output = Command::new(&exe).output().unwrap();
    let printed = String::from_utf8(output.stdout).unwrap();
    let expected: String = sys::layout().iter().map(|(ty, field, n)| format!("{ty} {field} {n}\n")).collect();
    assert_eq!(printed, expected);
}

#[test]
fn header_compiles_as_c_and_beside_a_users_dlpack() {
    // A user's own dlpack.h included first: the header's copy steps aside.
    let dir = scratch_dir();
    std::fs::create_dir_all(dir.join("dlpack")).unwrap();
    std::fs::write(
        dir.join("dlpack/dlpack.h"),
        "#ifndef DLPACK_DLPACK_H_\n#define DLPACK_DLPACK_H_\n#include <stdint.h>\n#define DLPACK_MAJOR_VERSION 1\n\
         typedef enum { kDLCPU = 1 } DLDeviceType;\ntypedef struct { DLDeviceType device_type; int32_t device_id; } DLDevice;\n\
         typedef enum { kDLInt = 0U, kDLUInt = 1U, kDLFloat = 2U } DLDataTypeCode;\n\
         typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;\n\
         typedef struct { void *data; DLDevice device; int32_t ndim; DLDataType dtype; int64_t *shape; int64_t *strides; uint64_t byte_offset; } DLTensor;\n#endif\n",
    )
    .unwrap();
    let source = format!("#include <dlpack/dlpack.h>\n{}", fixture("dlpack_first", 1, 0, "", None));
    let out = dir.join("libdlpack_first.so");
    compile(&source, &out, &["-shared", "-Werror", "-I", dir.to_str().unwrap()]);
}

#[test]
fn the_c_example_registers_both_versions_and_computes() {
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/plugins/c/scale_add.c"))
            .unwrap();
    let path = shared_library(&source, "scale_add_example");
    let lib = load(&path).unwrap();
    assert_eq!(lib.ops(), vec![("scale_add".to_string(), 1), ("scale_add".to_string(), 2)]);
    assert_eq!(lib.name(), Some("scale_add_c"));
    let v2 = opbridge_ops::global().get("scale_add", None).unwrap();
    assert_eq!(v2.schema().version, 2);
    assert_eq!(v2.source, Source::Library(path.clone()));
    assert_eq!(v2.schema().signature(), "scale_add(a, b, *, alpha=1.0, beta=1.0, out=None)");
    assert_eq!(v2.schema().dtypes, vec![DType::F32, DType::F64]);

    // float64, strided `a` (every other element of a buffer).
    let a_buf: Vec<f64> = (0..8).map(f64::from).collect();
    let b: Vec<f64> = vec![1.0; 4];
    let mut out = vec![0f64; 4];
    let a = TensorView {
        data: a_buf.as_ptr() as usize,
        dtype: DType::F64,
        shape: smallvec::smallvec![4],
        strides: smallvec::smallvec![2],
    };
    let bv = TensorView::contiguous(b.as_ptr() as usize, DType::F64, &[4]);
    let ov = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F64, &[4]);
    for (version, attrs, want) in [
        (1, vec![("alpha".to_string(), AttrValue::Float(2.0))], [1.0, 5.0, 9.0, 13.0]),
        (
            2,
            vec![("alpha".to_string(), AttrValue::Float(2.0)), ("beta".to_string(), AttrValue::Float(-1.0))],
            [-1.0, 3.0, 7.0, 11.0],
        ),
    ] {
        let entry = opbridge_ops::global().get("scale_add", Some(version)).unwrap();
        let attrs = entry.schema().bind_attrs(attrs).unwrap();
        let metas =
            entry.op.infer(&[Some(Meta::new(DType::F64, &[4])), Some(Meta::new(DType::F64, &[4]))], &attrs).unwrap();
        assert_eq!(metas, vec![Meta::new(DType::F64, &[4])]);
        entry.op.run_cpu(&[Some(a.clone()), Some(bv.clone())], std::slice::from_ref(&ov), &attrs).unwrap();
        assert_eq!(out, want, "v{version}");
    }

    // Errors of the shape function are typed.
    let attrs = v2.schema().bind_attrs(Vec::<(&str, AttrValue)>::new()).unwrap();
    let shape = v2.op.infer(&[Some(Meta::new(DType::F64, &[4])), Some(Meta::new(DType::F64, &[5]))], &attrs);
    assert!(matches!(shape, Err(OpError::Shape { .. })), "{shape:?}");
    let dtype = v2.op.infer(&[Some(Meta::new(DType::F32, &[4])), Some(Meta::new(DType::F64, &[4]))], &attrs);
    assert!(matches!(dtype, Err(OpError::DType { .. })), "{dtype:?}");
    // dtypes outside the descriptor's list are refused before the plugin sees them.
    let int = v2.op.infer(&[Some(Meta::new(DType::I32, &[4])), Some(Meta::new(DType::I32, &[4]))], &attrs);
    assert!(matches!(int, Err(OpError::DType { .. })), "{int:?}");

    // A second load of the same operators is refused and leaves the first intact.
    let again = load_err(&path);
    assert!(again.contains("\"scale_add\" version 1 is already registered"), "{again}");
    assert!(registered("scale_add"));

    lib.unload().unwrap();
    assert!(!registered("scale_add"));
}

#[test]
fn calls_attributes_and_kernel_errors() {
    let lib = load(shared_library(&fixture("plug_add", 1, 10, "", None), "plug_add")).unwrap();
    assert_eq!(call("plug_add", None, &[1.0, 2.0], &[]).unwrap(), vec![11.0, 12.0]);
    assert_eq!(call("plug_add", Some(1), &[1.0, 2.0], &[("k", AttrValue::Int(1))]).unwrap(), vec![2.0, 3.0]);
    let negative = call("plug_add", None, &[1.0], &[("k", AttrValue::Int(-1))]).unwrap_err();
    assert!(matches!(&negative, OpError::Argument { message, .. } if message.contains("k must not be negative")));
    let failed = call("plug_add", None, &[1.0], &[("k", AttrValue::Int(99))]).unwrap_err();
    assert!(
        matches!(&failed, OpError::Kernel { op, message } if &**op == "plug_add" && message.contains("kernel failure"))
    );
    let wrong_kind = call("plug_add", None, &[1.0], &[("k", AttrValue::Float(0.5))]).unwrap_err();
    assert!(matches!(wrong_kind, OpError::InvalidAttribute { .. }), "{wrong_kind:?}");
    lib.unload().unwrap();
}

#[test]
fn the_kernel_receives_the_workspace_and_its_size() {
    // `workspace_size` asks for 4 bytes per element but the first; the kernel fills what it got
    // and writes its size (+ 0.5 when the pointer is not NULL) to every element.
    let source = r#"
#include <stdint.h>
#include <string.h>
#include <opbridge/plugin.h>
static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err, size_t len) {
  (void)n_in; (void)n_out; (void)attrs; (void)err; (void)len;
  out[0] = in[0];
  return OPB_OK;
}
static size_t wsize(const OpbMeta *in, int n_in, const OpbAttrs *attrs) {
  (void)n_in; (void)attrs;
  return 4 * (size_t)(in[0].shape[0] - 1);
}
static int kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                  void *stream, void *ws, size_t ws_size, char *err, size_t len) {
  (void)in; (void)n_in; (void)n_out; (void)attrs; (void)stream;
  if ((ws == NULL) != (ws_size == 0)) return opb_fail(err, len, OPB_ERR_FAILED, "NULL workspace iff size 0");
  if ((uintptr_t)ws % 64) return opb_fail(err, len, OPB_ERR_FAILED, "workspace not 64-byte aligned");
  if (ws) memset(ws, 0xab, ws_size);
  float *o = (float *)out[0].data;
  for (int64_t i = 0; i < out[0].shape[0]; i++) o[i] = (float)ws_size + (ws ? 0.5f : 0.0f);
  return OPB_OK;
}
static const DLDataType dtypes[] = {OPB_FLOAT32};
static OpbOpDesc ops[] = {{
  .name = "plug_ws", .version = 1, .n_inputs = 1, .n_outputs = 1, .n_dtypes = 1, .dtypes = dtypes,
  .infer = infer, .cpu_kernel = kernel, .workspace_size = wsize,
}};
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->n_ops = 1; info->ops = ops; return OPB_OK;
}
"#;
    let lib = load(shared_library(source, "plug_ws")).unwrap();
    assert_eq!(call("plug_ws", None, &[0.0; 3], &[]).unwrap(), vec![8.5; 3]);
    assert_eq!(call("plug_ws", None, &[0.0; 17], &[]).unwrap(), vec![64.5; 17]);
    // A size of 0: no workspace, a NULL pointer.
    assert_eq!(call("plug_ws", None, &[0.0], &[]).unwrap(), vec![0.0]);
    lib.unload().unwrap();
}

#[test]
fn not_a_library_is_an_error() {
    let dir = scratch_dir();
    let text = dir.join("libnot_a_library.so");
    std::fs::write(&text, "this is not an ELF file").unwrap();
    assert!(load_err(&text).contains("not a loadable shared library"));
    assert!(load_err(&dir.join("missing.so")).contains("no such file"));
    assert!(load_err(&dir).contains("not a file"));
}

#[test]
fn a_library_without_the_entry_point_is_an_error() {
    let path = shared_library("int some_function(void) { return 1; }\n", "no_entry");
    let message = load_err(&path);
    assert!(message.contains("does not export `opbridge_plugin_init`"), "{message}");
}

#[test]
fn abi_version_mismatch_is_an_error() {
    // A library built for ABI 1 (whose descriptors have another layout): refused before its
    // descriptors are read.
    let init = "info->abi_version = 1; return OPB_ERR_ABI_MISMATCH;";
    let message = load_err(&shared_library(&fixture("abi_one", 1, 0, "", Some(init)), "abi_one"));
    assert!(
        message
            .contains("ABI version mismatch: the library was built for plugin ABI 1, this opbridge loads ABI 2 to 3"),
        "{message}"
    );
    assert!(message.contains("rebuild it"), "{message}");
    // Even one that returns OPB_OK.
    let init = "info->abi_version = 1; info->n_ops = 1; info->ops = ops; return OPB_OK;";
    let message = load_err(&shared_library(&fixture("abi_one_ok", 1, 0, "", Some(init)), "abi_one_ok"));
    assert!(message.contains("built for plugin ABI 1"), "{message}");
    // A library that forgets to set its version at all.
    let message = load_err(&shared_library(&fixture("abi_unset", 1, 0, "", Some("return OPB_OK;")), "abi_unset"));
    assert!(message.contains("built for plugin ABI 0"), "{message}");
    assert!(!registered("abi_one") && !registered("abi_one_ok") && !registered("abi_unset"));
}

#[test]
fn a_failing_init_is_an_error_with_its_message() {
    let init = "info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION; info->error = \"no license\"; return OPB_ERR_FAILED;";
    let message = load_err(&shared_library(&fixture("init_fails", 1, 0, "", Some(init)), "init_fails"));
    assert!(message.contains("failed with status 5: no license"), "{message}");
}

#[test]
fn malformed_descriptors_are_errors() {
    let cases: &[(&str, &str, &str)] = &[
        ("null_name", ".name = 0", "operator name is NULL"),
        ("bad_name", ".name = \"has space\"", "is not an identifier"),
        ("zero_version", ".version = 0", "version is 0"),
        ("bad_dtype", ".dtypes = (const DLDataType[]){{kDLUInt, 8, 1}}", "dtypes[0] (code 1, bits 8, lanes 1)"),
        ("no_dtypes", ".n_dtypes = 0", "n_dtypes is 0"),
        ("many_inputs", ".n_inputs = 17", "n_inputs is 17; expected 0 to 16"),
        ("no_outputs", ".n_outputs = 0", "n_outputs is 0"),
        ("null_inputs_names", ".input_names = (const char *const[]){0}", "input_names[0] is NULL"),
        ("no_infer", ".infer = 0", "no shape function"),
        ("no_cpu_kernel", ".cpu_kernel = 0", "cpu_kernel is NULL"),
        (
            "bad_attr_kind",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .kind = 7}, {.name = \"slow\", .kind = OPB_ATTR_BOOL}}",
            "attribute \"k\": kind 7; expected 0 (int), 1 (float), 2 (bool), 3 (str) or 4 (ints)",
        ),
        (
            "dup_attr",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .kind = OPB_ATTR_INT}, \
             {.name = \"k\", .kind = OPB_ATTR_BOOL}}",
            "\"k\" is used twice",
        ),
        // ABI 2's fields.
        (
            "unknown_attr_flags",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .flags = 8 | OPB_ATTR_NULLABLE}, \
             {.name = \"slow\", .kind = 2}}",
            "attribute \"k\": unknown flags 0x8",
        ),
        (
            "required_default_none",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .flags = OPB_ATTR_REQUIRED | OPB_ATTR_DEFAULT_NONE}, \
             {.name = \"slow\", .kind = 2}}",
            "attribute \"k\": OPB_ATTR_REQUIRED and OPB_ATTR_DEFAULT_NONE contradict each other",
        ),
        (
            "many_default_ints",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .kind = OPB_ATTR_INTS, .n_default_ints = 65, \
             .default_ints = (const int64_t[65]){0}}, {.name = \"slow\", .kind = 2}}",
            "attribute \"k\": n_default_ints is 65; expected 0 to 64",
        ),
        (
            "negative_default_ints",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .kind = OPB_ATTR_INTS, .n_default_ints = -1}, \
             {.name = \"slow\", .kind = 2}}",
            "attribute \"k\": n_default_ints is -1; expected 0 to 64",
        ),
        (
            "null_default_ints",
            ".attrs = (const OpbAttrDesc[]){{.name = \"k\", .kind = OPB_ATTR_INTS, .n_default_ints = 2}, \
             {.name = \"slow\", .kind = 2}}",
            "default_ints is NULL but 2 are declared",
        ),
        ("unknown_op_flags", ".flags = 6", "unknown operator flags 0x6"),
        ("reserved_set", ".reserved = {(void *)1}", "reserved fields must be NULL"),
        // ABI 3's device kernels.
        ("no_kernel", ".cpu_kernel = NULL", "no kernel: cpu_kernel is NULL and there are no device_kernels"),
        (
            "unknown_device",
            ".n_device_kernels = 1, .device_kernels = (const OpbDeviceKernel[]){{.device_type = 7, .kernel = kernel}}",
            "device_kernels[0]: device type 7 is not one opbridge has kernels for",
        ),
        (
            "second_ascend",
            ".n_device_kernels = 2, .device_kernels = (const OpbDeviceKernel[]){{.device_type = OPB_DEVICE_ASCEND, \
             .kernel = kernel}, {.device_type = OPB_DEVICE_ASCEND, .kernel = kernel}}",
            "device_kernels[1]: a second ascend kernel",
        ),
        (
            "null_device_kernel",
            ".n_device_kernels = 1, .device_kernels = (const OpbDeviceKernel[]){{.device_type = OPB_DEVICE_ASCEND}}",
            "device_kernels[0]: kernel is NULL",
        ),
        (
            "device_kernel_flags",
            ".n_device_kernels = 1, .device_kernels = (const OpbDeviceKernel[]){{.device_type = OPB_DEVICE_ASCEND, \
             .flags = 1, .kernel = kernel}}",
            "device_kernels[0]: flags and reserved fields must be 0 / NULL",
        ),
        ("many_device_kernels", ".n_device_kernels = 9", "n_device_kernels is 9; expected 0 to 8"),
        (
            "cuda_kernel",
            ".n_device_kernels = 1, .device_kernels = (const OpbDeviceKernel[]){{.device_type = kDLCUDA, .kernel = kernel}}",
            "device_kernels[0]: device type 2 is not one opbridge has kernels for",
        ),
        (
            "stray_device_kernels",
            ".device_kernels = (const OpbDeviceKernel[]){{.device_type = OPB_DEVICE_ASCEND, .kernel = kernel}}",
            "device_kernels is not NULL but n_device_kernels is 0",
        ),
        ("null_device_kernels", ".n_device_kernels = 1", "device_kernels is NULL but 1 are declared"),
    ];
    for &(name, extra, want) in cases {
        // Later designated initializers override the fixture's.
        let source = fixture(name, 1, 0, extra, None);
        let path = scratch_dir().join(format!("lib{name}.so"));
        compile(&source, &path, &["-shared", "-Wno-override-init", "-Wno-initializer-overrides"]);
        let message = load_err(&path);
        assert!(message.contains("malformed descriptor ops[0]") && message.contains(want), "{name}: {message}");
        assert!(!registered(name), "{name} stayed registered");
    }
    for (name, init, want) in [
        (
            "zero_ops",
            "info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION; info->n_ops = 0; info->ops = ops; return 0;",
            "n_ops is 0",
        ),
        ("null_ops", "info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION; info->n_ops = 1; return 0;", "ops is NULL"),
        (
            // A version 2 library's descriptor has NULL where ABI 3 keeps device kernels.
            "abi2_with_device_kernels",
            "info->abi_version = 2; if (host->abi_version != 2) return OPB_ERR_ABI_MISMATCH;
             static OpbOpDesc one[1]; one[0] = ops[0]; one[0].n_device_kernels = 1;
             info->n_ops = 1; info->ops = one; return 0;",
            "reserved fields must be NULL in ABI version 2",
        ),
        (
            // ... every byte of it: ABI 2's reserved[0] overlaps n_device_kernels and its padding.
            "abi2_with_padding_set",
            "info->abi_version = 2; if (host->abi_version != 2) return OPB_ERR_ABI_MISMATCH;
             static OpbOpDesc one[1]; one[0] = ops[0];
             ((unsigned char *)&one[0])[offsetof(OpbOpDesc, n_device_kernels) + 4] = 1;
             info->n_ops = 1; info->ops = one; return 0;",
            "reserved fields must be NULL in ABI version 2",
        ),
    ] {
        let message = load_err(&shared_library(&fixture(name, 1, 0, "", Some(init)), name));
        assert!(message.contains(want), "{name}: {message}");
    }
}

#[test]
fn duplicates_are_errors_and_nothing_stays_registered() {
    // Two ops: `dup_ok` v1 (fine) and `vector_add` v1 (a built-in).
    let init = "static OpbOpDesc two[2]; two[0] = ops[0]; two[1] = ops[0]; two[1].name = \"vector_add\";
                info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION; info->n_ops = 2; info->ops = two; return 0;";
    let message = load_err(&shared_library(&fixture("dup_ok", 1, 0, "", Some(init)), "dup_builtin"));
    assert!(message.contains("\"vector_add\" version 1 is already registered (from built-in)"), "{message}");
    assert!(!registered("dup_ok"), "the first op of a failed load stayed registered");
    assert_eq!(opbridge_ops::global().get("vector_add", Some(1)).unwrap().source, Source::Builtin);

    // The same name + version twice in one library.
    let init = "static OpbOpDesc two[2]; two[0] = ops[0]; two[1] = ops[0];
                info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION; info->n_ops = 2; info->ops = two; return 0;";
    let message = load_err(&shared_library(&fixture("dup_self", 1, 0, "", Some(init)), "dup_self"));
    assert!(message.contains("declares operator \"dup_self\" version 1 twice"), "{message}");

    // Versions coexist across libraries; the same version from another library does not.
    let v1 = load(shared_library(&fixture("dup_lib", 1, 1, "", None), "dup_lib_v1")).unwrap();
    let v2 = load(shared_library(&fixture("dup_lib", 2, 2, "", None), "dup_lib_v2")).unwrap();
    let message = load_err(&shared_library(&fixture("dup_lib", 2, 3, "", None), "dup_lib_v2_again"));
    assert!(message.contains("\"dup_lib\" version 2 is already registered"), "{message}");
    assert_eq!(call("dup_lib", None, &[0.0], &[]).unwrap(), vec![2.0]);
    assert_eq!(call("dup_lib", Some(1), &[0.0], &[]).unwrap(), vec![1.0]);
    v2.unload().unwrap();
    assert_eq!(call("dup_lib", None, &[0.0], &[]).unwrap(), vec![1.0], "v1 is the latest again");
    v1.unload().unwrap();
}

#[test]
fn unload_waits_for_calls_in_flight_and_stale_handles_fail_cleanly() {
    let lib = load(shared_library(&fixture("plug_slow", 1, 1, "", None), "plug_slow")).unwrap();
    let entry = opbridge_ops::global().get("plug_slow", None).unwrap();
    let started = Arc::new(Barrier::new(2));
    let caller = {
        let started = Arc::clone(&started);
        std::thread::spawn(move || {
            let entry = opbridge_ops::global().get("plug_slow", None).unwrap();
            let guard = entry.enter();
            started.wait();
            let result = call_entry(guard.entry(), &[1.0], &[("slow", AttrValue::Bool(true))]);
            (result, Instant::now())
        })
    };
    started.wait();
    let t0 = Instant::now();
    lib.unload().unwrap();
    let unloaded = Instant::now();
    let (result, finished) = caller.join().unwrap();
    assert_eq!(result.unwrap(), vec![2.0], "the call in flight completes");
    assert!(finished <= unloaded, "unload returned before the call in flight finished");
    assert!(unloaded - t0 >= Duration::from_millis(100));
    assert!(!registered("plug_slow"));
    // A handle looked up before the unload: a clean error, not a jump into unmapped code.
    let stale = call_entry(&entry, &[1.0], &[]).unwrap_err();
    assert!(matches!(&stale, OpError::Unloaded { name, version: 1, .. } if name == "plug_slow"), "{stale:?}");
}

#[test]
fn unload_under_concurrent_calls() {
    let lib = load(shared_library(&fixture("plug_busy", 1, 1, "", None), "plug_busy")).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, gone) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (stop, ok, gone) = (Arc::clone(&stop), Arc::clone(&ok), Arc::clone(&gone));
            std::thread::spawn(move || {
                let a = vec![1f32; 1000];
                while !stop.load(Ordering::Relaxed) {
                    match call("plug_busy", None, &a, &[]) {
                        Ok(out) => {
                            assert!(out.iter().all(|&x| x == 2.0));
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(OpError::UnknownOperator { .. } | OpError::Unloaded { .. }) => {
                            gone.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(other) => panic!("unexpected error {other:?}"),
                    }
                }
            })
        })
        .collect();
    while ok.load(Ordering::Relaxed) < 200 {
        std::thread::yield_now();
    }
    lib.unload().unwrap();
    let after = gone.load(Ordering::Relaxed);
    while gone.load(Ordering::Relaxed) < after + 100 {
        std::thread::yield_now();
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(ok.load(Ordering::Relaxed) >= 200);
}

#[test]
fn reloading_a_rebuilt_file_at_the_same_path_runs_the_new_code() {
    let dir = scratch_dir();
    let path = dir.join("libplug_reload.so");
    for bias in [1, 2, 3] {
        compile(&fixture("plug_reload", 1, bias, "", None), &path, &["-shared"]);
        let lib = load(&path).unwrap();
        assert_eq!(call("plug_reload", None, &[0.0], &[]).unwrap(), vec![bias as f32]);
        lib.unload().unwrap();
    }
    // No private copies are left behind.
    let copies = std::fs::read_dir(std::env::temp_dir().join("opbridge-plugins"))
        .map(|d| {
            d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().starts_with("libplug_reload")).count()
        })
        .unwrap_or(0);
    assert_eq!(copies, 0);
}

#[test]
fn repeated_shape_function_calls_see_every_change_of_inputs_and_attributes() {
    // `out` has `k` more elements than `a` (plus the length of `s`, the sum of `v`, and 100
    // unless `n` is None) and counts how often the shape function ran in its second
    // dimension: the host may skip a repeated call, never one whose arguments changed.
    let source = r#"
#include <string.h>
#include <opbridge/plugin.h>
static int calls = 0;
static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err, size_t len) {
  (void)n_in; (void)n_out; (void)err; (void)len;
  calls++;
  out[0] = in[0];
  out[0].ndim = 2;
  const OpbAttrValue *s = opb_attr(attrs, "s"), *v = opb_attr(attrs, "v"), *n = opb_attr(attrs, "n");
  out[0].shape[0] = in[0].shape[0] + opb_attr(attrs, "k")->i + (int64_t)strlen(s->s) + (n->is_none ? 0 : 100);
  for (int64_t i = 0; i < v->n_ints; i++) out[0].shape[0] += v->ints[i];
  out[0].shape[1] = calls;
  return OPB_OK;
}
static int kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                  void *stream, void *ws, size_t ws_size, char *err, size_t len) {
  (void)in; (void)n_in; (void)out; (void)n_out; (void)attrs; (void)stream; (void)ws; (void)ws_size; (void)err; (void)len;
  return OPB_OK;
}
static const char *const inputs[] = {"a"};
static const DLDataType dtypes[] = {OPB_FLOAT32, OPB_FLOAT64};
static const OpbAttrDesc attrs[] = {
  {.name = "k", .kind = OPB_ATTR_INT, .doc = "extra elements"},
  {.name = "s", .kind = OPB_ATTR_STR, .doc = "as many extra elements as it has bytes"},
  {.name = "v", .kind = OPB_ATTR_INTS, .doc = "their sum in extra elements"},
  {.name = "n", .kind = OPB_ATTR_INT, .flags = OPB_ATTR_DEFAULT_NONE, .doc = "100 extra elements unless None"},
};
static OpbOpDesc ops[] = {{
  .name = "plug_memo", .version = 1, .n_inputs = 1, .input_names = inputs, .n_outputs = 1,
  .n_attrs = 4, .attrs = attrs, .n_dtypes = 2, .dtypes = dtypes, .infer = infer, .cpu_kernel = kernel,
}};
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->n_ops = 1; info->ops = ops; return OPB_OK;
}
"#;
    let lib = load(shared_library(source, "plug_memo")).unwrap();
    let entry = opbridge_ops::global().get("plug_memo", None).unwrap();
    let infer_with = |dtype: DType, n: usize, attrs: &[(&str, AttrValue)]| {
        let attrs = entry.schema().bind_attrs(attrs.iter().map(|(n, v)| (*n, v.clone()))).unwrap();
        let out = entry.op.infer(&[Some(Meta::new(dtype, &[n]))], &attrs).unwrap();
        (out[0].shape[0], out[0].shape[1])
    };
    let infer = |dtype: DType, n: usize, k: i64| infer_with(dtype, n, &[("k", AttrValue::Int(k))]);
    // (length, calls so far): a repeat keeps the count, any change runs the function again.
    assert_eq!(infer(DType::F32, 4, 1), (5, 1));
    assert_eq!(infer(DType::F32, 4, 1), (5, 1));
    assert_eq!(infer(DType::F32, 4, 2), (6, 2));
    assert_eq!(infer(DType::F32, 7, 2), (9, 3));
    assert_eq!(infer(DType::F64, 7, 2), (9, 4));
    assert_eq!(infer(DType::F64, 7, 2), (9, 4));
    assert_eq!(infer(DType::F32, 4, 1), (5, 5));
    // Strings, lists and None are part of the key too.
    let s = |text: &str| ("s", AttrValue::Str(text.into()));
    let v = |list: &[i64]| ("v", AttrValue::Ints(list.to_vec()));
    assert_eq!(infer_with(DType::F32, 4, &[s("ab")]), (6, 6));
    assert_eq!(infer_with(DType::F32, 4, &[s("ab")]), (6, 6));
    assert_eq!(infer_with(DType::F32, 4, &[s("ba")]), (6, 7));
    assert_eq!(infer_with(DType::F32, 4, &[v(&[1, 2])]), (7, 8));
    assert_eq!(infer_with(DType::F32, 4, &[v(&[1, 2])]), (7, 8));
    assert_eq!(infer_with(DType::F32, 4, &[v(&[2, 1])]), (7, 9));
    assert_eq!(infer_with(DType::F32, 4, &[v(&[2, 1, 0])]), (7, 10));
    assert_eq!(infer_with(DType::F32, 4, &[("n", AttrValue::Int(0))]), (104, 11));
    assert_eq!(infer_with(DType::F32, 4, &[("n", AttrValue::Int(0))]), (104, 11));
    assert_eq!(infer_with(DType::F32, 4, &[("n", AttrValue::None)]), (4, 12));
    assert_eq!(infer_with(DType::F32, 4, &[]), (4, 12));
    lib.unload().unwrap();
}

/// `tests/plugins/abi2_features.c`: every feature ABI 2 added (string, list and None-able
/// attributes, an optional input, the input-dtype callback, the in-place flag), end to end.
fn abi2_features() -> PathBuf {
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/plugins/abi2_features.c"))
            .unwrap();
    shared_library(&source, "abi2_features")
}

/// Held by the tests that load `abi2_features` (its operator names are registered globally).
static ABI2_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A 1-D tensor's view and the buffer it points into (kept alive by the caller).
fn view_f64(data: &[f64]) -> TensorView {
    TensorView::contiguous(data.as_ptr() as usize, DType::F64, &[data.len()])
}

/// `[callback calls so far, whether the last kernel call wrote over its input]`.
fn combine_stats() -> [f64; 2] {
    let entry = opbridge_ops::global().get("combine_stats", None).unwrap();
    let attrs = entry.schema().bind_attrs(Vec::<(&str, AttrValue)>::new()).unwrap();
    assert_eq!(entry.op.infer(&[], &attrs).unwrap(), vec![Meta::new(DType::F64, &[2])]);
    let mut out = [0f64; 2];
    let view = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F64, &[2]);
    entry.op.run_cpu(&[], &[view], &attrs).unwrap();
    out
}

/// `combine` (latest version) through the registry as the bindings call it: input dtypes,
/// shape function, then the kernel on float64 data (int32 inputs are converted here, as the
/// bindings would, after checking that the library asked for it).
fn combine(a: &[f64], b: Option<&[f64]>, int32: bool, attrs: &[(&str, AttrValue)]) -> Result<Vec<f64>, OpError> {
    let entry = opbridge_ops::global().get("combine", None)?;
    let attrs = entry.schema().bind_attrs(attrs.iter().map(|(n, v)| (*n, v.clone())))?;
    let given = if int32 { DType::I32 } else { DType::F64 };
    let metas = [Some(Meta::new(given, &[a.len()])), b.map(|b| Meta::new(given, &[b.len()]))];
    let wanted = entry.op.input_dtypes(&metas, &attrs)?;
    assert_eq!(wanted, vec![Some(DType::F64), b.map(|_| DType::F64)], "int32 is promoted, float64 kept");
    assert_eq!(entry.op.infer(&metas, &attrs)?, vec![Meta::new(DType::F64, &[a.len()])]);
    let mut out = vec![0f64; a.len()];
    let output = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F64, &[a.len()]);
    entry.op.run_cpu(&[Some(view_f64(a)), b.map(view_f64)], &[output], &attrs)?;
    Ok(out)
}

#[test]
fn every_abi2_feature_works_end_to_end() {
    let _serial = ABI2_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let lib = load(abi2_features()).unwrap();
    assert_eq!(lib.name(), Some("abi2_features"));
    let v2 = opbridge_ops::global().get("combine", None).unwrap();
    assert_eq!(v2.schema().version, 2);
    assert_eq!(v2.schema().signature(), "combine(a, b=None, *, mode=\"sum\", offsets=[1, 2], scale=None, out=None)");
    assert!(v2.op.in_place_ok(), "version 2 is flagged OPB_OP_IN_PLACE_OK");
    assert!(!opbridge_ops::global().get("combine", Some(1)).unwrap().op.in_place_ok());

    let a = [1.0, 5.0, -2.0];
    let b = [4.0, 2.0, -3.0];
    let none: &[(&str, AttrValue)] = &[];
    // Defaults: mode "sum", offsets [1, 2] in turn, no scale.
    assert_eq!(combine(&a, Some(&b), false, none).unwrap(), [6.0, 9.0, -4.0]);
    // A string attribute chooses the behaviour; an unknown one is the library's typed error.
    let max = ("mode", AttrValue::Str("max".into()));
    assert_eq!(combine(&a, Some(&b), false, std::slice::from_ref(&max)).unwrap(), [5.0, 7.0, -1.0]);
    let bad = combine(&a, Some(&b), false, &[("mode", AttrValue::Str("prod".into()))]).unwrap_err();
    assert!(matches!(&bad, OpError::Argument { message, .. } if message.contains("mode must be")), "{bad:?}");
    // A list attribute, empty or not.
    assert_eq!(combine(&a, Some(&b), false, &[("offsets", AttrValue::Ints(vec![]))]).unwrap(), [5.0, 7.0, -5.0]);
    let offsets = ("offsets", AttrValue::Ints(vec![10, 20, 30]));
    assert_eq!(combine(&a, Some(&b), false, &[offsets]).unwrap(), [15.0, 27.0, 25.0]);
    // A DEFAULT_NONE int: None (the default, or passed) or a value.
    let scaled = combine(&a, Some(&b), false, &[("scale", AttrValue::Int(2))]).unwrap();
    assert_eq!(scaled, [12.0, 18.0, -8.0]);
    assert_eq!(combine(&a, Some(&b), false, &[("scale", AttrValue::None)]).unwrap(), [6.0, 9.0, -4.0]);
    // The optional input left out reaches the shape function and the kernel as absent.
    assert_eq!(combine(&a, None, false, none).unwrap(), [2.0, 7.0, -1.0]);
    assert_eq!(combine(&a, None, false, &[max]).unwrap(), [2.0, 7.0, 1.0]);
    // int32 inputs: the library asks for float64 (checked in `combine`) and its kernel refuses
    // anything else, so an int32 view reaching it is an error.
    assert_eq!(combine(&a, Some(&b), true, none).unwrap(), [6.0, 9.0, -4.0]);
    let ints = [1i32, 2, 3];
    let int_view = TensorView::contiguous(ints.as_ptr() as usize, DType::I32, &[3]);
    let attrs = v2.schema().bind_attrs(Vec::<(&str, AttrValue)>::new()).unwrap();
    let mut out = [0f64; 3];
    let out_view = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F64, &[3]);
    let unconverted = v2.op.run_cpu(&[Some(int_view), None], std::slice::from_ref(&out_view), &attrs).unwrap_err();
    assert!(matches!(&unconverted, OpError::DType { got, .. } if got.contains("not float64")), "{unconverted:?}");

    // In place: the output is exactly the first input.
    let mut data = [1.0, 2.0, 3.0];
    let view = TensorView::contiguous(data.as_mut_ptr() as usize, DType::F64, &[3]);
    v2.op.run_cpu(&[Some(view.clone()), None], std::slice::from_ref(&view), &attrs).unwrap();
    assert_eq!(data, [2.0, 4.0, 4.0]);
    assert_eq!(combine_stats()[1], 1.0, "the kernel saw its output over its input");
    combine(&a, None, false, none).unwrap();
    assert_eq!(combine_stats()[1], 0.0);

    // A required input left out is refused before the library is called.
    let missing = v2.op.infer(&[None, Some(Meta::new(DType::F64, &[3]))], &attrs).unwrap_err();
    assert!(matches!(&missing, OpError::Argument { message, .. } if message.contains("\"a\" is required")));
    lib.unload().unwrap();
}

#[test]
fn attribute_values_of_the_wrong_kind_never_reach_the_library() {
    let _serial = ABI2_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let lib = load(abi2_features()).unwrap();
    let a = [1.0, 2.0];
    let calls = combine_stats()[0];
    for (attrs, want) in [
        (vec![("offsets", AttrValue::Str("1, 2".into()))], "expected offsets to be a list of ints, got \"1, 2\""),
        (vec![("offsets", AttrValue::Float(1.0))], "expected offsets to be a list of ints"),
        (vec![("mode", AttrValue::None)], "expected mode to be a string, got None"),
        (vec![("mode", AttrValue::Ints(vec![1]))], "expected mode to be a string"),
        (vec![("scale", AttrValue::Float(2.5))], "expected scale to be an int or None, got 2.5"),
        (vec![("scale", AttrValue::Str("2".into()))], "expected scale to be an int or None"),
    ] {
        let error = combine(&a, None, false, &attrs).unwrap_err();
        assert!(
            matches!(&error, OpError::InvalidAttribute { op, message } if op == "combine" && message.contains(want)),
            "{attrs:?}: {error:?}"
        );
        let entry = opbridge_ops::global().get("combine", None).unwrap();
        let bound = entry.schema().bind_attrs(attrs.iter().map(|(n, v)| (*n, v.clone()))).unwrap();
        let mut out = [0f64; 2];
        let out_view = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F64, &[2]);
        let run = entry.op.run_cpu(&[Some(view_f64(&a)), None], &[out_view], &bound).unwrap_err();
        assert!(matches!(run, OpError::InvalidAttribute { .. }), "{run:?}");
    }
    // A string C cannot hold.
    let nul = combine(&a, None, false, &[("mode", AttrValue::Str("s\0m".into()))]).unwrap_err();
    assert!(matches!(&nul, OpError::InvalidAttribute { message, .. } if message.contains("NUL")), "{nul:?}");
    assert_eq!(combine_stats()[0], calls, "no callback of the library ran");
    lib.unload().unwrap();
}

#[test]
fn a_registry_of_its_own_holds_only_what_was_loaded_into_it() {
    // A host (a server, one registry per model repository) owns its registry: the library's
    // operators go there and nowhere else, and the registry outlives nothing it does not hold.
    let own = Registry::new();
    assert!(own.list().is_empty(), "a new registry has no built-ins until they are registered");
    let lib =
        Library::load_into(Arc::clone(&own), shared_library(&fixture("own_reg", 1, 3, "", None), "own_reg")).unwrap();
    let entry = own.get("own_reg", None).unwrap();
    assert_eq!(call_entry(&entry, &[1.0, 2.0], &[]).unwrap(), vec![4.0, 5.0]);
    assert!(opbridge_ops::global().get("own_reg", None).is_err(), "not in the default registry");
    assert_eq!(Arc::strong_count(&own), 2, "the library holds the registry until it unloads");
    lib.unload().unwrap();
    assert!(own.get("own_reg", None).is_err());
    assert_eq!(Arc::strong_count(&own), 1);
    // Built-ins are an explicit call.
    opbridge_ops::register_builtins(&own).unwrap();
    assert!(own.get("vector_add", Some(1)).is_ok());
    assert!(matches!(opbridge_ops::register_builtins(&own), Err(OpError::DuplicateOperator { .. })));
}

/// Every entry into a library after its unload fails at once, remembered results included: the
/// shape function's and the input-dtype rule's memos answer only while the library is open, and
/// the workspace size is never asked.
#[test]
fn after_an_unload_no_entry_into_the_library_answers() {
    let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/plugins/probe.c");
    let path = scratch_dir().join("libprobe_unload.so");
    compile(&std::fs::read_to_string(probe).unwrap(), &path, &["-shared"]);
    let lib = load(&path).unwrap();
    let entry = opbridge_ops::global().get("probe", None).unwrap();
    let attrs = entry.schema().bind_attrs([("bytes", AttrValue::Int(64))]).unwrap();
    let inputs = [Some(Meta::new(DType::F64, &[3]))];
    // Warm both memos with this signature.
    for _ in 0..2 {
        assert_eq!(entry.op.infer(&inputs, &attrs).unwrap(), vec![Meta::new(DType::F64, &[3])]);
        assert_eq!(entry.op.input_dtypes(&inputs, &attrs).unwrap(), vec![Some(DType::F64)]);
        assert_eq!(entry.op.workspace_size(&inputs, &attrs).unwrap(), 64);
    }
    lib.unload().unwrap();
    let unloaded = |r: Result<(), OpError>, what: &str| match r {
        Err(OpError::Unloaded { name, version: 1, .. }) if name == "probe" => {}
        other => panic!("{what} after the unload: {other:?}"),
    };
    unloaded(entry.op.infer(&inputs, &attrs).map(drop), "infer");
    unloaded(entry.op.input_dtypes(&inputs, &attrs).map(drop), "input_dtypes");
    unloaded(entry.op.workspace_size(&inputs, &attrs).map(drop), "workspace_size");
    unloaded(opbridge_ops::dispatch::plan(&entry, &inputs, &attrs).map(drop), "plan");
}
