//! Safe views of the `DLTensor`s a kernel receives: typed slices where the memory is contiguous,
//! a strided iterator where it is not. Every accessor checks the dtype first.
#![allow(unsafe_code)] // views over the raw `DLTensor` memory; see the SAFETY notes

use std::borrow::Cow;
use std::marker::PhantomData;

use crate::{sys, DType, Error, Result};

mod sealed {
    pub trait Sealed {}
}

/// Rust types that match an opbridge dtype (float16 has none: read it as raw bytes if needed).
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:expr),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
        }
    )*};
}
element!(f32 => DType::F32, f64 => DType::F64, i32 => DType::I32, i64 => DType::I64);

/// Layout shared by input and output views. The shape and strides are borrowed from the
/// host's arrays (alive for the call), so a view is a few words: building one per tensor per
/// call copies and allocates nothing.
#[derive(Debug)]
struct Layout<'a> {
    data: *mut u8,
    dtype: DType,
    shape: &'a [usize],
    /// Owned only when a host passes no strides (C-contiguous then).
    strides: Cow<'a, [isize]>,
}

// DLPack's extents and strides are `int64_t`; on 64-bit targets they are borrowed as
// `usize`/`isize` slices in place.
const _: () = assert!(std::mem::size_of::<usize>() == 8, "opbridge plugins need a 64-bit target");

impl<'a> Layout<'a> {
    /// # Safety
    /// `t` describes a CPU tensor whose `shape` (and `strides`, if non-null) hold `ndim` entries
    /// that stay valid and unchanged for `'a`.
    unsafe fn from_dl(t: &sys::DLTensor) -> Result<Layout<'a>> {
        let dtype = DType::from_dl(t.dtype).ok_or_else(|| {
            Error::dtype(format!("unsupported element type (code {}, bits {})", t.dtype.code, t.dtype.bits))
        })?;
        let ndim = usize::try_from(t.ndim)
            .ok()
            .filter(|&n| n <= sys::OPB_MAX_NDIM)
            .ok_or_else(|| Error::failed(format!("ndim {} out of range", t.ndim)))?;
        if ndim > 0 && t.shape.is_null() {
            return Err(Error::failed("tensor without a shape"));
        }
        let shape: &'a [usize] = match ndim {
            0 => &[],
            // SAFETY: the caller's obligation: `ndim` entries alive for `'a`; `i64` and `usize`
            // have one size and alignment (asserted above) and every bit pattern is a `usize`.
            _ => unsafe { std::slice::from_raw_parts(t.shape.cast::<usize>(), ndim) },
        };
        if shape.iter().any(|&d| d > isize::MAX as usize) {
            return Err(Error::failed(format!("negative extent in shape {shape:?}")));
        }
        let strides = match (ndim, t.strides.is_null()) {
            (0, _) => Cow::Borrowed(&[][..]),
            (_, true) => Cow::Owned(contiguous_strides(shape)),
            // SAFETY: as for `shape`.
            (_, false) => Cow::Borrowed(unsafe { std::slice::from_raw_parts(t.strides.cast::<isize>(), ndim) }),
        };
        // SAFETY: DLPack's data + byte_offset is the first element.
        let data = unsafe { t.data.cast::<u8>().add(t.byte_offset as usize) };
        Ok(Layout { data, dtype, shape, strides })
    }

    /// A layout from parts (safe to build; what it describes is the callers' claim).
    fn from_parts(data: *mut u8, dtype: DType, shape: &'a [usize], strides: &'a [isize]) -> Result<Layout<'a>> {
        // Any number of dimensions: only the C ABI limits them (to OPB_MAX_NDIM).
        if strides.len() != shape.len() {
            return Err(Error::failed(format!("{} strides for {} dimensions", strides.len(), shape.len())));
        }
        Ok(Layout { data, dtype, shape, strides: Cow::Borrowed(strides) })
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn strides(&self) -> &[isize] {
        &self.strides
    }

    fn ndim(&self) -> usize {
        self.shape.len()
    }

    fn len(&self) -> usize {
        self.shape().iter().product()
    }

    fn is_contiguous(&self) -> bool {
        let mut expected = 1isize;
        for (&d, &s) in self.shape.iter().zip(self.strides.iter()).rev() {
            if d > 1 && s != expected {
                return false;
            }
            expected *= d as isize;
        }
        true
    }

    fn check<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::dtype(format!("tensor of dtype {} read as {}", self.dtype, T::DTYPE)));
        }
        Ok(())
    }

    /// Whether the elements can be a `&[T]`: contiguous and aligned.
    fn sliceable<T: Element>(&self) -> bool {
        self.is_contiguous() && (self.data as usize).is_multiple_of(std::mem::align_of::<T>())
    }
}

/// C-order strides (in elements) of `shape`.
fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut stride = 1isize;
    for d in (0..shape.len()).rev() {
        strides[d] = stride;
        stride *= shape[d].max(1) as isize;
    }
    strides
}

/// A read-only input tensor.
#[derive(Debug)]
pub struct Tensor<'a> {
    layout: Layout<'a>,
    _memory: PhantomData<&'a [u8]>,
}

// SAFETY: a `Tensor` is a shared view of memory nobody writes during the call (the ABI's
// contract; an in-place operator's output may be the same memory, and `InPlace::new` makes
// its author promise not to read the input through references while writing it); reading it
// from several threads is sound.
unsafe impl Send for Tensor<'_> {}
// SAFETY: as for `Send`.
unsafe impl Sync for Tensor<'_> {}

impl<'a> Tensor<'a> {
    /// # Safety
    /// `t` is an input the host passed to the kernel: readable, unchanged for `'a`.
    pub(crate) unsafe fn from_dl(t: &sys::DLTensor) -> Result<Tensor<'a>> {
        // SAFETY: the caller's obligations.
        Ok(Tensor { layout: unsafe { Layout::from_dl(t) }?, _memory: PhantomData })
    }

    /// A view of memory a host holds (for hosts that call an [`Op`](crate::Op) in-process).
    ///
    /// # Safety
    /// `data` is element 0 of a tensor of `dtype` with this shape and these strides (in
    /// elements), readable and unchanged for `'a`.
    pub unsafe fn from_raw_parts(
        data: *const u8,
        dtype: DType,
        shape: &'a [usize],
        strides: &'a [isize],
    ) -> Result<Tensor<'a>> {
        Ok(Tensor { layout: Layout::from_parts(data.cast_mut(), dtype, shape, strides)?, _memory: PhantomData })
    }

    /// Address of element 0 (for kernels that work on raw memory).
    pub fn as_ptr(&self) -> *const u8 {
        self.layout.data
    }

    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }

    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// Strides in elements (0 for broadcast dimensions, negative for reversed ones).
    pub fn strides(&self) -> &[isize] {
        self.layout.strides()
    }

    pub fn ndim(&self) -> usize {
        self.layout.ndim()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.layout.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The elements as a slice, in C order: only for a contiguous tensor of element type `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        self.layout.check::<T>()?;
        if !self.layout.sliceable::<T>() {
            return Err(Error::invalid_argument("tensor is not contiguous and aligned; use values()"));
        }
        if self.is_empty() {
            return Ok(&[]);
        }
        // SAFETY: a contiguous tensor of `len` elements of `T` (dtype checked), readable for 'a.
        Ok(unsafe { std::slice::from_raw_parts(self.layout.data.cast::<T>(), self.len()) })
    }

    /// The elements in C order, for any strides.
    pub fn values<T: Element>(&self) -> Result<Values<'a, T>> {
        self.layout.check::<T>()?;
        if let Ok(slice) = self.as_slice::<T>() {
            return Ok(Values { inner: ValuesInner::Slice(slice.iter()) });
        }
        Ok(Values {
            inner: ValuesInner::Strided(Box::new(Strided {
                data: self.layout.data.cast::<T>(),
                ndim: self.layout.ndim(),
                shape: self.layout.shape().into(),
                strides: self.layout.strides().into(),
                index: vec![0; self.layout.ndim()].into(),
                offset: 0,
                remaining: self.len(),
                _memory: PhantomData,
            })),
        })
    }
}

/// Iterator over a tensor's elements in C order (see [`Tensor::values`]).
#[derive(Debug)]
pub struct Values<'a, T> {
    inner: ValuesInner<'a, T>,
}

#[derive(Debug)]
enum ValuesInner<'a, T> {
    Slice(std::slice::Iter<'a, T>),
    Strided(Box<Strided<'a, T>>),
}

/// The walk over a strided tensor: an index per dimension and the element offset it gives.
#[derive(Debug)]
struct Strided<'a, T> {
    data: *const T,
    ndim: usize,
    shape: Box<[usize]>,
    strides: Box<[isize]>,
    index: Box<[usize]>,
    offset: isize,
    remaining: usize,
    _memory: PhantomData<&'a T>,
}

impl<T: Element> Iterator for Values<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        match &mut self.inner {
            ValuesInner::Slice(it) => it.next().copied(),
            ValuesInner::Strided(walk) => {
                let Strided { data, ndim, shape, strides, index, offset, remaining, .. } = &mut **walk;
                if *remaining == 0 {
                    return None;
                }
                // SAFETY: `offset` is the element at `index`, inside the tensor (the host's
                // shape/strides describe readable memory).
                let value = unsafe { data.offset(*offset).read_unaligned() };
                *remaining -= 1;
                for d in (0..*ndim).rev() {
                    index[d] += 1;
                    *offset += strides[d];
                    if index[d] < shape[d] {
                        break;
                    }
                    *offset -= strides[d] * shape[d] as isize;
                    index[d] = 0;
                }
                Some(value)
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match &self.inner {
            ValuesInner::Slice(it) => it.len(),
            ValuesInner::Strided(walk) => walk.remaining,
        };
        (n, Some(n))
    }
}

impl<T: Element> ExactSizeIterator for Values<'_, T> {}

/// An output tensor: contiguous, written by the kernel.
#[derive(Debug)]
pub struct TensorMut<'a> {
    layout: Layout<'a>,
    _memory: PhantomData<&'a mut [u8]>,
}

// SAFETY: an output is memory only this kernel call writes (the ABI's contract: outputs never
// overlap inputs or each other, except an in-place operator's, see `InPlace::new`), so moving
// or sharing the view between threads is sound.
unsafe impl Send for TensorMut<'_> {}
// SAFETY: as for `Send`; writing needs `&mut self`.
unsafe impl Sync for TensorMut<'_> {}

impl<'a> TensorMut<'a> {
    /// # Safety
    /// `t` is an output the host passed to the kernel: writable, used by nobody else for `'a`.
    pub(crate) unsafe fn from_dl(t: &sys::DLTensor) -> Result<TensorMut<'a>> {
        // SAFETY: the caller's obligations.
        Ok(TensorMut { layout: unsafe { Layout::from_dl(t) }?, _memory: PhantomData })
    }

    /// A view of memory a host holds (for hosts that call an [`Op`](crate::Op) in-process).
    ///
    /// # Safety
    /// `data` is element 0 of a C-contiguous tensor of `dtype` and this shape, writable for
    /// `'a` and not written by anyone else meanwhile (except as [`InPlace`](crate::InPlace) allows).
    pub unsafe fn from_raw_parts(
        data: *mut u8,
        dtype: DType,
        shape: &'a [usize],
        strides: &'a [isize],
    ) -> Result<TensorMut<'a>> {
        Ok(TensorMut { layout: Layout::from_parts(data, dtype, shape, strides)?, _memory: PhantomData })
    }

    /// Address of element 0 (for kernels that work on raw memory).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.layout.data
    }

    /// Strides in elements (C-contiguous).
    pub fn strides(&self) -> &[isize] {
        self.layout.strides()
    }

    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }

    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    pub fn len(&self) -> usize {
        self.layout.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements, in C order, to write.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.layout.check::<T>()?;
        if !self.layout.sliceable::<T>() {
            return Err(Error::failed("output is not contiguous and aligned (the host breaks the ABI)"));
        }
        if self.is_empty() {
            return Ok(&mut []);
        }
        // SAFETY: a contiguous, exclusively ours block of `len` elements of `T` (dtype checked).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.layout.data.cast::<T>(), self.len()) })
    }
}
