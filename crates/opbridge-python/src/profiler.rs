//! The profiler's controls and its recording, for `opbridge.profiler` (which builds the Chrome
//! trace and the averages in Python).

use opbridge_runtime::profiler::{self, Arg, Phase};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

/// Starts recording; a RuntimeError when a profile is already recording.
#[pyfunction]
pub fn profiler_start(record_shapes: bool, profile_memory: bool) -> PyResult<()> {
    profiler::start(record_shapes, profile_memory).map_err(PyRuntimeError::new_err)
}

/// Whether a profile is recording.
#[pyfunction]
pub fn profiler_active() -> bool {
    profiler::active()
}

fn phase_code(phase: Phase) -> &'static str {
    match phase {
        Phase::Begin => "B",
        Phase::End => "E",
        Phase::Instant => "i",
        Phase::FlowStart => "s",
        Phase::FlowEnd => "f",
        Phase::Complete => "X",
    }
}

/// Stops recording: `(events, tracks)`, or None when nothing was recording. Each event is
/// `(phase, category, name, ts_ns, track, flow, args, dur_ns)`; each track `(id, name, OS
/// thread id)`.
#[pyfunction]
pub fn profiler_stop(py: Python<'_>) -> PyResult<Option<Bound<'_, PyTuple>>> {
    let Some(recording) = py.detach(profiler::stop) else { return Ok(None) };
    let events = PyList::empty(py);
    for e in recording.events {
        let args = PyDict::new(py);
        for (key, value) in e.args {
            match value {
                Arg::Int(v) => args.set_item(key, v)?,
                Arg::Float(v) => args.set_item(key, v)?,
                other => args.set_item(key, other.to_text())?,
            }
        }
        events.append((phase_code(e.phase), e.category, &*e.name, e.ts_ns, e.track, e.flow, args, e.dur_ns))?;
    }
    let tracks = PyList::empty(py);
    for (id, name, os_id) in recording.tracks {
        tracks.append((id, name, os_id))?;
    }
    Ok(Some(PyTuple::new(py, [events.into_any(), tracks.into_any()])?))
}

fn category(name: &str) -> &'static str {
    match name {
        "jit" => "jit",
        "plugin" => "plugin",
        _ => "user",
    }
}

/// Begins a span on the calling thread's track (Python-side work: JIT compiles, user ranges).
#[pyfunction]
#[pyo3(signature = (cat, name, args=None))]
pub fn profiler_begin(cat: &str, name: &str, args: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    if !profiler::active() {
        return Ok(());
    }
    let mut values = Vec::new();
    if let Some(args) = args {
        for (key, value) in args.iter() {
            let key: String = key.extract()?;
            // Events keep `'static` keys: the few our Python code uses, else "value".
            let key: &'static str = match key.as_str() {
                "source" => "source",
                "cached" => "cached",
                "compiler" => "compiler",
                _ => "value",
            };
            let value = if let Ok(v) = value.extract::<i64>() {
                Arg::Int(v)
            } else if let Ok(v) = value.extract::<f64>() {
                Arg::Float(v)
            } else {
                Arg::Str(value.str()?.to_string())
            };
            values.push((key, value));
        }
    }
    profiler::record(Phase::Begin, category(cat), name, 0, values);
    Ok(())
}

/// Ends the span `profiler_begin` began on this thread.
#[pyfunction]
pub fn profiler_end(cat: &str, name: &str) {
    if profiler::active() {
        profiler::record(Phase::End, category(cat), name, 0, Vec::new());
    }
}

/// The profile's clock: nanoseconds since it started (0 when none is recording).
#[pyfunction]
pub fn profiler_now() -> u64 {
    profiler::now()
}

/// Records a whole range that began at `begin_ns` (from ``profiler_now``) and ends now.
#[pyfunction]
pub fn profiler_complete(cat: &str, name: &str, begin_ns: u64) {
    profiler::complete(category(cat), name, begin_ns, Vec::new());
}
