//! `device="auto"`: the crossovers of hybrid dispatch (`opbridge_ops::hybrid`), set by
//! `ob.calibrate()` (and loaded from its saved file), and `ob.explain`.

use opbridge_ops::hybrid::{self, Crossover};
use opbridge_runtime::DType;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::parse_device;
use crate::errors::argument_error;

/// Sets the crossover of ``op`` in ``dtype`` on ``device``: from ``elems`` elements on,
/// ``device="auto"`` stages numpy calls through the device (``None``: never), as measured on
/// the device named by ``identity`` (see ``device_identity``).
#[pyfunction]
#[pyo3(signature = (op, dtype, device, elems, identity))]
pub fn set_crossover(op: &str, dtype: &str, device: &str, elems: Option<usize>, identity: String) -> PyResult<()> {
    let dtype =
        DType::from_name(dtype).ok_or_else(|| argument_error(format!("set_crossover: unknown dtype {dtype:?}")))?;
    let device = parse_device(Some(device))?;
    if device.kind == opbridge_runtime::DeviceKind::Cpu {
        return Err(argument_error(
            "set_crossover: the device must be an accelerator (the host is the other path)".into(),
        ));
    }
    hybrid::set(op, Crossover { device, dtype, elems, identity });
    Ok(())
}

/// Forgets every crossover: ``device="auto"`` then keeps every call on the host.
#[pyfunction]
pub fn clear_crossovers() {
    hybrid::clear();
}

/// The crossovers in force: ``[{'op', 'dtype', 'device', 'elems', 'identity'}]``.
#[pyfunction]
pub fn crossovers(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for (op, c) in hybrid::entries() {
        let d = PyDict::new(py);
        d.set_item("op", op)?;
        d.set_item("dtype", c.dtype.name())?;
        d.set_item("device", c.device.to_string())?;
        d.set_item("elems", c.elems)?;
        d.set_item("identity", c.identity)?;
        list.append(d)?;
    }
    Ok(list)
}

/// What identifies ``device`` for its measurements (its chip and driver library), or ``None``
/// when it is unavailable. Starts the device's driver.
#[pyfunction]
pub fn device_identity(py: Python<'_>, device: &str) -> PyResult<Option<String>> {
    let device = parse_device(Some(device))?;
    Ok(py.detach(|| hybrid::identity(device)))
}

/// Which path a call ``op(*args, out=out, device=device)`` takes, and why:
/// ``{'path': 'host' | 'ascend:0', 'reason': ...}``.
#[pyfunction]
#[pyo3(signature = (op, *args, out=None, device="auto"))]
pub fn explain<'py>(
    py: Python<'py>,
    op: &Bound<'py, PyAny>,
    args: &Bound<'py, PyTuple>,
    out: Option<&Bound<'py, PyAny>>,
    device: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let (path, reason) = crate::registry::explain_route(op, args, out, device)?;
    let d = PyDict::new(py);
    d.set_item("path", path)?;
    d.set_item("reason", reason)?;
    Ok(d)
}

/// The operators whose numpy calls ``device`` can stage (elementwise, with a kernel for that
/// device), latest versions: ``[(name, inputs, dtypes)]``, what ``ob.calibrate()`` measures.
#[pyfunction]
pub fn staged_ops(device: &str) -> PyResult<Vec<(String, usize, Vec<&'static str>)>> {
    let device = parse_device(Some(device))?;
    let registry = crate::registry::registry();
    let mut found = Vec::new();
    for info in registry.list() {
        let Ok(entry) = registry.get(&info.name, None) else { continue };
        if entry.op.lane().is_none() || entry.device_kernel(device.kind).is_none() {
            continue;
        }
        let schema = entry.schema();
        found.push((schema.name.clone(), schema.inputs.len(), schema.dtypes.iter().map(|d| d.name()).collect()));
    }
    Ok(found)
}
