//! Dispatch thresholds from Python: `calibrate`, and get/set for the saved per-user file.

use opbridge_ops::tuning::{self, Thresholds};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn to_dict<'py>(py: Python<'py>, t: Thresholds) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("elementwise_parallel_min_elems", t.elementwise_parallel_min_elems)?;
    dict.set_item("matmul_parallel_min_flops", t.matmul_parallel_min_flops)?;
    dict.set_item("transcendental_parallel_min_elems", t.transcendental_parallel_min_elems)?;
    Ok(dict)
}

/// Re-measures the dispatch thresholds on this machine (about a second, GIL released), applies
/// them, and returns them as a dict.
#[pyfunction]
pub fn calibrate_thresholds(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let measured = py.detach(tuning::calibrate);
    to_dict(py, measured)
}

/// The thresholds in force.
#[pyfunction]
pub fn get_thresholds(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    to_dict(py, tuning::get())
}

/// Applies thresholds (e.g. loaded from the cache file); missing keys keep their defaults.
#[pyfunction]
pub fn set_thresholds(values: &Bound<'_, PyDict>) -> PyResult<()> {
    let defaults = tuning::defaults();
    let pick = |key: &str, default: usize| -> PyResult<usize> {
        Ok(match values.get_item(key)? {
            Some(v) => crate::convert::int_arg(key, &v, 0, usize::MAX as i128)? as usize,
            None => default,
        })
    };
    tuning::set(Thresholds {
        elementwise_parallel_min_elems: pick(
            "elementwise_parallel_min_elems",
            defaults.elementwise_parallel_min_elems,
        )?,
        matmul_parallel_min_flops: pick("matmul_parallel_min_flops", defaults.matmul_parallel_min_flops)?,
        transcendental_parallel_min_elems: pick(
            "transcendental_parallel_min_elems",
            defaults.transcendental_parallel_min_elems,
        )?,
    });
    Ok(())
}
