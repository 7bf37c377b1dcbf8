//! Vectorcall (PEP 590) for `Op` objects, so `ob.ops.add(a, b)` is called the way CPython calls
//! its own functions.
//!
//! PyO3 implements a class's `__call__` through `tp_call` only (pyo3#4252), so CPython packs
//! every call's positional arguments into a new tuple (and keywords into a new dict) and PyO3
//! unpacks them again: about a fifth of a 1K `ob.ops.add`. Vectorcall passes the caller's
//! argument array instead. A type opts in with two fields PEP 590 defines, the
//! `Py_TPFLAGS_HAVE_VECTORCALL` flag and `tp_vectorcall_offset` (where each instance keeps its
//! vectorcall function); PyO3 cannot declare them and, under the stable ABI we build for, the
//! type object is opaque. So [`enable`] writes them after checking the type object's layout
//! against three fields the stable ABI can read (`tp_dealloc`, `tp_call`, `tp_flags`): a layout
//! it does not recognise (a debug build of Python, say) keeps `tp_call`, which stays correct.
//!
//! A type's [`FastCall`] serves the calls its fast lanes take (positional arrays, at most
//! `out=`), straight from the argument array; any other call goes to the type's own `tp_call`,
//! exactly as before. The type is made immutable too (see `IMMUTABLE_TYPE`).

use std::ffi::c_void;
use std::os::raw::c_ulong;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::ffi;
use pyo3::panic::PanicException;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple, PyType};

/// The signature PEP 590 gives an instance's vectorcall function.
pub type VectorcallFn = ffi::vectorcallfunc;

/// A callable type's fast path: serves a call with positional arguments and at most `out=` (a
/// Python `None` there arrives as `None`), or declines it (`Ok(None)`) for `tp_call` to make.
pub trait FastCall {
    fn fast_call<'py>(
        callable: &Bound<'py, PyAny>,
        args: &[Bound<'py, PyAny>],
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>>;
}

/// The vectorcall function of a type whose fast path is `T`'s: what each instance keeps.
pub fn function<T: FastCall>() -> VectorcallFn {
    trampoline::<T>
}

unsafe extern "C" fn trampoline<T: FastCall>(
    callable: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargsf: usize,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: CPython calls a vectorcall function with exactly `call`'s contract.
    unsafe { call::<T>(callable, args, nargsf, kwnames) }
}

/// Byte offsets in CPython's `PyTypeObject` (3.10 to 3.14, 64-bit, release builds): a
/// `PyVarObject` header of three words, then `tp_name`, `tp_basicsize`, `tp_itemsize`,
/// `tp_dealloc`, `tp_vectorcall_offset`, ... `tp_call` (the 14th slot), ... `tp_flags`.
const BASICSIZE: usize = 32;
const DEALLOC: usize = 48;
const VECTORCALL_OFFSET: usize = 56;
const CALL: usize = 128;
const FLAGS: usize = 168;
/// `Py_TPFLAGS_HAVE_VECTORCALL` (PEP 590; in the stable ABI from 3.12 only).
const HAVE_VECTORCALL: c_ulong = 1 << 11;
/// `Py_TPFLAGS_IMMUTABLETYPE` (3.10+): the type's attributes cannot be reassigned. Before 3.12
/// CPython kept calling the vectorcall function after `Type.__call__ = f` (a patch that would
/// silently miss most calls); immutable, the assignment raises `TypeError` instead, as for
/// the built-in types.
const IMMUTABLE_TYPE: c_ulong = 1 << 8;

/// Gives `ty` vectorcall, and makes it immutable: each instance keeps its function
/// `field_offset` bytes from its start.
/// Returns false, changing nothing, when the type object's layout is not the one above, the
/// offset is outside the instance, or the type has vectorcall already.
pub fn enable(ty: &Bound<'_, PyType>, field_offset: usize) -> bool {
    if cfg!(not(target_pointer_width = "64")) {
        return false;
    }
    let raw = ty.as_type_ptr();
    let base = raw.cast::<u8>();
    // SAFETY: `raw` is a live type object (held by `ty`) of at least `FLAGS + 8` bytes on
    // every CPython this builds for; the reads are plain word reads of its memory, compared
    // with what the stable ABI's getters return before anything is written. The GIL is held.
    unsafe {
        let word = |at: usize| base.add(at).cast::<usize>().read();
        let dealloc = ffi::PyType_GetSlot(raw, ffi::Py_tp_dealloc) as usize;
        let call = ffi::PyType_GetSlot(raw, ffi::Py_tp_call) as usize;
        let flags = ffi::PyType_GetFlags(raw);
        let layout_known = dealloc != 0
            && call != 0
            && word(DEALLOC) == dealloc
            && word(CALL) == call
            && base.add(FLAGS).cast::<c_ulong>().read() == flags
            && word(VECTORCALL_OFFSET) == 0
            && flags & HAVE_VECTORCALL == 0;
        let fits = field_offset >= 2 * std::mem::size_of::<usize>()
            && field_offset + std::mem::size_of::<VectorcallFn>() <= word(BASICSIZE);
        if !(layout_known && fits) {
            return false;
        }
        base.add(VECTORCALL_OFFSET).cast::<isize>().write(field_offset as isize);
        base.add(FLAGS).cast::<c_ulong>().write(flags | HAVE_VECTORCALL | IMMUTABLE_TYPE);
    }
    true
}

/// The body of an instance's vectorcall function: `T` serves the call or declines it, and a
/// declined call goes through the type's `tp_call` with a tuple and a dict, as without
/// vectorcall. Panics become `PanicException`s, as in PyO3's own trampolines.
///
/// # Safety
/// The arguments are those CPython passes a vectorcall function: `callable` a live object,
/// `args` `nargs + len(kwnames)` live objects, `kwnames` NULL or a tuple of str; the GIL held.
unsafe fn call<T: FastCall>(
    callable: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargsf: usize,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // PY_VECTORCALL_ARGUMENTS_OFFSET, the top bit: the caller lets us borrow args[-1].
    let nargs = nargsf & !(1usize << (usize::BITS - 1));
    // SAFETY: per this function's contract the GIL is held and every pointer is live for the call.
    let result = catch_unwind(AssertUnwindSafe(|| unsafe {
        let py = Python::assume_attached();
        let callable = Bound::ref_from_ptr(py, &callable);
        let kwnames = (!kwnames.is_null()).then(|| Bound::ref_from_ptr(py, &kwnames).cast_unchecked::<PyTuple>());
        let n_keywords = kwnames.map_or(0, |k| k.len());
        // `Bound<PyAny>` is layout-compatible with `*mut PyObject` (PyO3's `ref_from_ptr`);
        // a call without arguments may pass NULL, which no slice may point at.
        let all: &[Bound<'_, PyAny>] = match nargs + n_keywords {
            0 => &[],
            n => std::slice::from_raw_parts(args.cast(), n),
        };
        let (positional, keyword_values) = all.split_at(nargs);
        let out = match kwnames {
            None => None,
            Some(names)
                if n_keywords == 1
                    && names.get_borrowed_item_unchecked(0).cast::<PyString>().is_ok_and(|s| s == "out") =>
            {
                Some(&keyword_values[0]).filter(|out| !out.is_none())
            }
            Some(_) => return through_tp_call(py, callable, positional, kwnames, keyword_values),
        };
        match T::fast_call(callable, positional, out)? {
            Some(result) => Ok(result),
            None => through_tp_call(py, callable, positional, kwnames, keyword_values),
        }
    }));
    // SAFETY: still under the GIL, which CPython holds for the whole call.
    let py = unsafe { Python::assume_attached() };
    match result {
        Ok(Ok(value)) => value.into_ptr(),
        Ok(Err(err)) => {
            err.restore(py);
            std::ptr::null_mut()
        }
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("panic in Op call");
            PanicException::new_err(message.to_string()).restore(py);
            std::ptr::null_mut()
        }
    }
}

/// The call as CPython makes it without vectorcall: positional arguments in a tuple, keywords in
/// a dict, handed to the type's `tp_call` (PyO3's `__call__`). Not `PyObject_Call`, which would
/// come back here through vectorcall.
fn through_tp_call<'py>(
    py: Python<'py>,
    callable: &Bound<'py, PyAny>,
    positional: &[Bound<'py, PyAny>],
    kwnames: Option<&Bound<'py, PyTuple>>,
    keyword_values: &[Bound<'py, PyAny>],
) -> PyResult<Bound<'py, PyAny>> {
    let tuple = PyTuple::new(py, positional)?;
    let dict = match kwnames {
        Some(names) => {
            let dict = PyDict::new(py);
            for (name, value) in names.iter().zip(keyword_values) {
                dict.set_item(name, value)?;
            }
            Some(dict)
        }
        None => None,
    };
    let kwargs = dict.as_ref().map_or(std::ptr::null_mut(), |d| d.as_ptr());
    // SAFETY: the slot of a live type, read under the GIL; `tp_call` takes a callable of that
    // type, a tuple and a dict or NULL, and returns a new reference or NULL with an exception set.
    unsafe {
        let slot: *mut c_void = ffi::PyType_GetSlot(callable.get_type().as_type_ptr(), ffi::Py_tp_call);
        if slot.is_null() {
            return Err(pyo3::exceptions::PyTypeError::new_err("object is not callable"));
        }
        let tp_call: ffi::ternaryfunc = std::mem::transmute(slot);
        Bound::from_owned_ptr_or_err(py, tp_call(callable.as_ptr(), tuple.as_ptr(), kwargs))
    }
}
