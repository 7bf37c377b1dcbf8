//! Scratch memory for one kernel call on the host: 64-byte aligned and zeroed (Rust kernels see
//! it as a `&mut [u8]`, which must not cover uninitialized bytes). What `Operator::run_cpu`
//! uses when the caller brings no workspace of its own (dispatch brings one from its allocator).
#![allow(unsafe_code)] // the one raw allocation of a call's scratch bytes.

use std::ffi::c_void;

/// Scratch memory for one kernel call, 64-byte aligned (plugins' and in-process operators').
#[derive(Debug)]
pub(crate) struct Workspace {
    ptr: *mut c_void,
    layout: Option<std::alloc::Layout>,
}

impl Workspace {
    pub fn none() -> Workspace {
        Workspace { ptr: std::ptr::null_mut(), layout: None }
    }

    pub fn new(bytes: usize) -> Option<Workspace> {
        if bytes == 0 {
            return Some(Workspace::none());
        }
        let layout = std::alloc::Layout::from_size_align(bytes, 64).ok()?;
        // Zeroed: Rust kernels (the SDK's, in-process operators) see it as a `&mut [u8]`, which
        // must not cover uninitialized bytes.
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(Workspace { ptr: ptr.cast(), layout: Some(layout) })
    }

    /// The scratch bytes (empty without a workspace).
    pub fn bytes(&mut self) -> &mut [u8] {
        match self.layout {
            // SAFETY: `ptr` is an allocation of `layout.size()` zeroed bytes owned by `self`.
            Some(layout) => unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), layout.size()) },
            None => &mut [],
        }
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.cast(), layout) };
        }
    }
}
