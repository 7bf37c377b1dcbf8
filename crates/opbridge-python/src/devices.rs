//! `opbridge.devices()`: every device this process can reach, and why the others cannot be.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// One dict per device: ``name``, ``available``, and what the driver says (``soc``,
/// ``memory_bytes``, ``library``), or ``reason`` for a backend that cannot serve (with every
/// library path tried).
#[pyfunction]
pub fn devices(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let reports = py.detach(opbridge_runtime::backend::reports);
    let list = PyList::empty(py);
    for report in reports {
        let entry = PyDict::new(py);
        entry.set_item("name", report.name())?;
        entry.set_item("kind", report.kind.name())?;
        entry.set_item("available", report.available)?;
        if let Some(soc) = &report.soc {
            entry.set_item("soc", soc)?;
        }
        if let Some(bytes) = report.memory_bytes {
            entry.set_item("memory_bytes", bytes)?;
        }
        if let Some(library) = &report.library {
            entry.set_item("library", library)?;
        }
        if let Some(version) = &report.driver_version {
            entry.set_item("driver_version", version)?;
        }
        if let Some(reason) = &report.reason {
            entry.set_item("reason", reason)?;
        }
        list.append(entry)?;
    }
    Ok(list)
}

/// At exit: finishes the accelerators' work, returns their cached memory and finalizes their
/// drivers (ACL's `aclFinalize`). The CPU device needs nothing.
#[pyfunction]
pub fn shutdown_devices(py: Python<'_>) -> PyResult<()> {
    py.detach(opbridge_ascend::shutdown).map_err(crate::errors::to_pyerr)
}
