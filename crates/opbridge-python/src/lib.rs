//! `opbridge._native`: the PyO3 bindings. Conversion, GIL handling and error mapping only; the
//! work lives in `opbridge-runtime` and `opbridge-ops`.

mod ascend;
mod convert;
mod devices;
mod errors;
mod ffi;
mod host;
mod hybrid;
mod memory;
mod plugin;
mod profiler;
mod registry;
mod stream;
mod tensor;
mod tuning;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Before any thread starts: a child forked from here replaces the stream workers and the
    // compute pool it needs instead of waiting for the parent's (opbridge_runtime::fork).
    opbridge_runtime::fork::register();
    // `ascend:N` devices, opened on first use (the ACL library is looked for then, not here).
    opbridge_ascend::register();
    errors::register(m)?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<stream::PyStream>()?;
    m.add_class::<stream::PyEvent>()?;
    m.add_class::<ascend::PyKernel>()?;
    m.add_function(wrap_pyfunction!(ascend::ascend_rtc_compile, m)?)?;
    m.add_function(wrap_pyfunction!(ascend::ascend_rtc_library, m)?)?;
    m.add_class::<memory::PooledMemory>()?;
    m.add_class::<registry::PyOp>()?;
    registry::enable_vectorcall(m.py())?;
    m.add_function(wrap_pyfunction!(registry::get_op, m)?)?;
    m.add_function(wrap_pyfunction!(registry::list_ops, m)?)?;
    m.add_function(wrap_pyfunction!(registry::registry_generation, m)?)?;
    m.add_class::<plugin::PyLibrary>()?;
    m.add_function(wrap_pyfunction!(plugin::load_library, m)?)?;
    m.add_function(wrap_pyfunction!(registry::vector_add, m)?)?;
    m.add_function(wrap_pyfunction!(hybrid::set_crossover, m)?)?;
    m.add_function(wrap_pyfunction!(hybrid::clear_crossovers, m)?)?;
    m.add_function(wrap_pyfunction!(hybrid::crossovers, m)?)?;
    m.add_function(wrap_pyfunction!(hybrid::device_identity, m)?)?;
    m.add_function(wrap_pyfunction!(hybrid::explain, m)?)?;
    m.add_function(wrap_pyfunction!(hybrid::staged_ops, m)?)?;
    m.add_function(wrap_pyfunction!(registry::matmul, m)?)?;
    m.add_function(wrap_pyfunction!(devices::devices, m)?)?;
    m.add_function(wrap_pyfunction!(devices::shutdown_devices, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::asarray, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::empty, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::zeros, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::from_dlpack, m)?)?;
    m.add_function(wrap_pyfunction!(stream::current_stream, m)?)?;
    m.add_function(wrap_pyfunction!(stream::synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(stream::drain, m)?)?;
    m.add_function(wrap_pyfunction!(stream::on_stream_worker, m)?)?;
    m.add_function(wrap_pyfunction!(memory::get_memory_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(memory::set_memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(memory::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(memory::reset_peak_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(memory::memory_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_start, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_stop, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_active, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_begin, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_end, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_now, m)?)?;
    m.add_function(wrap_pyfunction!(profiler::profiler_complete, m)?)?;
    m.add_function(wrap_pyfunction!(tuning::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(tuning::calibrate_thresholds, m)?)?;
    m.add_function(wrap_pyfunction!(tuning::get_thresholds, m)?)?;
    m.add_function(wrap_pyfunction!(tuning::set_thresholds, m)?)?;
    m.add("GIL_RELEASE_BYTES", host::GIL_RELEASE_BYTES)?;
    m.add("POOL_OUTPUT_MIN_BYTES", host::POOL_OUTPUT_MIN_BYTES)?;
    m.add("PARALLEL_MIN_ELEMS", opbridge_ops::PARALLEL_MIN_ELEMS)?;
    Ok(())
}
