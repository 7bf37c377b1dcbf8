//! User kernels: a kernel binary built by the Ascend C toolchain (or, on the test double, in its
//! C dialect), loaded with `aclrtBinaryLoadFromFile` / `aclrtBinaryLoadFromData`, found with
//! `aclrtBinaryGetFunction` and launched on a stream with `aclrtLaunchKernelWithHostArgs` (the
//! seed's `ACLRT_LAUNCH_KERNEL(vector_add_kernel)(blocks, stream, x, y, z)` without generated
//! code). Arguments are checked against the kernel's declared parameters before anything is
//! enqueued, then packed in C struct layout (each parameter aligned to its size), which ACL
//! copies at launch.
#![allow(unsafe_code)]

use std::ffi::{c_void, CString};
use std::path::Path;
use std::sync::{Arc, Mutex};

use opbridge_runtime::{DeviceId, Error, Mark, Result, Stream, StreamId, Tensor};

use crate::device::{ascend, Runtime};
use crate::result::check;
use crate::sys::{RawBinary, RawFunction};

/// One parameter of a kernel, as its C declaration says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A global-memory pointer (`GM_ADDR`): a tensor on the kernel's device.
    Tensor,
    I32,
    U32,
    I64,
    U64,
    F32,
}

impl Param {
    /// `tensor`, `int32`, `uint32`, `int64`, `uint64`, `float32`.
    pub fn parse(name: &str) -> Option<Param> {
        Some(match name {
            "tensor" => Param::Tensor,
            "int32" => Param::I32,
            "uint32" => Param::U32,
            "int64" => Param::I64,
            "uint64" => Param::U64,
            "float32" => Param::F32,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Param::Tensor => "tensor",
            Param::I32 => "int32",
            Param::U32 => "uint32",
            Param::I64 => "int64",
            Param::U64 => "uint64",
            Param::F32 => "float32",
        }
    }

    fn size(self) -> usize {
        match self {
            Param::I32 | Param::U32 | Param::F32 => 4,
            Param::Tensor | Param::I64 | Param::U64 => 8,
        }
    }
}

/// One argument of a launch.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'a> {
    Tensor(&'a Tensor),
    Int(i128),
    Float(f64),
}

/// Arguments that do not fit a kernel's parameters (found before anything is enqueued).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgError {
    pub message: String,
    /// A tensor on another device (else a wrong count, kind or value).
    pub wrong_device: bool,
}

impl std::fmt::Display for ArgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A kernel of a loaded binary, on one device.
#[derive(Debug)]
pub struct AscendKernel {
    runtime: Arc<Runtime>,
    index: usize,
    binary: RawBinary,
    function: RawFunction,
    name: String,
    /// As declared at load; `None`: given by each call's arguments (see [`AscendKernel::pack_as`]).
    params: Option<Vec<Param>>,
    /// The point after the last launch on each stream used: the binary is unloaded only after
    /// them.
    pending: Mutex<Vec<(StreamId, Mark)>>,
}

// SAFETY: binary and function handles are process-wide ACL objects, used only after binding the
// kernel's device on the calling thread.
unsafe impl Send for AscendKernel {}
// SAFETY: as for `Send`; launches serialize on ACL's side, `pending` is behind a mutex.
unsafe impl Sync for AscendKernel {}

impl AscendKernel {
    /// Loads the binary at `path` onto `device` and finds kernel `name` in it.
    pub fn from_file(device: DeviceId, path: &Path, name: &str, params: Option<Vec<Param>>) -> Result<AscendKernel> {
        let (runtime, index) = Self::runtime(device)?;
        let load = runtime.acl.aclrtBinaryLoadFromFile.ok_or_else(|| unsupported(device, "aclrtBinaryLoadFromFile"))?;
        let text = path.to_str().ok_or_else(|| Error::Device {
            device,
            message: format!("kernel binary path {} is not UTF-8", path.display()),
        })?;
        let c_path = CString::new(text)
            .map_err(|_| Error::Device { device, message: "kernel binary path contains a NUL byte".into() })?;
        let mut binary: RawBinary = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, no options (NULL is documented), a valid out-pointer; the
        // device is current on this thread.
        let code = unsafe { load(c_path.as_ptr(), std::ptr::null_mut(), &mut binary) };
        check(&runtime.acl, device, "aclrtBinaryLoadFromFile", code)?;
        Self::find(runtime, index, binary, name, params)
    }

    /// Loads a binary held in memory onto `device` and finds kernel `name` in it.
    pub fn from_binary(device: DeviceId, data: &[u8], name: &str, params: Option<Vec<Param>>) -> Result<AscendKernel> {
        let (runtime, index) = Self::runtime(device)?;
        let load = runtime.acl.aclrtBinaryLoadFromData.ok_or_else(|| unsupported(device, "aclrtBinaryLoadFromData"))?;
        if data.is_empty() {
            return Err(Error::Device { device, message: "an empty kernel binary".into() });
        }
        let mut binary: RawBinary = std::ptr::null_mut();
        // SAFETY: `data` is readable for its length during the call (ACL copies it); no options.
        let code = unsafe { load(data.as_ptr().cast(), data.len(), std::ptr::null(), &mut binary) };
        check(&runtime.acl, device, "aclrtBinaryLoadFromData", code)?;
        Self::find(runtime, index, binary, name, params)
    }

    fn runtime(device: DeviceId) -> Result<(Arc<Runtime>, usize)> {
        if device.kind != opbridge_runtime::DeviceKind::Ascend {
            return Err(Error::Device { device, message: "an Ascend kernel needs an ascend device".into() });
        }
        // Opening the device checks the driver and the index, with the messages every other
        // use of the device gives.
        opbridge_runtime::DeviceContext::get(device)?;
        let runtime = crate::backend().runtime().map_err(|reason| Error::Unavailable { device, reason })?;
        runtime.bind(device.index)?;
        Ok((runtime, device.index))
    }

    /// The kernel `name` of a just loaded binary (unloaded again if it is not there).
    fn find(
        runtime: Arc<Runtime>,
        index: usize,
        binary: RawBinary,
        name: &str,
        params: Option<Vec<Param>>,
    ) -> Result<AscendKernel> {
        let device = ascend(index);
        let unload = |runtime: &Runtime| {
            if let Some(unload) = runtime.acl.aclrtBinaryUnLoad {
                // SAFETY: the binary just loaded, not used by anything.
                unsafe { unload(binary) };
            }
        };
        let get = runtime.acl.aclrtBinaryGetFunction.ok_or_else(|| unsupported(device, "aclrtBinaryGetFunction"));
        let c_name =
            CString::new(name).map_err(|_| Error::Device { device, message: "a kernel name with a NUL byte".into() });
        let (get, c_name) = match (get, c_name) {
            (Ok(get), Ok(c_name)) => (get, c_name),
            (Err(e), _) | (_, Err(e)) => {
                unload(&runtime);
                return Err(e);
            }
        };
        let mut function: RawFunction = std::ptr::null_mut();
        // SAFETY: a live binary, a NUL-terminated name, a valid out-pointer.
        let code = unsafe { get(binary, c_name.as_ptr(), &mut function) };
        if let Err(e) = check(&runtime.acl, device, "aclrtBinaryGetFunction", code) {
            unload(&runtime);
            return Err(e);
        }
        Ok(AscendKernel { runtime, index, binary, function, name: name.into(), params, pending: Mutex::default() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The parameters declared at load, if they were.
    pub fn params(&self) -> Option<&[Param]> {
        self.params.as_deref()
    }

    pub fn device(&self) -> DeviceId {
        ascend(self.index)
    }

    /// Checks `args` against the declared parameters and packs them in C struct layout.
    pub fn pack<'a>(&self, args: &[Arg<'a>]) -> std::result::Result<(Vec<u8>, Vec<&'a Tensor>), ArgError> {
        match &self.params {
            Some(params) => self.pack_as(params, args),
            None => Err(ArgError {
                message: format!(
                    "kernel {} was loaded without params: each call must give its parameters' types",
                    self.name
                ),
                wrong_device: false,
            }),
        }
    }

    /// Packs `args` as `params` (the declared ones, or, for a kernel loaded without, what the
    /// caller's typed arguments say), checking each against its parameter.
    pub fn pack_as<'a>(
        &self,
        params: &[Param],
        args: &[Arg<'a>],
    ) -> std::result::Result<(Vec<u8>, Vec<&'a Tensor>), ArgError> {
        let device = self.device();
        let wrong =
            |message: String| ArgError { message: format!("kernel {}: {message}", self.name), wrong_device: false };
        if args.len() != params.len() {
            return Err(wrong(format!(
                "expected {} arguments ({}), got {}",
                params.len(),
                params.iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
                args.len()
            )));
        }
        let mut packed = Vec::with_capacity(8 * args.len());
        let mut tensors = Vec::new();
        for (k, (param, arg)) in params.iter().zip(args).enumerate() {
            let at = packed.len().next_multiple_of(param.size());
            packed.resize(at, 0);
            let out_of_range = |v: i128| wrong(format!("argument {k} ({}) out of range: {v}", param.name()));
            match (param, arg) {
                (Param::Tensor, Arg::Tensor(t)) => {
                    if t.device() != device {
                        let message = format!("argument {k} is a tensor on {}, not on {device}", t.device());
                        return Err(ArgError { wrong_device: true, ..wrong(message) });
                    }
                    packed.extend_from_slice(&(t.data_ptr().0 as u64).to_ne_bytes());
                    tensors.push(*t);
                }
                (Param::I32, Arg::Int(v)) => {
                    packed.extend_from_slice(&i32::try_from(*v).map_err(|_| out_of_range(*v))?.to_ne_bytes())
                }
                (Param::U32, Arg::Int(v)) => {
                    packed.extend_from_slice(&u32::try_from(*v).map_err(|_| out_of_range(*v))?.to_ne_bytes())
                }
                (Param::I64, Arg::Int(v)) => {
                    packed.extend_from_slice(&i64::try_from(*v).map_err(|_| out_of_range(*v))?.to_ne_bytes())
                }
                (Param::U64, Arg::Int(v)) => {
                    packed.extend_from_slice(&u64::try_from(*v).map_err(|_| out_of_range(*v))?.to_ne_bytes())
                }
                (Param::F32, Arg::Float(v)) => packed.extend_from_slice(&(*v as f32).to_ne_bytes()),
                (Param::F32, Arg::Int(v)) => packed.extend_from_slice(&(*v as f32).to_ne_bytes()),
                (param, arg) => {
                    let got = match arg {
                        Arg::Tensor(_) => "a tensor",
                        Arg::Int(_) => "an int",
                        Arg::Float(_) => "a float",
                    };
                    return Err(wrong(format!("argument {k} must be {}, got {got}", param.name())));
                }
            }
        }
        Ok((packed, tensors))
    }

    /// Enqueues the kernel on `stream` over `blocks` blocks and returns. Tensor arguments are
    /// ordered like an operator's outputs (the kernel may write any of them): after earlier
    /// work on them on other streams, and before later work.
    pub fn launch(&self, blocks: u32, args: &[Arg<'_>], stream: &Stream) -> Result<()> {
        let (packed, tensors) =
            self.pack(args).map_err(|e| Error::Device { device: self.device(), message: e.message })?;
        self.launch_packed(blocks, packed, &tensors, stream)
    }

    /// [`AscendKernel::launch`] with arguments already [`AscendKernel::pack`]ed.
    pub fn launch_packed(&self, blocks: u32, mut packed: Vec<u8>, tensors: &[&Tensor], stream: &Stream) -> Result<()> {
        let device = self.device();
        if stream.device() != device {
            return Err(Error::Device {
                device,
                message: format!("kernel {} is loaded on {device}, the stream is on {}", self.name, stream.device()),
            });
        }
        if blocks == 0 {
            return Err(Error::Device {
                device,
                message: format!("kernel {}: block_dim must be at least 1", self.name),
            });
        }
        let launch = self
            .runtime
            .acl
            .aclrtLaunchKernelWithHostArgs
            .ok_or_else(|| unsupported(device, "aclrtLaunchKernelWithHostArgs"))?;
        let done = Tensor::enqueue_event(stream, &[], tensors, |stream| {
            self.runtime.bind(self.index)?;
            // SAFETY: a live function of a binary loaded on this device (current on this
            // thread), the stream's native handle, host arguments ACL copies during the call;
            // no configuration and no placeholders (both documented as optional).
            let code = unsafe {
                launch(
                    self.function,
                    blocks,
                    stream.native_handle(),
                    std::ptr::null_mut(),
                    packed.as_mut_ptr().cast::<c_void>(),
                    packed.len(),
                    std::ptr::null_mut(),
                    0,
                )
            };
            check(&self.runtime.acl, device, "aclrtLaunchKernelWithHostArgs", code)
        })?;
        // One mark per stream is enough: a stream's launches complete in order.
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|(id, _)| *id != stream.id());
        pending.push((stream.id(), done));
        Ok(())
    }
}

impl Drop for AscendKernel {
    fn drop(&mut self) {
        if self.runtime.is_finalized() || self.runtime.forked() {
            return;
        }
        // Launches still queued use the binary: it goes only after them.
        for (_, mark) in self.pending.get_mut().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = mark.synchronize();
        }
        if let (Some(unload), Ok(())) = (self.runtime.acl.aclrtBinaryUnLoad, self.runtime.bind(self.index)) {
            // SAFETY: our binary, with no launch left to run; unloaded once.
            unsafe { unload(self.binary) };
        }
    }
}

fn unsupported(device: DeviceId, api: &str) -> Error {
    Error::Unavailable {
        device,
        reason: format!("this CANN installation's ACL runtime lacks {api} (CANN 8.2 or later)"),
    }
}
