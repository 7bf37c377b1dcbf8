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

/// How this native module was built and what it found on this CPU (for `opbridge doctor`):
/// version, profile, target, the plugin ABI it speaks, CPU features, kernel variants, and the
/// compute pool's thread count.
#[pyfunction]
pub fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    use opbridge_ops::cpu::features;
    let dict = PyDict::new(py);
    dict.set_item("version", env!("CARGO_PKG_VERSION"))?;
    dict.set_item("profile", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    dict.set_item("target", format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS))?;
    dict.set_item("plugin_abi_version", opbridge_ops::plugin::sys::OPBRIDGE_PLUGIN_ABI_VERSION)?;
    let cpu = PyDict::new(py);
    for (name, present) in features::cpu_features() {
        cpu.set_item(name, present)?;
    }
    dict.set_item("cpu_features", cpu)?;
    let kernels = PyDict::new(py);
    for (family, variant) in features::kernel_variants() {
        kernels.set_item(family, variant)?;
    }
    dict.set_item("kernel_variants", kernels)?;
    dict.set_item("compute_threads", features::compute_threads())?;
    Ok(dict)
}
