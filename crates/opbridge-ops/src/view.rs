//! What every CPU kernel sees, built-in or plugin: a DLPack-style view of host memory (address,
//! dtype, shape, strides in elements). Views carry no lifetime: whoever builds one guarantees the
//! memory outlives the kernel call (the numpy path holds the arrays, streams hold pool blocks).

use opbridge_runtime::{DType, Tensor};
use smallvec::SmallVec;

/// A shape: inline up to 6 dimensions, so describing a call allocates nothing in the usual case.
pub type Dims = SmallVec<[usize; 6]>;
/// Strides in elements, inline like [`Dims`].
pub type Strides = SmallVec<[isize; 6]>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView {
    /// Address of element 0 (inside a host allocation).
    pub data: usize,
    pub dtype: DType,
    pub shape: Dims,
    /// Strides in elements; may be 0 (broadcast) or negative (reversed views).
    pub strides: Strides,
}

impl TensorView {
    /// A C-contiguous view.
    pub fn contiguous(data: usize, dtype: DType, shape: &[usize]) -> TensorView {
        // Row-major strides built in place (no heap list on the small-call path).
        let mut strides: Strides = smallvec::smallvec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1].max(1) as isize;
        }
        TensorView { data, dtype, shape: shape.into(), strides }
    }

    /// The view of a tensor's memory (host-accessible devices only).
    pub fn of_tensor(t: &Tensor) -> TensorView {
        TensorView { data: t.data_ptr().0, dtype: t.dtype(), shape: t.shape().into(), strides: t.strides().into() }
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Row-major with no gaps (size-1 dimensions may have any stride; an empty view always is,
    /// as numpy says of empty arrays).
    pub fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        if self.shape.len() != self.strides.len() {
            return false;
        }
        // Row-major strides from the innermost dimension out, compared as they are made (no
        // list per call: this runs on every call's outputs).
        let mut expected = 1isize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d > 1 && s != expected {
                return false;
            }
            expected *= d.max(1) as isize;
        }
        true
    }

    /// The byte range `[start, start + len)` the view's elements span (for aliasing checks).
    pub fn byte_span(&self) -> (usize, usize) {
        if self.numel() == 0 {
            return (self.data, 0);
        }
        let size = self.dtype.size() as isize;
        let (mut low, mut high) = (0isize, 0isize);
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            let reach = (d as isize - 1) * s;
            if reach < 0 {
                low += reach;
            } else {
                high += reach;
            }
        }
        let start = self.data as isize + low * size;
        (start as usize, ((high - low + 1) * size) as usize)
    }
}

/// How two byte ranges `[start, start + len)` relate, for `out=` aliasing checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    Disjoint,
    /// Same start and length: an exact alias (in-place work is fine).
    Same,
    Partial,
}

pub fn overlap(a: (usize, usize), b: (usize, usize)) -> Overlap {
    if a.1 == 0 || b.1 == 0 || a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0 {
        Overlap::Disjoint
    } else if a == b {
        Overlap::Same
    } else {
        Overlap::Partial
    }
}
