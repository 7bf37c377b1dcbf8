//! The device pool from Python: statistics, limits, cache control, and the owner object that
//! lets numpy arrays live in pool blocks.

use opbridge_runtime::DeviceContext;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::parse_device;
use crate::errors::to_pyerr;
// Declared beside the numpy constructor that makes it an array's base (all the bindings'
// `unsafe` is in `ffi`); `opbridge.PooledMemory` is registered from here as before.
pub use crate::ffi::numpy::PooledMemory;

fn context(device: Option<&str>) -> PyResult<&'static std::sync::Arc<DeviceContext>> {
    DeviceContext::get(parse_device(device)?).map_err(to_pyerr)
}

/// Statistics of the device's caching pool, as a dict.
///
/// Keys: ``allocated_blocks``, ``free_blocks``, ``total_memory`` (bytes reserved from the
/// device), ``allocated_bytes.current/peak``, ``reserved_bytes.current/peak``, ``num_allocs``,
/// ``num_cache_hits``, ``num_alloc_retries``, ``num_ooms``, ``fragmented_bytes`` (cached bytes in
/// blocks too small for the largest recent request), ``largest_recent_request``,
/// ``pending_free_blocks`` (freed, waiting for other streams) and ``limit`` (``None`` if unset).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn get_memory_pool_stats<'py>(py: Python<'py>, device: Option<&str>) -> PyResult<Bound<'py, PyDict>> {
    let s = context(device)?.pool().stats();
    let dict = PyDict::new(py);
    dict.set_item("allocated_blocks", s.allocated_blocks)?;
    dict.set_item("free_blocks", s.free_blocks)?;
    dict.set_item("total_memory", s.total_memory)?;
    dict.set_item("allocated_bytes.current", s.allocated_bytes_current)?;
    dict.set_item("allocated_bytes.peak", s.allocated_bytes_peak)?;
    dict.set_item("reserved_bytes.current", s.reserved_bytes_current)?;
    dict.set_item("reserved_bytes.peak", s.reserved_bytes_peak)?;
    dict.set_item("num_allocs", s.num_allocs)?;
    dict.set_item("num_cache_hits", s.num_cache_hits)?;
    dict.set_item("num_alloc_retries", s.num_alloc_retries)?;
    dict.set_item("num_ooms", s.num_ooms)?;
    dict.set_item("fragmented_bytes", s.fragmented_bytes)?;
    dict.set_item("largest_recent_request", s.largest_recent_request)?;
    dict.set_item("pending_free_blocks", s.pending_free_blocks)?;
    dict.set_item("limit", s.limit)?;
    Ok(dict)
}

/// Caps the bytes the device pool may reserve (``None`` removes the cap). Allocations beyond
/// it first release the cache, then raise ``OutOfMemoryError``.
#[pyfunction]
#[pyo3(signature = (limit, device=None))]
pub fn set_memory_limit(py: Python<'_>, limit: Option<&Bound<'_, PyAny>>, device: Option<&str>) -> PyResult<()> {
    let limit = match limit {
        None => None,
        Some(limit) => Some(crate::convert::int_arg("limit", limit, 0, usize::MAX as i128)? as usize),
    };
    let ctx = context(device)?;
    py.detach(|| ctx.pool().set_limit(limit)).map_err(to_pyerr)
}

/// Waits for the device, then returns every cached, unused block to the system.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn empty_cache(py: Python<'_>, device: Option<&str>) -> PyResult<()> {
    let ctx = context(device)?;
    py.detach(|| ctx.pool().empty_cache()).map_err(to_pyerr)
}

/// Resets the ``.peak`` statistics to the current values.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn reset_peak_memory_stats(device: Option<&str>) -> PyResult<()> {
    context(device)?.pool().reset_peak_stats();
    Ok(())
}

/// The device pool's segments and blocks, as dicts (see ``opbridge.memory_snapshot``).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn memory_snapshot<'py>(py: Python<'py>, device: Option<&str>) -> PyResult<Bound<'py, pyo3::types::PyList>> {
    let ctx = context(device)?;
    let segments = py.detach(|| ctx.pool().snapshot());
    let out = pyo3::types::PyList::empty(py);
    for segment in segments {
        let blocks = pyo3::types::PyList::empty(py);
        for block in &segment.blocks {
            let b = PyDict::new(py);
            b.set_item("address", block.address)?;
            b.set_item("size", block.size)?;
            b.set_item("state", block.state.name())?;
            b.set_item("stream", block.stream)?;
            b.set_item("op", block.op.as_deref())?;
            blocks.append(b)?;
        }
        let s = PyDict::new(py);
        s.set_item("device", ctx.id().to_string())?;
        s.set_item("address", segment.address)?;
        s.set_item("total_size", segment.size)?;
        s.set_item("stream", segment.stream)?;
        s.set_item("blocks", blocks)?;
        out.append(s)?;
    }
    Ok(out)
}
