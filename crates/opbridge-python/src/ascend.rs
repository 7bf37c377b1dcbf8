//! `opbridge.ascend.Kernel`: a kernel of an Ascend kernel binary, launched from Python on a
//! stream (`opbridge_ascend::kernel`). Arguments are checked against the declared parameters
//! before anything is enqueued: a wrong count or kind is an `ArgumentError`, a tensor on another
//! device a `DeviceError`.

use std::path::PathBuf;
use std::sync::Arc;

use opbridge_ascend::kernel::{Arg, AscendKernel, Param};
use opbridge_runtime::{DeviceContext, Launch, Stream};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::convert::{parse_device, python_call_site};
use crate::errors::{argument_error, device_error, to_pyerr};
use crate::stream::PyStream;
use crate::tensor::PyTensor;

/// A kernel of a loaded kernel binary, on one Ascend device.
#[pyclass(name = "Kernel", module = "opbridge.ascend", frozen)]
#[derive(Debug)]
pub struct PyKernel {
    inner: Arc<AscendKernel>,
    /// `kernel NAME`, how its launches are named in asynchronous errors.
    label: Arc<str>,
}

impl PyKernel {
    fn new(kernel: AscendKernel) -> PyKernel {
        let label = format!("kernel {}", kernel.name()).into();
        PyKernel { inner: Arc::new(kernel), label }
    }
}

fn parse_params(params: Option<Vec<String>>) -> PyResult<Option<Vec<Param>>> {
    let Some(params) = params else { return Ok(None) };
    params
        .iter()
        .map(|p| {
            Param::parse(p).ok_or_else(|| {
                argument_error(format!(
                    "unknown kernel parameter kind {p:?}: expected tensor, int32, uint32, int64, uint64 or float32"
                ))
            })
        })
        .collect::<PyResult<Vec<Param>>>()
        .map(Some)
}

/// The parameter type a numpy scalar argument (`np.uint32(n)`) names, for a kernel loaded
/// without `params`.
fn scalar_param(kernel: &str, k: usize, arg: &Bound<'_, PyAny>) -> PyResult<Param> {
    if crate::ffi::numpy::as_ndarray(arg).is_some() {
        return Err(argument_error(format!(
            "kernel {kernel}: argument {k} is a numpy array (host memory): pass a Tensor on the kernel's device \
             (ob.asarray(a, device=...)), or a numpy scalar (numpy.uint32(n)) for a scalar parameter"
        )));
    }
    let typed = {
        arg.getattr(pyo3::intern!(arg.py(), "dtype"))
            .and_then(|d| d.getattr(pyo3::intern!(arg.py(), "name")))
            .and_then(|n| n.extract::<String>())
            .ok()
    };
    match typed {
        Some(name) => Param::parse(&name).filter(|p| *p != Param::Tensor).ok_or_else(|| {
            argument_error(format!(
                "kernel {kernel}: argument {k} is a numpy {name}; kernel parameters are int32, uint32, int64, uint64 or float32"
            ))
        }),
        None => Err(argument_error(format!(
            "kernel {kernel} was loaded without params, so argument {k} must say its C type: pass a numpy scalar \
             (numpy.uint32(n), numpy.float32(x), ...) or declare params=[...] when loading"
        ))),
    }
}

#[pymethods]
impl PyKernel {
    /// Loads the kernel binary at `path` onto `device` and finds kernel `name` in it. `params`
    /// names the kernel's parameters in order (a kernel binary does not carry them): "tensor"
    /// for a global-memory pointer, "int32", "uint32", "int64", "uint64", "float32". Without
    /// them, each call's arguments give the types: Tensors, and numpy scalars for the rest.
    #[staticmethod]
    #[pyo3(signature = (path, name, params = None, device = "ascend:0"))]
    fn from_file(
        py: Python<'_>,
        path: PathBuf,
        name: &str,
        params: Option<Vec<String>>,
        device: &str,
    ) -> PyResult<PyKernel> {
        let (device, params) = (parse_device(Some(device))?, parse_params(params)?);
        let kernel = py.detach(|| AscendKernel::from_file(device, &path, name, params)).map_err(to_pyerr)?;
        Ok(PyKernel::new(kernel))
    }

    /// Like `from_file`, from the binary's bytes.
    #[staticmethod]
    #[pyo3(signature = (data, name, params = None, device = "ascend:0"))]
    fn from_binary(
        py: Python<'_>,
        data: &Bound<'_, PyBytes>,
        name: &str,
        params: Option<Vec<String>>,
        device: &str,
    ) -> PyResult<PyKernel> {
        let (device, params) = (parse_device(Some(device))?, parse_params(params)?);
        let bytes = data.as_bytes().to_vec();
        let kernel = py.detach(|| AscendKernel::from_binary(device, &bytes, name, params)).map_err(to_pyerr)?;
        Ok(PyKernel::new(kernel))
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// The declared parameters, or None for a kernel loaded without.
    #[getter]
    fn params(&self) -> Option<Vec<&'static str>> {
        self.inner.params().map(|params| params.iter().map(|p| p.name()).collect())
    }

    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    /// Enqueues the kernel over `block_dim` blocks on `stream` (default: this thread's current
    /// stream of the kernel's device) and returns at once. Tensors are passed as device
    /// pointers; the kernel may write any of them, so later work on them waits for it.
    #[pyo3(signature = (block_dim, *args, stream = None))]
    fn __call__(
        &self,
        py: Python<'_>,
        block_dim: i64,
        args: &Bound<'_, PyTuple>,
        stream: Option<&Bound<'_, PyStream>>,
    ) -> PyResult<()> {
        let blocks = u32::try_from(block_dim).ok().filter(|&b| b > 0).ok_or_else(|| {
            argument_error(format!(
                "kernel {}: block_dim must be in 1..=4294967295, got {block_dim}",
                self.inner.name()
            ))
        })?;
        let declared = self.inner.params().is_some();
        let mut inferred: Vec<Param> = Vec::new();
        let mut tensors: Vec<Arc<opbridge_runtime::Tensor>> = Vec::new();
        let mut kinds: Vec<Option<Arg<'static>>> = Vec::with_capacity(args.len());
        for (k, arg) in args.iter().enumerate() {
            if let Ok(t) = arg.cast::<PyTensor>() {
                tensors.push(Arc::clone(&t.get().inner));
                kinds.push(None);
                inferred.push(Param::Tensor);
                continue;
            }
            if !declared && !arg.is_instance_of::<pyo3::types::PyBool>() {
                inferred.push(scalar_param(self.inner.name(), k, &arg)?);
            }
            if arg.is_instance_of::<pyo3::types::PyBool>() {
                return Err(argument_error(format!("kernel {}: argument {k} is a bool", self.inner.name())));
            } else if let Ok(v) = arg.extract::<i128>() {
                kinds.push(Some(Arg::Int(v)));
            } else if let Ok(v) = arg.extract::<f64>() {
                kinds.push(Some(Arg::Float(v)));
            } else {
                return Err(argument_error(format!(
                    "kernel {}: argument {k} must be an opbridge Tensor on {} or a number, got {}",
                    self.inner.name(),
                    self.inner.device(),
                    arg.get_type().name()?
                )));
            }
        }
        let mut next_tensor = tensors.iter();
        let call_args: Vec<Arg<'_>> = kinds
            .into_iter()
            .map(|k| k.unwrap_or_else(|| Arg::Tensor(next_tensor.next().expect("one per None"))))
            .collect();
        // Typed errors before anything is enqueued.
        let packed = match self.inner.params() {
            Some(_) => self.inner.pack(&call_args),
            None => self.inner.pack_as(&inferred, &call_args),
        };
        let (packed, tensor_args) =
            packed.map_err(|e| if e.wrong_device { device_error(e.message) } else { argument_error(e.message) })?;
        let stream: Stream = match stream {
            Some(s) => s.get().inner.clone(),
            None => DeviceContext::get(self.inner.device()).and_then(|ctx| ctx.current_stream()).map_err(to_pyerr)?,
        };
        py.detach(|| self.inner.launch_packed(blocks, packed, &tensor_args, &stream)).map_err(to_pyerr)?;
        // A failure while it runs is reported later: it names the kernel and this call.
        stream.note_launch(Launch { what: Arc::clone(&self.label), site: python_call_site(py) });
        Ok(())
    }

    fn __repr__(&self) -> String {
        match self.params() {
            Some(params) => format!("Kernel({:?} on {}, params={params:?})", self.inner.name(), self.inner.device()),
            None => format!("Kernel({:?} on {}, params from each call)", self.inner.name(), self.inner.device()),
        }
    }
}

/// Compiles Ascend C `source` with the runtime compiler (aclrtc): `(binary, log, message, code)`,
/// `binary` None when it failed (`opbridge.jit` raises `JitCompileError` with the log then).
#[pyfunction]
pub fn ascend_rtc_compile(
    py: Python<'_>,
    source: &str,
    name: &str,
    options: Vec<String>,
) -> (Option<Py<PyBytes>>, String, String, i32) {
    match py.detach(|| opbridge_ascend::rtc::compile(source, name, &options)) {
        Ok(binary) => (Some(PyBytes::new(py, &binary).unbind()), String::new(), String::new(), 0),
        Err(e) => (None, e.log, e.message, e.code),
    }
}

/// Where the Ascend runtime compiler is loaded from (a `DeviceError` when it is not there).
#[pyfunction]
pub fn ascend_rtc_library(py: Python<'_>) -> PyResult<String> {
    py.detach(opbridge_ascend::rtc::library).map(|p| p.display().to_string()).map_err(device_error)
}
