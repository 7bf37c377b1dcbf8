//! `vector_add(a, b) -> a + b` for 1-D float32 arrays: read-only borrows of the
//! inputs, one fresh output array, no GIL release, no runtime.
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

#[pyfunction]
fn vector_add<'py>(
    py: Python<'py>,
    a: PyReadonlyArray1<'py, f32>,
    b: PyReadonlyArray1<'py, f32>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let (a, b) = (a.as_slice()?, b.as_slice()?);
    if a.len() != b.len() {
        return Err(PyValueError::new_err("vector_add: length mismatch"));
    }
    let out: Vec<f32> = a.iter().zip(b).map(|(x, y)| x + y).collect();
    Ok(PyArray1::from_vec(py, out))
}

#[pymodule]
fn bare_pyo3(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(vector_add, m)?)
}
