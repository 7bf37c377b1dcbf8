//! `opbridge.Stream`, `opbridge.Event` and the module-level stream functions.

use std::sync::Mutex;

use opbridge_runtime::{DeviceContext, Event, Stream, StreamContext};
use pyo3::prelude::*;

use crate::convert::parse_device;
use crate::errors::to_pyerr;

/// An ordered queue of work on a device. Each Python thread has its own current stream
/// (created on first use); ``with stream:`` makes ``stream`` current in the block.
///
/// The current stream belongs to the thread, not to an asyncio task (as in PyTorch): tasks
/// interleaved on one event loop share it, so a ``with stream:`` held across an ``await``
/// is seen by the other tasks while it is open. Give each task its stream explicitly
/// (``stream.launch_host_func``, ``ob.ops.*`` inside a ``with`` block with no ``await``).
///
/// Example:
///     >>> s = ob.Stream()
///     >>> with s:
///     ...     r = ob.vector_add(t, t)      # enqueued on s, returns at once
///     >>> s.synchronize()
#[pyclass(name = "Stream", module = "opbridge", frozen)]
#[derive(Debug)]
pub struct PyStream {
    pub inner: Stream,
    /// The open `with` blocks of this object, innermost last (a stream may be entered by several
    /// threads, and nested). Each closes on `__exit__`, in any order (see `enter_stream`).
    entered: Mutex<Vec<StreamContext>>,
}

impl PyStream {
    pub fn wrap(inner: Stream) -> PyStream {
        PyStream { inner, entered: Mutex::new(Vec::new()) }
    }
}

impl Drop for PyStream {
    /// A block entered with a bare `__enter__()` and never exited stays open when the object
    /// goes (the stream stays current), as with `torch.cuda.stream`.
    fn drop(&mut self) {
        let entered = std::mem::take(self.entered.get_mut().unwrap_or_else(|p| p.into_inner()));
        entered.into_iter().for_each(std::mem::forget);
    }
}

#[pymethods]
impl PyStream {
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(device: Option<&str>) -> PyResult<PyStream> {
        let ctx = DeviceContext::get(parse_device(device)?).map_err(to_pyerr)?;
        Ok(PyStream::wrap(Stream::new(ctx).map_err(to_pyerr)?))
    }

    #[getter]
    fn id(&self) -> u64 {
        self.inner.id().0
    }

    #[getter]
    fn device(&self) -> String {
        self.inner.device().to_string()
    }

    fn __repr__(&self) -> String {
        format!("Stream(id={}, device='{}')", self.inner.id().0, self.inner.device())
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyStream>().is_ok_and(|o| o.get().inner == self.inner)
    }

    fn __hash__(&self) -> u64 {
        self.inner.id().0
    }

    fn __enter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        let this = slf.get();
        if this.inner.orphaned() {
            // Made in the parent of a fork(): work enqueued on it would never run here.
            let what = format!("stream #{}", this.inner.id().0);
            return Err(crate::errors::device_error(opbridge_runtime::fork::orphaned_message(&what)));
        }
        let context = opbridge_runtime::enter_stream(this.inner.clone());
        this.entered.lock().unwrap_or_else(|p| p.into_inner()).push(context);
        Ok(slf.clone())
    }

    /// Exits the innermost block this thread entered on this object; a block entered on another
    /// thread (a generator resumed elsewhere) when this thread entered none. Blocks may exit in
    /// any order: the current stream is always that of the innermost block still open.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) {
        let me = std::thread::current().id();
        let context = {
            let mut entered = self.entered.lock().unwrap_or_else(|p| p.into_inner());
            let index = entered.iter().rposition(|c| c.thread() == me).or_else(|| entered.len().checked_sub(1));
            index.map(|i| entered.remove(i))
        };
        // Dropped outside the lock: exiting touches this thread's current-stream state.
        drop(context);
    }

    /// Blocks until all work enqueued so far is done; raises the first asynchronous error.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).map_err(to_pyerr)
    }

    /// True when all work enqueued so far is done.
    fn query(&self) -> bool {
        self.inner.query()
    }

    /// Records `event` (a new one when omitted) at the current end of this stream.
    #[pyo3(signature = (event=None))]
    fn record_event(&self, py: Python<'_>, event: Option<Py<PyEvent>>) -> PyResult<Py<PyEvent>> {
        let event = match event {
            Some(event) => event,
            None => Py::new(py, PyEvent::new(Some(&self.inner.device().to_string()), true)?)?,
        };
        event.get().inner.record(&self.inner).map_err(to_pyerr)?;
        Ok(event)
    }

    /// Later work on this stream waits for `event`.
    fn wait_event(&self, event: &PyEvent) -> PyResult<()> {
        self.inner.wait_event(&event.inner).map_err(to_pyerr)
    }

    /// Later work on this stream waits for all work enqueued on `stream` so far.
    fn wait_stream(&self, stream: &PyStream) -> PyResult<()> {
        let event = stream.inner.record_new_event().map_err(to_pyerr)?;
        self.inner.wait_event(&event).map_err(to_pyerr)
    }

    /// Calls ``fn()`` on the stream's worker once all earlier work is done. An exception
    /// raised by ``fn`` becomes the stream's error, raised by the next ``synchronize()``.
    fn launch_host_func(&self, func: Py<PyAny>) -> PyResult<()> {
        self.inner
            .launch_host_func(Box::new(move || {
                if !crate::ffi::interpreter_alive() {
                    // Leak the callable: dropping a Python object needs a live interpreter.
                    std::mem::forget(func);
                    return Err(opbridge_runtime::AsyncError::new(
                        opbridge_runtime::ErrorKind::Device,
                        "host function skipped: the Python interpreter has shut down",
                    ));
                }
                Python::attach(|py| {
                    let outcome = func.call0(py).map(drop).map_err(|e| {
                        opbridge_runtime::AsyncError::new(
                            opbridge_runtime::ErrorKind::Device,
                            format!("host function raised {e}"),
                        )
                    });
                    // Released here, attached: dropped later without the GIL, its reference would
                    // wait for some other opbridge call, keeping what it captured (its own
                    // stream, and so that stream's worker) alive until then.
                    drop(func);
                    outcome
                })
            }))
            .map_err(to_pyerr)
    }
}

/// A point in a stream's work: for ordering streams, waiting and timing.
///
/// Example:
///     >>> start, end = ob.Event(), ob.Event()
///     >>> start.record(); r = ob.matmul(t, t); end.record()
///     >>> end.synchronize(); start.elapsed_time(end)   # milliseconds
#[pyclass(name = "Event", module = "opbridge", frozen)]
#[derive(Debug)]
pub struct PyEvent {
    pub inner: Event,
}

#[pymethods]
impl PyEvent {
    /// ``enable_timing`` is accepted for CUDA compatibility: CPU events always keep time.
    #[new]
    #[pyo3(signature = (device=None, enable_timing=true))]
    fn new(device: Option<&str>, enable_timing: bool) -> PyResult<PyEvent> {
        let _ = enable_timing;
        let ctx = DeviceContext::get(parse_device(device)?).map_err(to_pyerr)?;
        Ok(PyEvent { inner: Event::new(ctx).map_err(to_pyerr)? })
    }

    /// Records the event on `stream` (the current stream when omitted).
    #[pyo3(signature = (stream=None))]
    fn record(&self, stream: Option<&PyStream>) -> PyResult<()> {
        let stream = match stream {
            Some(s) => s.inner.clone(),
            None => DeviceContext::get(self.inner.device()).and_then(|ctx| ctx.current_stream()).map_err(to_pyerr)?,
        };
        self.inner.record(&stream).map_err(to_pyerr)
    }

    /// Blocks until the recorded point is reached.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).map_err(to_pyerr)
    }

    /// True when the recorded point is reached (or the event was never recorded).
    fn query(&self) -> bool {
        self.inner.query()
    }

    /// Milliseconds from this event to `end`; both recorded and complete.
    fn elapsed_time(&self, end: &PyEvent) -> PyResult<f64> {
        self.inner.elapsed_ms(&end.inner).map_err(to_pyerr)
    }

    /// Makes `stream` (the current stream when omitted) wait for this event.
    #[pyo3(signature = (stream=None))]
    fn wait(&self, stream: Option<&PyStream>) -> PyResult<()> {
        let stream = match stream {
            Some(s) => s.inner.clone(),
            None => DeviceContext::get(self.inner.device()).and_then(|ctx| ctx.current_stream()).map_err(to_pyerr)?,
        };
        stream.wait_event(&self.inner).map_err(to_pyerr)
    }

    fn __repr__(&self) -> String {
        format!("Event(device='{}', done={})", self.inner.device(), self.inner.query())
    }

    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("opbridge._aio")?.call_method1("wait_event", (slf,))?.call_method0("__await__")
    }
}

/// The calling thread's current stream on `device` (created on first use).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn current_stream(device: Option<&str>) -> PyResult<PyStream> {
    let ctx = DeviceContext::get(parse_device(device)?).map_err(to_pyerr)?;
    Ok(PyStream::wrap(ctx.current_stream().map_err(to_pyerr)?))
}

/// Waits for all work on all streams of `device`; raises the first asynchronous error.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn synchronize(py: Python<'_>, device: Option<&str>) -> PyResult<()> {
    let ctx = DeviceContext::get(parse_device(device)?).map_err(to_pyerr)?;
    py.detach(|| ctx.synchronize()).map_err(to_pyerr)
}

/// Waits for all work on all streams of `device` like ``synchronize``, but leaves asynchronous
/// errors for the user's next ``synchronize`` (the profiler waits this way when it stops).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn drain(py: Python<'_>, device: Option<&str>) -> PyResult<()> {
    let ctx = DeviceContext::get(parse_device(device)?).map_err(to_pyerr)?;
    py.detach(|| ctx.drain()).map_err(to_pyerr)
}

/// True on a stream's worker thread (inside a host function): waits there are checked for
/// dependencies on the worker's own queue, so the asyncio glue waits inline instead of in an
/// executor thread, where a wait on work queued behind the host function could not be seen.
#[pyfunction]
pub fn on_stream_worker() -> bool {
    opbridge_runtime::on_stream_worker()
}
