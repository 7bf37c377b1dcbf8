//! What `export_plugin!` expands to: descriptors built once from the [`Op`] constants, and
//! `extern "C"` trampolines (one instance per operator type) that turn the C arguments into safe
//! views, call the operator, and turn its result — or a panic — into a status and a message.
//! Not a public API.
#![allow(unsafe_code)] // the C entry points: raw ABI arguments become safe views here

use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use crate::{
    sys, AttrKind, Attrs, DType, DeviceLaunch, DeviceTensor, Error, Inputs, Meta, Op, Result, Status, Tensor, TensorMut,
};

/// One operator's descriptor and the memory its pointers point into.
#[derive(Debug)]
pub struct Described {
    desc: sys::OpbOpDesc,
    _strings: Vec<CString>,
    _input_names: Vec<*const c_char>,
    _input_optional: Vec<i32>,
    _output_names: Vec<*const c_char>,
    _attrs: Vec<sys::OpbAttrDesc>,
    _dtypes: Vec<sys::DLDataType>,
    _device_kernels: Vec<sys::OpbDeviceKernel>,
}

impl Described {
    /// The descriptor (its pointers live as long as `self`).
    pub fn desc(&self) -> &sys::OpbOpDesc {
        &self.desc
    }
}

// SAFETY: a `Described` is immutable once built; its raw pointers point into heap memory it
// owns (strings and vectors that never move or change) or into statics.
unsafe impl Send for Described {}
// SAFETY: as for `Send`.
unsafe impl Sync for Described {}

/// Describes `O`. Panics on a name with a NUL byte or an optional input that `INPUTS` does not
/// name (caught by `init`, which then fails; a host registering `O` in-process reports it).
pub fn describe<O: Op>() -> Described {
    let mut strings = Vec::new();
    let mut c = |s: &str| {
        let owned = CString::new(s).unwrap_or_else(|_| panic!("{:?} of operator {} contains a NUL byte", s, O::NAME));
        let ptr = owned.as_ptr();
        strings.push(owned);
        ptr
    };
    let name = c(O::NAME);
    let doc = c(O::DOC);
    let input_names: Vec<*const c_char> = O::INPUTS.iter().map(|s| c(s)).collect();
    if let Some(unknown) = O::OPTIONAL_INPUTS.iter().find(|o| !O::INPUTS.contains(o)) {
        panic!("optional input {unknown:?} of operator {} is not one of its INPUTS", O::NAME);
    }
    let input_optional: Vec<i32> = O::INPUTS.iter().map(|i| O::OPTIONAL_INPUTS.contains(i) as i32).collect();
    let default_strs: Vec<*const c_char> = O::ATTRS.iter().map(|a| c(a.default_str)).collect();
    let output_names: Vec<*const c_char> = O::OUTPUTS.iter().map(|s| c(s)).collect();
    let attrs: Vec<sys::OpbAttrDesc> = O::ATTRS
        .iter()
        .zip(&default_strs)
        .map(|(a, &default_str)| sys::OpbAttrDesc {
            name: c(a.name),
            kind: match a.kind {
                AttrKind::Int => sys::OPB_ATTR_INT,
                AttrKind::Float => sys::OPB_ATTR_FLOAT,
                AttrKind::Bool => sys::OPB_ATTR_BOOL,
                AttrKind::Str => sys::OPB_ATTR_STR,
                AttrKind::Ints => sys::OPB_ATTR_INTS,
            },
            flags: (if a.required { sys::OPB_ATTR_REQUIRED } else { 0 })
                | (if a.nullable { sys::OPB_ATTR_NULLABLE } else { 0 })
                | (if a.default_none { sys::OPB_ATTR_DEFAULT_NONE } else { 0 }),
            default_int: a.default_int,
            default_float: a.default_float,
            default_str,
            default_ints: a.default_ints.as_ptr(),
            n_default_ints: a.default_ints.len() as i64,
            doc: c(a.doc),
        })
        .collect();
    let dtypes: Vec<sys::DLDataType> = O::DTYPES.iter().map(|d| d.to_dl()).collect();
    let count = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    let device_kernels: Vec<sys::OpbDeviceKernel> = O::DEVICES
        .iter()
        .map(|d| sys::OpbDeviceKernel {
            device_type: d.dlpack_code(),
            flags: 0,
            kernel: Some(device_kernel::<O>),
            reserved: [std::ptr::null_mut(); 2],
        })
        .collect();
    let desc = sys::OpbOpDesc {
        name,
        version: O::VERSION,
        doc,
        n_inputs: count(input_names.len()),
        input_names: input_names.as_ptr(),
        input_optional: input_optional.as_ptr(),
        n_outputs: count(output_names.len()),
        output_names: output_names.as_ptr(),
        n_attrs: count(attrs.len()),
        attrs: attrs.as_ptr(),
        n_dtypes: count(dtypes.len()),
        dtypes: dtypes.as_ptr(),
        flags: if O::IN_PLACE.is_some() { sys::OPB_OP_IN_PLACE_OK } else { 0 },
        infer: Some(infer::<O>),
        input_dtypes: O::INPUT_DTYPES.map(|_| input_dtypes::<O> as sys::OpbInputDtypesFn),
        cpu_kernel: if O::CPU { Some(kernel::<O>) } else { None },
        workspace_size: O::WORKSPACE.map(|_| workspace_size::<O> as sys::OpbWorkspaceFn),
        n_device_kernels: count(device_kernels.len()),
        device_kernels: if device_kernels.is_empty() { std::ptr::null() } else { device_kernels.as_ptr() },
        reserved: [std::ptr::null_mut(); 2],
    };
    Described {
        desc,
        _strings: strings,
        _input_names: input_names,
        _input_optional: input_optional,
        _output_names: output_names,
        _attrs: attrs,
        _dtypes: dtypes,
        _device_kernels: device_kernels,
    }
}

/// A library's descriptors, built on the first `init` and kept for the library's lifetime.
#[derive(Debug)]
pub struct Plugin {
    name: CString,
    descs: Vec<sys::OpbOpDesc>,
    _owned: Vec<Described>,
}

// SAFETY: a `Plugin` is immutable once built; its raw pointers point into heap memory it owns
// (strings and vectors that never move or change), so sharing it between threads is sound.
unsafe impl Send for Plugin {}
// SAFETY: as for `Send`.
unsafe impl Sync for Plugin {}

/// The static an `export_plugin!` expansion keeps its [`Plugin`] in.
#[derive(Debug)]
pub struct PluginCell(OnceLock<std::result::Result<Plugin, CString>>);

impl PluginCell {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> PluginCell {
        PluginCell(OnceLock::new())
    }
}

/// The body of `opbridge_plugin_init`.
///
/// # Safety
/// `host` and `info` are null or valid (the loader passes a host description and a zeroed info).
pub unsafe fn init(
    host: *const sys::OpbPluginHost,
    info: *mut sys::OpbPluginInfo,
    cell: &'static PluginCell,
    name: &str,
    release: Option<sys::OpbReleaseFn>,
    ops: impl FnOnce() -> Vec<Described>,
) -> c_int {
    // SAFETY: the caller's obligations.
    let (Some(host), Some(info)) = (unsafe { host.as_ref() }, unsafe { info.as_mut() }) else {
        return sys::OPB_ERR_FAILED;
    };
    info.abi_version = sys::OPBRIDGE_PLUGIN_ABI_VERSION;
    if host.abi_version != sys::OPBRIDGE_PLUGIN_ABI_VERSION {
        return sys::OPB_ERR_ABI_MISMATCH;
    }
    let plugin = cell.0.get_or_init(|| {
        catch_unwind(AssertUnwindSafe(|| {
            let owned = ops();
            Plugin {
                name: CString::new(name).unwrap_or_default(),
                descs: owned.iter().map(|d| d.desc).collect(),
                _owned: owned,
            }
        }))
        .map_err(|panic| CString::new(panic_message(&*panic).replace('\0', " ")).unwrap_or_default())
    });
    match plugin {
        Ok(plugin) => {
            info.name = plugin.name.as_ptr();
            info.n_ops = i32::try_from(plugin.descs.len()).unwrap_or(i32::MAX);
            info.ops = plugin.descs.as_ptr();
            info.release = release;
            sys::OPB_OK
        }
        Err(message) => {
            info.error = message.as_ptr();
            sys::OPB_ERR_FAILED
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("panicked: {text}")
}

/// Writes `message` into the host's buffer (truncated, NUL-terminated).
///
/// # Safety
/// `buf` is null or writable for `len` bytes.
unsafe fn write_message(buf: *mut c_char, len: usize, message: &str) {
    if buf.is_null() || len == 0 {
        return;
    }
    let mut n = message.len().min(len - 1);
    while !message.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: `n + 1 <= len` bytes of `buf` are writable (the caller's obligation).
    unsafe {
        std::ptr::copy_nonoverlapping(message.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
}

/// Runs a callback body: `Ok` is `OPB_OK`; an error or a panic becomes its status and message.
///
/// # Safety
/// As [`write_message`] for `err_msg`/`err_len`.
unsafe fn guarded(err_msg: *mut c_char, err_len: usize, body: impl FnOnce() -> Result<()>) -> c_int {
    let error = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return sys::OPB_OK,
        Ok(Err(error)) => error,
        Err(panic) => Error::new(Status::Failed, panic_message(&*panic)),
    };
    // SAFETY: the caller's obligations.
    unsafe { write_message(err_msg, err_len, &error.message) };
    error.status.code()
}

/// # Safety
/// `ptr` is null (then `n` is 0) or points at `n` valid `T`s.
unsafe fn slice<'a, T>(ptr: *const T, n: c_int) -> &'a [T] {
    match usize::try_from(n) {
        Ok(n) if n > 0 && !ptr.is_null() => {
            // SAFETY: the caller's obligations.
            unsafe { std::slice::from_raw_parts(ptr, n) }
        }
        _ => &[],
    }
}

/// The host's metas; an absent optional input (`ndim == OPB_ABSENT`) is `None`.
fn metas(inputs: &[sys::OpbMeta]) -> Result<Vec<Option<Meta>>> {
    inputs
        .iter()
        .map(|m| {
            if m.ndim == sys::OPB_ABSENT {
                return Ok(None);
            }
            let dtype = DType::from_dl(m.dtype).ok_or_else(|| Error::dtype("unsupported element type"))?;
            let ndim = usize::try_from(m.ndim).ok().filter(|&n| n <= sys::OPB_MAX_NDIM);
            let ndim = ndim.ok_or_else(|| Error::shape(format!("ndim {} out of range", m.ndim)))?;
            Ok(Some(Meta { dtype, shape: m.shape[..ndim].iter().map(|&d| d.max(0) as usize).collect() }))
        })
        .collect()
}

/// `OpbInferFn` for `O`.
///
/// # Safety
/// Called by the host as the header says: arrays of the given lengths, a valid error buffer.
pub unsafe extern "C" fn infer<O: Op>(
    inputs: *const sys::OpbMeta,
    n_in: c_int,
    outputs: *mut sys::OpbMeta,
    n_out: c_int,
    attrs: *const sys::OpbAttrs,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int {
    let body = || {
        // SAFETY: the host passes `n_in` metas and a valid attribute struct.
        let (inputs, attrs) = unsafe { (slice(inputs, n_in), Attrs::from_c(attrs)) };
        let result = O::infer(&Inputs::new(&metas(inputs)?), &attrs)?;
        let n_out = usize::try_from(n_out).unwrap_or(0);
        if result.len() != n_out || outputs.is_null() {
            return Err(Error::failed(format!(
                "infer returned {} outputs; the operator declares {n_out}",
                result.len()
            )));
        }
        for (i, meta) in result.iter().enumerate() {
            if meta.shape.len() > sys::OPB_MAX_NDIM {
                return Err(Error::shape(format!("output {i} has more than {} dimensions", sys::OPB_MAX_NDIM)));
            }
            let mut c = sys::OpbMeta { dtype: meta.dtype.to_dl(), ndim: meta.shape.len() as i32, ..Default::default() };
            for (d, &s) in c.shape.iter_mut().zip(&meta.shape) {
                *d = i64::try_from(s).map_err(|_| Error::shape("dimension too large"))?;
            }
            // SAFETY: the host passes `n_out` writable metas and `i < n_out`.
            unsafe { outputs.add(i).write(c) };
        }
        Ok(())
    };
    // SAFETY: the host passes a valid error buffer.
    unsafe { guarded(err_msg, err_len, body) }
}

/// `OpbInputDtypesFn` for `O`.
///
/// # Safety
/// As [`infer`], with `dtypes` writable for `n_in` entries.
pub unsafe extern "C" fn input_dtypes<O: Op>(
    inputs: *const sys::OpbMeta,
    n_in: c_int,
    dtypes: *mut sys::DLDataType,
    attrs: *const sys::OpbAttrs,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int {
    let body = || {
        // SAFETY: the host passes `n_in` metas and a valid attribute struct.
        let (inputs, attrs) = unsafe { (slice(inputs, n_in), Attrs::from_c(attrs)) };
        let Some(choose) = O::INPUT_DTYPES else { return Ok(()) };
        let wanted = choose(&Inputs::new(&metas(inputs)?), &attrs)?;
        if wanted.len() != inputs.len() || dtypes.is_null() {
            return Err(Error::failed(format!(
                "INPUT_DTYPES returned {} dtypes for {} inputs",
                wanted.len(),
                inputs.len()
            )));
        }
        for (i, dtype) in wanted.iter().enumerate() {
            if let Some(dtype) = dtype {
                // SAFETY: the host passes `n_in` writable entries and `i < n_in`.
                unsafe { dtypes.add(i).write(dtype.to_dl()) };
            }
        }
        Ok(())
    };
    // SAFETY: the host passes a valid error buffer.
    unsafe { guarded(err_msg, err_len, body) }
}

/// `OpbWorkspaceFn` for `O` (0 on any error or panic: `run` then receives an empty workspace).
///
/// # Safety
/// As [`infer`].
pub unsafe extern "C" fn workspace_size<O: Op>(
    inputs: *const sys::OpbMeta,
    n_in: c_int,
    attrs: *const sys::OpbAttrs,
) -> usize {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the host passes `n_in` metas and a valid attribute struct.
        let (inputs, attrs) = unsafe { (slice(inputs, n_in), Attrs::from_c(attrs)) };
        match (O::WORKSPACE, metas(inputs)) {
            (Some(size), Ok(metas)) => size(&Inputs::new(&metas), &attrs),
            _ => 0,
        }
    }))
    .unwrap_or(0)
}

/// `OpbKernelFn` for `O`.
///
/// # Safety
/// Called by the host as the header says: valid tensors of the inferred metas, outputs disjoint
/// from inputs, `workspace` null or valid for reads and writes of `workspace_size` bytes and used
/// by this call only, a valid error buffer.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kernel<O: Op>(
    inputs: *const sys::DLTensor,
    n_in: c_int,
    outputs: *mut sys::DLTensor,
    n_out: c_int,
    attrs: *const sys::OpbAttrs,
    _stream: *mut c_void,
    workspace: *mut c_void,
    workspace_size: usize,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int {
    let body = || {
        // SAFETY: the host passes `n_in` input and `n_out` output tensors and valid attributes.
        let (c_in, c_out, attrs) = unsafe { (slice(inputs, n_in), slice(outputs, n_out), Attrs::from_c(attrs)) };
        // An absent optional input has `ndim == OPB_ABSENT` (and no data to view).
        let ins = c_in
            .iter()
            .map(|t| {
                if t.ndim == sys::OPB_ABSENT {
                    return Ok(None);
                }
                // SAFETY: inputs are readable and unchanged during the call (the ABI's contract).
                unsafe { Tensor::from_dl(t) }.map(Some)
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: outputs are writable and used by this call only (the ABI's contract).
        let mut outs = c_out.iter().map(|t| unsafe { TensorMut::from_dl(t) }).collect::<Result<Vec<_>>>()?;
        // The bytes the host allocated, whatever `O::WORKSPACE` would say now (it is safe code,
        // so nothing but the host's word may size this slice).
        let ws: &mut [u8] = match (workspace_size, workspace.is_null()) {
            (0, _) => &mut [],
            (_, true) => return Err(Error::failed("the host passed no workspace")),
            // SAFETY: `workspace` is valid for reads and writes of `workspace_size` bytes and
            // used by this call only (the caller's obligations).
            (_, false) => unsafe { std::slice::from_raw_parts_mut(workspace.cast::<u8>(), workspace_size) },
        };
        O::run(&Inputs::new(&ins), &mut outs, &attrs, ws)
    };
    // SAFETY: the host passes a valid error buffer.
    unsafe { guarded(err_msg, err_len, body) }
}

/// The device kernel (`OpbDeviceKernel.kernel`) of every device in `O::DEVICES`: which one runs
/// is the tensors' device.
///
/// # Safety
/// Called by the host as the header says: tensors on the kernel's device with valid extents,
/// the device's native stream, `workspace` null or device memory of `workspace_size` bytes, a
/// valid error buffer.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn device_kernel<O: Op>(
    inputs: *const sys::DLTensor,
    n_in: c_int,
    outputs: *mut sys::DLTensor,
    n_out: c_int,
    attrs: *const sys::OpbAttrs,
    stream: *mut c_void,
    workspace: *mut c_void,
    workspace_size: usize,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int {
    let body = || {
        // SAFETY: the host passes `n_in` input and `n_out` output tensors and valid attributes.
        let (c_in, c_out, attrs) = unsafe { (slice(inputs, n_in), slice(outputs, n_out), Attrs::from_c(attrs)) };
        let ins = c_in
            .iter()
            .map(|t| match t.ndim {
                sys::OPB_ABSENT => Ok(None),
                // SAFETY: a tensor the host passed, with `ndim` extents and strides.
                _ => unsafe { DeviceTensor::from_dl(t) }.map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: as for the inputs.
        let outs = c_out.iter().map(|t| unsafe { DeviceTensor::from_dl(t) }).collect::<Result<Vec<_>>>()?;
        let first = outs.first().ok_or_else(|| Error::failed("the host passed no output"))?;
        if !O::DEVICES.contains(&first.device()) {
            return Err(Error::failed(format!("{} has no kernel on {}", O::NAME, first.device().name())));
        }
        let launch = DeviceLaunch {
            device: first.device(),
            device_id: first.device_id(),
            stream,
            workspace: if workspace_size == 0 { std::ptr::null_mut() } else { workspace },
            workspace_size,
        };
        O::run_device(&Inputs::new(&ins), &outs, &attrs, &launch)
    };
    // SAFETY: the host passes a valid error buffer.
    unsafe { guarded(err_msg, err_len, body) }
}
