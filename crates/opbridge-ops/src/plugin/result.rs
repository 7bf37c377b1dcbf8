//! The thin layer over `sys`: status codes and error buffers become [`OpError`]s, and raw operator
//! descriptors become validated, owned [`OpSpec`]s (or a message saying what is wrong).

use std::collections::HashSet;
use std::ffi::{c_char, c_int, CString};

use opbridge_dtype::DType;

use super::sys;
use crate::error::OpError;
use crate::schema::{AttrSpec, AttrValue, InputSpec, Meta, Schema};

/// Bytes of the message buffer every callback receives.
pub const ERR_LEN: usize = 1024;

/// Longest docstring read from a descriptor.
const MAX_DOC: usize = 64 * 1024;

/// The message a callback left in its buffer (up to the first NUL), or a stand-in.
pub fn message(buf: &[u8; ERR_LEN], status: c_int) -> String {
    let len = buf.iter().position(|&b| b == 0).unwrap_or(ERR_LEN);
    let text = String::from_utf8_lossy(&buf[..len]).trim().to_string();
    if text.is_empty() {
        format!("failed with status {status} and no message")
    } else {
        text
    }
}

/// A callback's status as a result: `OpbStatus` codes map to the error kinds of built-in ops.
pub fn check(op: &str, status: c_int, buf: &[u8; ERR_LEN]) -> Result<(), OpError> {
    if status == sys::OPB_OK {
        return Ok(());
    }
    Err(status_error(op, status, message(buf, status)))
}

/// The error a status and message stand for (the message may start with the op's name, which
/// the error's text adds already). A message of the form "expected X, got Y" keeps its parts.
pub fn status_error(op: &str, status: c_int, full: String) -> OpError {
    let message =
        full.strip_prefix(op).and_then(|m| m.strip_prefix(':')).map_or(full.clone(), |m| m.trim().to_string());
    let parts = |fallback: &str| match message.strip_prefix("expected ").and_then(|m| m.rsplit_once(", got ")) {
        Some((expected, got)) => (expected.to_string(), got.to_string()),
        None => (fallback.to_string(), message.clone()),
    };
    match status {
        sys::OPB_ERR_INVALID_ARGUMENT => OpError::Argument { op: op.into(), message },
        sys::OPB_ERR_SHAPE => {
            let (expected, got) = parts("shapes the operator accepts");
            OpError::Shape { op: op.into(), expected, got }
        }
        sys::OPB_ERR_DTYPE => {
            let (expected, got) = parts("dtypes the operator accepts");
            OpError::DType { op: op.into(), expected, got }
        }
        _ => OpError::Kernel { op: op.into(), message },
    }
}

/// One validated operator descriptor, copied out of the library (only the callbacks still point
/// into it).
#[derive(Debug)]
pub struct OpSpec {
    pub schema: Schema,
    /// `OpbAttrKind` of each attribute, in schema order.
    pub attr_kinds: Vec<i32>,
    /// Whether each attribute accepts `None` (`OPB_ATTR_NULLABLE`), in schema order.
    pub attr_nullable: Vec<bool>,
    /// Attribute names as C strings, in schema order (what `OpbAttrs.names` points at).
    pub attr_names: Vec<CString>,
    pub infer: sys::OpbInferFn,
    /// The CPU kernel (`None`: a device-only operator of ABI 3).
    pub kernel: Option<sys::OpbKernelFn>,
    /// Kernels on accelerators (ABI 3), one per kind.
    pub device_kernels: Vec<(opbridge_runtime::DeviceKind, sys::OpbKernelFn)>,
    pub workspace: Option<sys::OpbWorkspaceFn>,
    pub input_dtypes: Option<sys::OpbInputDtypesFn>,
    /// `OPB_OP_IN_PLACE_OK`: an output may be exactly an input.
    pub in_place_ok: bool,
}

impl OpSpec {
    /// Checks a call's attribute values against the declared kinds: what the C side may rely
    /// on before it reads `OpbAttrValue` (and what an in-process operator may rely on too).
    pub fn check_attrs(&self, attrs: &crate::schema::Attrs) -> Result<(), OpError> {
        for (i, spec) in self.schema.attrs.iter().enumerate() {
            self.check_attr(i, attrs.get(&spec.name).unwrap_or(&AttrValue::None))?;
        }
        Ok(())
    }

    /// [`OpSpec::check_attrs`] for attribute `i`'s value (for callers that visit each value
    /// anyway, like the plugin call's conversion to C).
    pub fn check_attr(&self, i: usize, value: &AttrValue) -> Result<(), OpError> {
        let (kind, nullable) = (self.attr_kinds[i], self.attr_nullable[i]);
        let fits = match value {
            AttrValue::None => nullable,
            AttrValue::Int(_) => matches!(kind, sys::OPB_ATTR_INT | sys::OPB_ATTR_FLOAT),
            AttrValue::Bool(_) => matches!(kind, sys::OPB_ATTR_BOOL | sys::OPB_ATTR_INT),
            AttrValue::Float(_) => kind == sys::OPB_ATTR_FLOAT,
            AttrValue::Str(_) => kind == sys::OPB_ATTR_STR,
            AttrValue::Ints(_) => kind == sys::OPB_ATTR_INTS,
        };
        if fits {
            return Ok(());
        }
        let or_none = if nullable { " or None" } else { "" };
        Err(OpError::InvalidAttribute {
            op: self.schema.name.clone(),
            message: format!("expected {} to be {}{or_none}, got {value}", self.schema.attrs[i].name, kind_name(kind)),
        })
    }
}

impl OpSpec {
    /// Checks an input-dtype rule's choice: the kernel only ever sees the operator's declared
    /// dtypes (plugin.h's promise to kernels), and a present input keeps a dtype.
    pub fn check_chosen_dtypes(&self, inputs: &[Option<Meta>], chosen: &[Option<DType>]) -> Result<(), OpError> {
        let schema = &self.schema;
        for ((input, dtype), spec) in inputs.iter().zip(chosen).zip(&schema.inputs) {
            let fits = match (input, dtype) {
                (None, _) => true,
                (Some(_), Some(dtype)) => schema.dtypes.contains(dtype),
                (Some(_), None) => false,
            };
            if !fits {
                let names: Vec<&str> = schema.dtypes.iter().map(|d| d.name()).collect();
                return Err(OpError::Kernel {
                    op: schema.name.clone().into(),
                    message: format!(
                        "the input-dtype rule chose {} for input {:?}; the operator declares {}",
                        dtype.map_or("nothing", DType::name),
                        spec.name,
                        names.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }
}

/// "an int", "a float"... for an `OpbAttrKind`.
pub fn kind_name(kind: i32) -> &'static str {
    match kind {
        sys::OPB_ATTR_INT => "an int",
        sys::OPB_ATTR_FLOAT => "a float",
        sys::OPB_ATTR_BOOL => "a bool",
        sys::OPB_ATTR_STR => "a string",
        _ => "a list of ints",
    }
}

/// Reads a NUL-terminated string of at most `max` bytes without reading past its terminator.
///
/// # Safety
/// `ptr` is null or points at readable bytes up to a NUL or `max + 1` bytes, whichever is first.
unsafe fn read_c_str(ptr: *const c_char, max: usize, what: &str) -> Result<Option<String>, String> {
    if ptr.is_null() {
        return Ok(None);
    }
    let mut len = 0;
    // SAFETY: the caller guarantees the bytes up to the terminator (or `max + 1`) are readable;
    // we stop at the first NUL or after `max + 1` bytes.
    while unsafe { *ptr.add(len) } != 0 {
        len += 1;
        if len > max {
            return Err(format!("{what} is longer than {max} bytes (or not NUL-terminated)"));
        }
    }
    // SAFETY: `len` bytes were just read, all non-NUL.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    std::str::from_utf8(bytes).map(|s| Some(s.to_string())).map_err(|_| format!("{what} is not UTF-8"))
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A required identifier (operator, input, output or attribute name).
///
/// # Safety
/// As [`read_c_str`].
unsafe fn read_name(ptr: *const c_char, what: &str) -> Result<String, String> {
    // SAFETY: forwarded to the caller.
    let name = unsafe { read_c_str(ptr, sys::OPB_MAX_NAME, what) }?.ok_or_else(|| format!("{what} is NULL"))?;
    if !is_identifier(&name) {
        return Err(format!("{what} {name:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)"));
    }
    Ok(name)
}

/// A count in `0..=max` (or `1..=max` where `min` is 1).
fn count(n: i32, min: i32, max: i32, what: &str) -> Result<usize, String> {
    if n < min || n > max {
        return Err(format!("{what} is {n}; expected {min} to {max}"));
    }
    Ok(n as usize)
}

/// A descriptor array of `n` elements: `ptr` may be null only when `n` is 0.
///
/// # Safety
/// A non-null `ptr` points at `n` valid `T`s.
unsafe fn array<'a, T>(ptr: *const T, n: usize, what: &str) -> Result<&'a [T], String> {
    match (ptr.is_null(), n) {
        (_, 0) => Ok(&[]),
        (true, _) => Err(format!("{what} is NULL but {n} are declared")),
        // SAFETY: forwarded to the caller.
        (false, _) => Ok(unsafe { std::slice::from_raw_parts(ptr, n) }),
    }
}

/// Names from an optional array of `n` C strings, or `default(i)` when the array is NULL.
///
/// # Safety
/// A non-null `ptr` points at `n` pointers, each valid for [`read_c_str`].
unsafe fn names(
    ptr: *const *const c_char,
    n: usize,
    what: &str,
    default: impl Fn(usize) -> String,
) -> Result<Vec<String>, String> {
    if ptr.is_null() {
        return Ok((0..n).map(default).collect());
    }
    // SAFETY: forwarded to the caller.
    let ptrs = unsafe { array(ptr, n, what) }?;
    let mut out = Vec::with_capacity(n);
    for (i, &p) in ptrs.iter().enumerate() {
        // SAFETY: forwarded to the caller.
        out.push(unsafe { read_name(p, &format!("{what}[{i}]")) }?);
    }
    Ok(out)
}

/// Validates one descriptor and copies what it declares. The error says what is wrong, without
/// the library's path (the caller adds it).
///
/// # Safety
/// Every non-null pointer in `desc` points at what the header says it does (strings may be
/// unterminated: reads stop at the documented limits). Counts are checked before arrays are read.
pub unsafe fn validate(desc: &sys::OpbOpDesc, abi: u32) -> Result<OpSpec, String> {
    // SAFETY: the caller vouches for the pointers; counts were checked above.
    let name = unsafe { read_name(desc.name, "operator name") }?;
    let fail = |message: String| format!("operator {name:?}: {message}");
    if desc.version == 0 {
        return Err(fail("version is 0; versions start at 1".into()));
    }
    // SAFETY: the caller vouches for the pointers; counts were checked above.
    let doc = unsafe { read_c_str(desc.doc, MAX_DOC, "doc") }.map_err(fail)?.unwrap_or_default();
    let n_in = count(desc.n_inputs, 0, sys::OPB_MAX_INPUTS, "n_inputs").map_err(fail)?;
    let n_out = count(desc.n_outputs, 1, sys::OPB_MAX_OUTPUTS, "n_outputs").map_err(fail)?;
    let n_attrs = count(desc.n_attrs, 0, sys::OPB_MAX_ATTRS, "n_attrs").map_err(fail)?;
    let n_dtypes = count(desc.n_dtypes, 1, 64, "n_dtypes").map_err(fail)?;
    // SAFETY: the caller vouches for the pointers; counts were checked above.
    let inputs = unsafe { names(desc.input_names, n_in, "input_names", |i| format!("x{i}")) }.map_err(fail)?;
    // SAFETY: the caller vouches for the pointers; counts were checked above.
    let outputs = unsafe {
        names(desc.output_names, n_out, "output_names", |i| if i == 0 { "out".into() } else { format!("out{i}") })
    }
    .map_err(fail)?;

    let mut dtypes = Vec::new();
    // SAFETY: the caller vouches for the pointers; counts were checked above.
    for (i, &t) in unsafe { array(desc.dtypes, n_dtypes, "dtypes") }.map_err(fail)?.iter().enumerate() {
        let dtype = DType::from_dl(t).ok_or_else(|| {
            fail(format!(
                "dtypes[{i}] (code {}, bits {}, lanes {}) is not one of float16, float32, float64, int32, int64",
                t.code, t.bits, t.lanes
            ))
        })?;
        if !dtypes.contains(&dtype) {
            dtypes.push(dtype);
        }
    }

    let mut attrs = Vec::with_capacity(n_attrs);
    let mut attr_kinds = Vec::with_capacity(n_attrs);
    let mut attr_nullable = Vec::with_capacity(n_attrs);
    let known_flags = sys::OPB_ATTR_REQUIRED | sys::OPB_ATTR_NULLABLE | sys::OPB_ATTR_DEFAULT_NONE;
    // SAFETY: the caller vouches for the pointers; counts were checked above.
    for (i, a) in unsafe { array(desc.attrs, n_attrs, "attrs") }.map_err(fail)?.iter().enumerate() {
        // SAFETY: the caller vouches for the pointers; counts were checked above.
        let attr_name = unsafe { read_name(a.name, &format!("attrs[{i}].name")) }.map_err(fail)?;
        let bad = |message: String| fail(format!("attribute {attr_name:?}: {message}"));
        if a.flags & !known_flags != 0 {
            return Err(bad(format!("unknown flags {:#x}", a.flags & !known_flags)));
        }
        let required = a.flags & sys::OPB_ATTR_REQUIRED != 0;
        let default_none = a.flags & sys::OPB_ATTR_DEFAULT_NONE != 0;
        if required && default_none {
            return Err(bad("OPB_ATTR_REQUIRED and OPB_ATTR_DEFAULT_NONE contradict each other".into()));
        }
        if !(sys::OPB_ATTR_INT..=sys::OPB_ATTR_INTS).contains(&a.kind) {
            return Err(bad(format!("kind {}; expected 0 (int), 1 (float), 2 (bool), 3 (str) or 4 (ints)", a.kind)));
        }
        // The default fields are read only when there is a default (plugin.h: ignored otherwise).
        let default = match a.kind {
            _ if required || default_none => AttrValue::None,
            sys::OPB_ATTR_INT => AttrValue::Int(a.default_int),
            sys::OPB_ATTR_FLOAT => AttrValue::Float(a.default_float),
            sys::OPB_ATTR_BOOL => AttrValue::Bool(a.default_int != 0),
            sys::OPB_ATTR_STR => {
                // SAFETY: the caller vouches for the pointers.
                let text = unsafe { read_c_str(a.default_str, MAX_DOC, "default_str") }.map_err(&bad)?;
                AttrValue::Str(text.unwrap_or_default())
            }
            sys::OPB_ATTR_INTS => {
                let n = usize::try_from(a.n_default_ints).ok().filter(|&n| n as i64 <= sys::OPB_MAX_INTS).ok_or_else(
                    || bad(format!("n_default_ints is {}; expected 0 to {}", a.n_default_ints, sys::OPB_MAX_INTS)),
                )?;
                // SAFETY: the caller vouches for the pointers; the count was checked above.
                AttrValue::Ints(unsafe { array(a.default_ints, n, "default_ints") }.map_err(&bad)?.to_vec())
            }
            _ => unreachable!("kinds were checked above"),
        };
        // SAFETY: the caller vouches for the pointers; counts were checked above.
        let doc = unsafe { read_c_str(a.doc, MAX_DOC, "attribute doc") }.map_err(fail)?.unwrap_or_default();
        attrs.push(AttrSpec {
            name: attr_name,
            default: (!required).then_some(default),
            doc,
            takes_float: a.kind == sys::OPB_ATTR_FLOAT,
        });
        attr_kinds.push(a.kind);
        attr_nullable.push(default_none || a.flags & sys::OPB_ATTR_NULLABLE != 0);
    }
    let optional: Vec<bool> = match n_in {
        0 => Vec::new(),
        // SAFETY: the caller vouches for the pointers; counts were checked above.
        _ if !desc.input_optional.is_null() => unsafe { array(desc.input_optional, n_in, "input_optional") }
            .map_err(fail)?
            .iter()
            .map(|&flag| flag != 0)
            .collect(),
        _ => vec![false; n_in],
    };
    if desc.flags & !sys::OPB_OP_IN_PLACE_OK != 0 {
        return Err(fail(format!("unknown operator flags {:#x}", desc.flags & !sys::OPB_OP_IN_PLACE_OK)));
    }

    let mut seen = HashSet::new();
    for n in inputs.iter().chain(&outputs).chain(attrs.iter().map(|a| &a.name)) {
        if !seen.insert(n.as_str()) {
            return Err(fail(format!("the name {n:?} is used twice among inputs, outputs and attributes")));
        }
    }
    if inputs.iter().chain(attrs.iter().map(|a| &a.name)).any(|n| n == "out") {
        return Err(fail("an input or attribute may not be called \"out\" (the output keyword)".into()));
    }

    let infer = desc.infer.ok_or_else(|| fail("no shape function (infer is NULL)".into()))?;
    if desc.reserved.iter().any(|p| !p.is_null()) {
        return Err(fail(format!("reserved fields must be NULL in ABI version {abi}")));
    }
    let device_kernels = if abi < 3 {
        // ABI 2's `reserved[4]` is where ABI 3 has `n_device_kernels` (and its padding),
        // `device_kernels` and `reserved[2]`: all NULL in a valid version 2 descriptor, so every
        // byte of it is zero, the padding's included.
        const TAIL: usize = std::mem::offset_of!(sys::OpbOpDesc, n_device_kernels);
        const _: () = assert!(std::mem::size_of::<sys::OpbOpDesc>() - TAIL == 32);
        // SAFETY: `desc` points at a whole descriptor in the library's memory (the caller's
        // word), whose last 32 bytes the library wrote as ABI 2's `reserved` pointers; read as
        // plain bytes.
        let tail: [u8; 32] =
            unsafe { std::ptr::read_unaligned(std::ptr::from_ref(desc).cast::<u8>().add(TAIL).cast()) };
        if tail.iter().any(|&b| b != 0) {
            return Err(fail("reserved fields must be NULL in ABI version 2".into()));
        }
        Vec::new()
    } else {
        // SAFETY: the caller vouches for the pointers; the count is checked first.
        unsafe { device_kernels(desc) }.map_err(fail)?
    };
    let kernel = desc.cpu_kernel;
    if kernel.is_none() && device_kernels.is_empty() {
        return Err(fail(match abi {
            2 => "no CPU kernel (cpu_kernel is NULL)".into(),
            _ => "no kernel: cpu_kernel is NULL and there are no device_kernels".into(),
        }));
    }
    let attr_names = attrs.iter().map(|a| CString::new(a.name.as_str()).expect("identifiers have no NUL")).collect();
    Ok(OpSpec {
        schema: Schema {
            name,
            version: desc.version,
            doc: doc.trim().to_string(),
            inputs: inputs
                .into_iter()
                .zip(optional)
                .map(|(name, optional)| InputSpec { name, optional, dtypes: Vec::new() })
                .collect(),
            outputs,
            attrs,
            dtypes,
            shared: Default::default(),
        },
        attr_kinds,
        attr_nullable,
        attr_names,
        infer,
        kernel,
        device_kernels,
        workspace: desc.workspace_size,
        input_dtypes: desc.input_dtypes,
        in_place_ok: desc.flags & sys::OPB_OP_IN_PLACE_OK != 0,
    })
}

/// An ABI 3 descriptor's device kernels: known device types (Ascend; CUDA's slot is kept), each
/// once, with a kernel, no flags and NULL reserved fields.
///
/// # Safety
/// As [`validate`].
unsafe fn device_kernels(
    desc: &sys::OpbOpDesc,
) -> Result<Vec<(opbridge_runtime::DeviceKind, sys::OpbKernelFn)>, String> {
    use opbridge_runtime::DeviceKind;
    let n = count(desc.n_device_kernels, 0, sys::OPB_MAX_DEVICE_KERNELS, "n_device_kernels")?;
    if n == 0 && !desc.device_kernels.is_null() {
        return Err("device_kernels is not NULL but n_device_kernels is 0".into());
    }
    // SAFETY: forwarded to the caller; the count is checked.
    let slots = unsafe { array(desc.device_kernels, n, "device_kernels") }?;
    let mut kernels: Vec<(DeviceKind, sys::OpbKernelFn)> = Vec::with_capacity(n);
    for (i, slot) in slots.iter().enumerate() {
        // Ascend only: CUDA's slot (kDLCUDA) is taken once a CUDA device defines what its
        // kernels receive; a kernel that could never run is refused, not listed.
        let kind = [DeviceKind::Ascend].into_iter().find(|k| k.dlpack_code() == slot.device_type).ok_or_else(|| {
            format!(
                "device_kernels[{i}]: device type {} is not one opbridge has kernels for (OPB_DEVICE_ASCEND, {}, \
                 is the one it runs today)",
                slot.device_type,
                DeviceKind::Ascend.dlpack_code()
            )
        })?;
        if slot.flags != 0 || slot.reserved.iter().any(|p| !p.is_null()) {
            return Err(format!("device_kernels[{i}]: flags and reserved fields must be 0 / NULL"));
        }
        let kernel = slot.kernel.ok_or_else(|| format!("device_kernels[{i}]: kernel is NULL"))?;
        if kernels.iter().any(|(k, _)| *k == kind) {
            return Err(format!("device_kernels[{i}]: a second {} kernel", kind.name()));
        }
        kernels.push((kind, kernel));
    }
    Ok(kernels)
}

/// The library's optional name from `OpbPluginInfo`.
///
/// # Safety
/// As [`read_c_str`].
pub unsafe fn library_name(ptr: *const c_char) -> Option<String> {
    // SAFETY: forwarded to the caller.
    unsafe { read_c_str(ptr, sys::OPB_MAX_NAME, "name") }.ok().flatten()
}

/// The message of a failed init (`OpbPluginInfo.error`), if any.
///
/// # Safety
/// As [`read_c_str`].
pub unsafe fn init_error(ptr: *const c_char) -> Option<String> {
    // SAFETY: forwarded to the caller.
    unsafe { read_c_str(ptr, 4096, "error") }.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_error_kinds() {
        let mut buf = [0u8; ERR_LEN];
        buf[..5].copy_from_slice(b"boom\0");
        assert!(check("op", 0, &buf).is_ok());
        assert!(matches!(check("op", 1, &buf), Err(OpError::Argument { .. })));
        assert!(matches!(check("op", 2, &buf), Err(OpError::Shape { .. })));
        assert!(matches!(check("op", 3, &buf), Err(OpError::DType { .. })));
        assert!(matches!(check("op", 5, &buf), Err(OpError::Kernel { ref message, .. }) if message == "boom"));
        buf[..9].copy_from_slice(b"op: boom\0");
        assert_eq!(check("op", 1, &buf).unwrap_err().to_string(), "op: boom");
        assert!(matches!(check("op", -7, &buf), Err(OpError::Kernel { .. })));
        let empty = [0u8; ERR_LEN];
        assert!(check("op", 9, &empty).unwrap_err().to_string().contains("status 9"));
    }

    #[test]
    fn dtypes_round_trip() {
        for dtype in DType::ALL {
            assert_eq!(DType::from_dl(dtype.to_dl()), Some(dtype));
        }
        assert_eq!(DType::from_dl(sys::DLDataType { code: sys::kDLUInt, bits: 8, lanes: 1 }), None);
        assert_eq!(DType::from_dl(sys::DLDataType { code: sys::kDLFloat, bits: 32, lanes: 4 }), None);
    }
}
