//! Strided gather into contiguous memory (`contiguous()`, DLPack inputs with strides).
#![allow(unsafe_code)]

/// Copies the elements of a strided view into row-major contiguous `dst`.
///
/// # Safety
/// Every element `src + sum(i_k * strides[k]) * elem` for indices inside `shape` is valid to
/// read; `dst` holds `prod(shape) * elem` writable bytes not overlapping the source.
pub unsafe fn gather(src: *const u8, shape: &[usize], strides: &[isize], elem: usize, dst: *mut u8) {
    let n: usize = shape.iter().product();
    if n == 0 {
        return;
    }
    let mut index = vec![0usize; shape.len()];
    let mut offset = 0isize; // in elements, relative to src
    for i in 0..n {
        // SAFETY: `offset` always designates an element inside the view (caller's contract),
        // and `i < n` stays inside `dst`.
        unsafe {
            std::ptr::copy_nonoverlapping(src.offset(offset * elem as isize), dst.add(i * elem), elem);
        }
        // Advance the multi-index like an odometer, keeping `offset` in step.
        for axis in (0..shape.len()).rev() {
            index[axis] += 1;
            offset += strides[axis];
            if index[axis] < shape[axis] {
                break;
            }
            offset -= strides[axis] * shape[axis] as isize;
            index[axis] = 0;
        }
    }
}
