//! Operator libraries from Python: `ob.load_library(path)` and the `Library` handle.

use std::path::PathBuf;
use std::sync::Mutex;

use opbridge_ops::plugin::Library as NativeLibrary;
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// A loaded operator library (see ``load_library``).
///
/// Its operators stay registered until ``unload()`` (or the end of a ``with`` block); dropping
/// the object does not unload them.
///
/// **A crashing plugin kills the process.** Its code runs in this process with no isolation: a
/// segfault, abort or stray write in ``opbridge_plugin_init``, ``infer`` or a kernel ends the
/// interpreter at once (no exception, no cleanup). Run with ``python -X faulthandler`` to get
/// every thread's Python stack at the crash (the last frame is the ``ob.ops.<name>(...)`` call
/// that entered the plugin); load and exercise an untrusted library in a subprocess first and
/// read its exit status (negative: killed by a signal). ``opbridge doctor --plugin PATH`` loads
/// it in a subprocess and names a crash in its init, a missing symbol or dependency, a wrong ABI
/// or a bad descriptor (it does not call the kernels). See ``opbridge/plugin.h``.
#[pyclass(name = "Library", module = "opbridge", subclass)]
#[derive(Debug)]
pub struct PyLibrary {
    path: PathBuf,
    ops: Vec<(String, u32)>,
    abi_version: u32,
    /// `None` once unloaded.
    inner: Mutex<Option<NativeLibrary>>,
}

/// Tells `opbridge.ops` that the registry changed, so the operators it cached as module
/// attributes (what makes `ob.ops.add` a plain attribute lookup) are looked up again.
fn operators_changed(py: Python<'_>) -> PyResult<()> {
    py.import("opbridge.ops")?.call_method0("_invalidate")?;
    Ok(())
}

impl PyLibrary {
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<PyLibrary> {
        let registry = std::sync::Arc::clone(opbridge_ops::global());
        let lib = py.detach(|| NativeLibrary::load_into(registry, &path)).map_err(to_pyerr)?;
        if let Err(error) = operators_changed(py) {
            // No handle goes back to the caller: nothing of the library may stay registered.
            py.detach(|| lib.unload()).map_err(to_pyerr)?;
            return Err(error);
        }
        Ok(PyLibrary {
            path: lib.path().to_path_buf(),
            ops: lib.ops(),
            abi_version: lib.abi_version(),
            inner: Mutex::new(Some(lib)),
        })
    }

    fn is_loaded(&self) -> bool {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }
}

#[pymethods]
impl PyLibrary {
    /// Same as ``load_library(path)``.
    #[new]
    fn __new__(py: Python<'_>, path: PathBuf) -> PyResult<PyLibrary> {
        PyLibrary::load(py, path)
    }

    /// The absolute path the library was loaded from.
    #[getter]
    fn path(&self) -> String {
        self.path.display().to_string()
    }

    /// ``(name, version)`` of each operator the library registered.
    #[getter]
    fn ops(&self) -> Vec<(String, u32)> {
        self.ops.clone()
    }

    /// The plugin ABI version the library was built for: 3, or 2 for a library built before
    /// ABI 3 (it loads unchanged, with CPU kernels only).
    #[getter]
    fn abi_version(&self) -> u32 {
        self.abi_version
    }

    /// Whether the library is still loaded.
    #[getter]
    fn loaded(&self) -> bool {
        self.is_loaded()
    }

    /// Unregisters the library's operators, waits for calls in flight (with the GIL released),
    /// then closes the library. Calls through an ``Op`` looked up earlier then raise
    /// ``OpBridgeError``. Unloading twice does nothing.
    fn unload(&self, py: Python<'_>) -> PyResult<()> {
        let lib = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        match lib {
            Some(lib) => {
                let unloaded = py.detach(|| lib.unload()).map_err(to_pyerr);
                // The unload's own error first: it says what happened to the library.
                unloaded.and(operators_changed(py))
            }
            None => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, exc_type: Py<PyAny>, exc: Py<PyAny>, tb: Py<PyAny>) -> PyResult<bool> {
        drop((exc_type, exc, tb));
        self.unload(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let ops: Vec<String> = self.ops.iter().map(|(n, v)| format!("{n} v{v}")).collect();
        let state = if self.is_loaded() { "" } else { ", unloaded" };
        format!("<opbridge.Library {:?} ops=[{}]{state}>", self.path.display().to_string(), ops.join(", "))
    }
}

/// Loads an operator library (a shared object built against ``opbridge.get_include()``'s
/// ``opbridge/plugin.h``, or with the Rust SDK) and registers its operators, which are then
/// callable as ``ob.ops.<name>(...)`` and ``ob.ops.get(name, version=...)``.
///
/// Each load maps a private copy of the file, so loading again after rebuilding the file at the
/// same path runs the new code (unload the old library first: a name + version registers once).
///
/// **A crashing plugin kills the process.** Its code runs in this process with no isolation: a
/// segfault, abort or stray write in ``opbridge_plugin_init``, ``infer`` or a kernel ends the
/// interpreter at once (no exception, no cleanup). Run with ``python -X faulthandler`` to get
/// every thread's Python stack at the crash (the last frame is the ``ob.ops.<name>(...)`` call
/// that entered the plugin); load and exercise an untrusted library in a subprocess first and
/// read its exit status (negative: killed by a signal). ``opbridge doctor --plugin PATH`` loads
/// it in a subprocess and names a crash in its init, a missing symbol or dependency, a wrong ABI
/// or a bad descriptor (it does not call the kernels). See ``opbridge/plugin.h``.
///
/// Raises:
///     OpBridgeError: the file is missing or not a shared library, does not export
///         ``opbridge_plugin_init``, is truncated (its headers point past its end), was built for
///         another plugin ABI version, declares a
///         malformed operator, or an operator's name + version is registered already. Nothing
///         of the library stays registered then.
#[pyfunction]
pub fn load_library(py: Python<'_>, path: PathBuf) -> PyResult<PyLibrary> {
    PyLibrary::load(py, path)
}
