//! numpy broadcasting and the N-operand strided loop every elementwise kernel runs on.
//!
//! [`StridedLoop`] prepares a walk over views of one common shape the way numpy's iterator does:
//! size-1 dimensions are dropped, dimensions every operand walks backwards are flipped, axes are
//! ordered by the first operand's strides (the output's, so writes run forward), and adjacent
//! dimensions that every operand lays out alike are merged. What is left is an outer odometer
//! and an inner 1-D run with per-operand strides; runs whose strides are all 1 become slices
//! handed to AVX2-multiversioned loops, so the compiler vectorizes them.
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::error::KernelError;
use crate::view::TensorView;

/// Elements per parallel task never go below this (memory-bound work gains nothing from finer
/// splits, and every task pays for its odometer set-up).
const MIN_PARALLEL_CHUNK: usize = 1 << 14;

/// `(3, 4)`, `(5,)`, `()`: shapes the way numpy prints them.
pub fn shape_str(shape: &[usize]) -> String {
    match shape {
        [d] => format!("({d},)"),
        _ => format!("({})", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// The shape numpy broadcasts `shapes` to: aligned from the right, each dimension equal or 1.
pub fn broadcast_shapes(shapes: &[&[usize]]) -> Result<Vec<usize>, KernelError> {
    let ndim = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = vec![1usize; ndim];
    // `owner[i]`: which input set `out[i]` (to name it in the error).
    let mut owner = vec![usize::MAX; ndim];
    for (which, shape) in shapes.iter().enumerate() {
        let lead = ndim - shape.len();
        for (axis, &d) in shape.iter().enumerate() {
            let i = lead + axis;
            if d == 1 || d == out[i] {
                continue;
            }
            if out[i] == 1 {
                out[i] = d;
                owner[i] = which;
            } else {
                return Err(KernelError::Broadcast {
                    shapes: [shapes[owner[i]].to_vec(), shape.to_vec()],
                    dim: i as isize - ndim as isize,
                    sizes: [out[i], d],
                });
            }
        }
    }
    Ok(out)
}

/// `view` broadcast to `shape`: new leading dimensions and stretched size-1 dimensions get
/// stride 0. Errors when `view.shape` does not broadcast to `shape` (numpy's
/// `np.broadcast_to` rule: only size-1 dimensions stretch, and `shape` has at least as many
/// dimensions).
pub fn try_broadcast_view(view: &TensorView, shape: &[usize]) -> Result<TensorView, KernelError> {
    if view.shape.as_slice() == shape {
        return Ok(view.clone());
    }
    let fail = || KernelError::BroadcastTo { from: view.shape.to_vec(), to: shape.to_vec() };
    let Some(lead) = shape.len().checked_sub(view.ndim()) else {
        return Err(fail());
    };
    let mut strides = vec![0isize; shape.len()];
    for (axis, (&d, &s)) in view.shape.iter().zip(&view.strides).enumerate() {
        let target = shape[lead + axis];
        if d == target {
            strides[lead + axis] = s;
        } else if d != 1 {
            return Err(fail());
        }
    }
    Ok(TensorView { data: view.data, dtype: view.dtype, shape: shape.into(), strides: strides.into() })
}

/// `view` broadcast to `shape` (stride 0 on broadcast dimensions).
///
/// # Panics
/// When `view.shape` does not broadcast to `shape`; check with [`broadcast_shapes`] first or
/// use [`try_broadcast_view`].
pub fn broadcast_view(view: &TensorView, shape: &[usize]) -> TensorView {
    try_broadcast_view(view, shape).unwrap_or_else(|e| panic!("broadcast_view: {e}"))
}

/// How an output view relates to an input view: the aliasing contract of the elementwise
/// kernels (`binary`, `unary`, `cast_view`) in one test for the dispatch layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewOverlap {
    /// No byte in common.
    Disjoint,
    /// The same elements at the same indices (same address and dtype, equal strides on every
    /// dimension of size > 1 once the input is broadcast to the output's shape): in-place
    /// elementwise work is fine.
    Exact,
    /// Shares bytes otherwise: a transposed, shifted or broadcast view of the output, or
    /// interleaved views (which this conservative byte-range test cannot tell from real
    /// overlap). Copy the input first. Note that equal byte spans do not imply `Exact`: `x.T`
    /// spans the same bytes as `x`.
    Partial,
}

/// Classifies `input` against `out` (see [`ViewOverlap`]).
pub fn view_overlap(out: &TensorView, input: &TensorView) -> ViewOverlap {
    let (o, i) = (out.byte_span(), input.byte_span());
    if out.numel() == 0 || input.numel() == 0 || o.1 == 0 || i.1 == 0 || o.0 + o.1 <= i.0 || i.0 + i.1 <= o.0 {
        return ViewOverlap::Disjoint;
    }
    let exact = input.dtype == out.dtype
        && input.data == out.data
        && try_broadcast_view(input, &out.shape).is_ok_and(|b| {
            out.shape.iter().zip(out.strides.iter().zip(&b.strides)).all(|(&d, (&so, &si))| d <= 1 || so == si)
        });
    if exact {
        ViewOverlap::Exact
    } else {
        ViewOverlap::Partial
    }
}

/// Per-operand element strides of one dimension.
type Strides<const N: usize> = [isize; N];

type Dims<const N: usize> = smallvec::SmallVec<[(usize, Strides<N>); 6]>;

/// A prepared walk over `N` views of one shape (see the module docs). Operand 0 decides the
/// axis order: pass the output first. Addresses are plain `usize` so the loop is `Send`.
#[derive(Debug, Clone)]
pub struct StridedLoop<const N: usize> {
    /// Byte address of each operand's first visited element (after flips).
    base: [usize; N],
    /// Element size of each operand in bytes.
    elem: [usize; N],
    /// Collapsed dimensions, outer to inner: size and per-operand strides in elements. Empty
    /// when there is at most one element. Inline: preparing a walk allocates nothing.
    dims: Dims<N>,
    numel: usize,
}

impl<const N: usize> StridedLoop<N> {
    /// Prepares the walk.
    ///
    /// # Panics
    /// When the views' shapes differ (broadcast them first) or a view's strides do not match
    /// its shape's length.
    pub fn new(views: [&TensorView; N]) -> StridedLoop<N> {
        let shape = &views[0].shape;
        for v in &views {
            assert_eq!(&v.shape, shape, "StridedLoop: operands must share one shape");
            assert_eq!(v.strides.len(), v.shape.len(), "StridedLoop: strides do not match the shape");
        }
        let numel = shape.iter().product();
        let mut base = views.map(|v| v.data);
        let elem = views.map(|v| v.dtype.size());
        let mut dims: Dims<N> = Dims::new();
        if numel > 1 && views.iter().all(|v| v.is_contiguous()) {
            // The common case: every operand is one contiguous run.
            dims.push((numel, [1; N]));
        } else if numel > 1 {
            for (axis, &d) in shape.iter().enumerate() {
                if d == 1 {
                    continue;
                }
                let mut st: Strides<N> = std::array::from_fn(|k| views[k].strides[axis]);
                if st.iter().all(|&s| s <= 0) && st.iter().any(|&s| s < 0) {
                    // Every operand walks this axis backwards: walk it forwards from the other end.
                    for k in 0..N {
                        base[k] = base[k].wrapping_add_signed((d as isize - 1) * st[k] * elem[k] as isize);
                        st[k] = -st[k];
                    }
                }
                dims.push((d, st));
            }
            // Outer axes first by operand 0's stride; stable, so C order stays as it is.
            dims.sort_by_key(|&(_, st)| std::cmp::Reverse(st[0].unsigned_abs()));
            let mut merged: Dims<N> = Dims::new();
            for (d, st) in dims {
                if let Some((outer_d, outer_st)) = merged.last_mut() {
                    if (0..N).all(|k| outer_st[k] == st[k] * d as isize) {
                        *outer_d *= d;
                        *outer_st = st;
                        continue;
                    }
                }
                merged.push((d, st));
            }
            dims = merged;
        }
        StridedLoop { base, elem, dims, numel }
    }

    /// `len` elements of C-contiguous operands of one shape, with no views to analyze (the
    /// elementwise fast lane). `elem` is each operand's element size in bytes.
    pub fn flat(base: [usize; N], elem: [usize; N], len: usize) -> StridedLoop<N> {
        let mut dims: Dims<N> = Dims::new();
        if len > 1 {
            dims.push((len, [1; N]));
        }
        StridedLoop { base, elem, dims, numel: len }
    }

    /// Elements visited.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Dimensions left after collapsing (0 for at most one element).
    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    /// Length of the inner run (the whole loop when it collapsed to one dimension).
    pub fn inner_len(&self) -> usize {
        self.dims.last().map_or(self.numel, |&(d, _)| d)
    }

    fn address(&self, k: usize, offset: isize) -> usize {
        self.base[k].wrapping_add_signed(offset * self.elem[k] as isize)
    }

    /// Calls `f(addresses, inner_strides, len)` for each inner run covering positions
    /// `start..end` of the walk (positions count in the loop's own order), `len >= 1`.
    /// Addresses are of each operand's first element in the run; strides are in elements.
    pub fn for_each_run(&self, start: usize, end: usize, mut f: impl FnMut([usize; N], Strides<N>, usize)) {
        let end = end.min(self.numel);
        if start >= end {
            return;
        }
        let nd = self.dims.len();
        if nd == 0 {
            f(self.base, [0; N], 1);
            return;
        }
        let (inner, inner_st) = self.dims[nd - 1];
        if nd == 1 {
            f(std::array::from_fn(|k| self.address(k, start as isize * inner_st[k])), inner_st, end - start);
            return;
        }
        let outer = &self.dims[..nd - 1];
        let mut index = vec![0usize; nd - 1];
        let mut offset = [0isize; N];
        let mut row = start / inner;
        let mut col = start % inner;
        for (axis, &(d, st)) in outer.iter().enumerate().rev() {
            index[axis] = row % d;
            row /= d;
            for k in 0..N {
                offset[k] += index[axis] as isize * st[k];
            }
        }
        let mut pos = start;
        loop {
            let len = (inner - col).min(end - pos);
            f(std::array::from_fn(|k| self.address(k, offset[k] + col as isize * inner_st[k])), inner_st, len);
            pos += len;
            if pos >= end {
                return;
            }
            col = 0;
            // Next row: advance the outer multi-index like an odometer, offsets in step.
            for (axis, &(d, st)) in outer.iter().enumerate().rev() {
                index[axis] += 1;
                for k in 0..N {
                    offset[k] += st[k];
                }
                if index[axis] < d {
                    break;
                }
                for k in 0..N {
                    offset[k] -= st[k] * d as isize;
                }
                index[axis] = 0;
            }
        }
    }

    /// The whole walk: on the calling thread below `parallel_min` elements, otherwise split into
    /// contiguous position ranges across the rayon pool (a few per thread). `f` must tolerate
    /// concurrent calls on disjoint runs.
    pub fn run(&self, parallel_min: usize, f: impl Fn([usize; N], Strides<N>, usize) + Sync) {
        let n = self.numel;
        // Small walks (the usual call) decide without asking rayon for its pool.
        if n < parallel_min {
            self.for_each_run(0, n, f);
            return;
        }
        super::pool::install(|| {
            let threads = rayon::current_num_threads();
            if threads < 2 {
                self.for_each_run(0, n, &f);
                return;
            }
            let chunk = n.div_ceil(threads * 4).max(MIN_PARALLEL_CHUNK);
            (0..n.div_ceil(chunk)).into_par_iter().for_each(|task| {
                let start = task * chunk;
                self.for_each_run(start, start + chunk, &f);
            });
        });
    }
}

/// Defines `pub(crate) fn $name` over an `#[inline(always)]` body compiled for the x86_64
/// baseline, AVX2 and AVX-512, picked at run time (as `reduce::avx2_multiversion!` does, with
/// any generics and bounds). AVX-512 halves the instructions of a cache-resident 1K add.
macro_rules! multiversion {
    ($(#[$m:meta])* fn $name:ident<$($g:ident),*>($($arg:ident: $ty:ty),*) where [$($w:tt)*] $body:block) => {
        $(#[$m])*
        pub(crate) fn $name<$($g),*>($($arg: $ty),*) where $($w)* {
            #[inline(always)]
            fn body<$($g),*>($($arg: $ty),*) where $($w)* $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2")]
                fn avx512<$($g),*>($($arg: $ty),*) where $($w)* {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2<$($g),*>($($arg: $ty),*) where $($w)* {
                    body($($arg),*)
                }
                use std::arch::is_x86_feature_detected as has;
                if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") {
                    // SAFETY: the CPU supports these features (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if has!("avx2") {
                    // SAFETY: the CPU supports AVX2 (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

multiversion!(
    /// `out[i] = f(x[i])`.
    fn map1<S, D, F>(x: &[S], out: &mut [D], f: F) where [S: Copy, D: Copy, F: Fn(S) -> D] {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = f(v);
        }
    }
);

multiversion!(
    /// `inout[i] = f(inout[i])`.
    fn map1_in_place<T, F>(inout: &mut [T], f: F) where [T: Copy, F: Fn(T) -> T] {
        for o in inout.iter_mut() {
            *o = f(*o);
        }
    }
);

multiversion!(
    /// `out[i] = f(a[i], b[i])`.
    fn map2<T, F>(a: &[T], b: &[T], out: &mut [T], f: F) where [T: Copy, F: Fn(T, T) -> T] {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
    }
);

multiversion!(
    /// `inout[i] = f(inout[i], other[i])`.
    fn map2_in_place<T, F>(inout: &mut [T], other: &[T], f: F) where [T: Copy, F: Fn(T, T) -> T] {
        for (o, &y) in inout.iter_mut().zip(other) {
            *o = f(*o, y);
        }
    }
);

/// # Safety
/// `addr` is the aligned address of `len` readable elements of `T`, not written during the
/// borrow.
unsafe fn slice<'a, T>(addr: usize, len: usize) -> &'a [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(addr as *const T, len) }
}

/// # Safety
/// `addr` is the aligned address of `len` writable elements of `T`, accessed by nothing else
/// during the borrow.
unsafe fn slice_mut<'a, T>(addr: usize, len: usize) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut T, len) }
}

/// One run of `out = f(x)` where input and output may have different types: contiguous runs
/// go through the vectorized [`map1`], a broadcast input fills, anything else loops on strides.
///
/// # Safety
/// For `i < len`, `x + i * s[1]` (elements of `S`) is readable and `out + i * s[0]` (elements
/// of `D`) is writable, all aligned; the output elements are distinct, touched by nothing else
/// during the call and do not overlap the input.
pub(crate) unsafe fn map_run<S: Copy, D: Copy>(p: [usize; 2], s: [isize; 2], len: usize, f: impl Fn(S) -> D) {
    let [out, x] = p;
    // SAFETY: addresses and extents come from the caller's contract; `out` is disjoint from `x`.
    unsafe {
        match s {
            [1, 1] => map1(slice::<S>(x, len), slice_mut::<D>(out, len), f),
            [1, 0] => slice_mut::<D>(out, len).fill(f(*(x as *const S))),
            [so, sx] => {
                let (out, x) = (out as *mut D, x as *const S);
                for i in 0..len as isize {
                    *out.offset(i * so) = f(*x.offset(i * sx));
                }
            }
        }
    }
}

/// One run of `out = f(x)` over one element type, where `out` may be exactly `x` (same address
/// and stride: each element is read before it is written).
///
/// # Safety
/// As for [`map_run`], except that `out` may equal `x` exactly (same address and stride);
/// any other overlap is forbidden.
pub(crate) unsafe fn unary_run<T: Copy>(p: [usize; 2], s: [isize; 2], len: usize, f: impl Fn(T) -> T) {
    let [out, x] = p;
    if out == x && s[0] == s[1] {
        if s[0] == 1 {
            // SAFETY: one mutable slice over the aliased run (caller's contract).
            unsafe { map1_in_place(slice_mut::<T>(out, len), f) };
        } else {
            let ptr = out as *mut T;
            for i in 0..len as isize {
                // SAFETY: inside the run (caller's contract); read then write of one element.
                unsafe { *ptr.offset(i * s[0]) = f(*ptr.offset(i * s[0])) };
            }
        }
    } else {
        // SAFETY: forwarded; not aliased, so disjoint by the caller's contract.
        unsafe { map_run(p, s, len, f) }
    }
}

/// One run of `out = f(a, b)`: contiguous and broadcast-scalar cases go through the vectorized
/// loops (in-place variants when `out` is exactly `a` and/or `b`), anything else loops on
/// strides.
///
/// # Safety
/// For `i < len`, `a + i * s[1]` and `b + i * s[2]` are readable and `out + i * s[0]` writable,
/// all aligned elements of `T`; the output elements are distinct and touched by nothing else
/// during the call; `out` is either disjoint from an input or exactly equal to it (same
/// address and stride).
pub(crate) unsafe fn binary_run<T: Copy>(p: [usize; 3], s: [isize; 3], len: usize, f: impl Fn(T, T) -> T + Copy) {
    let [out, a, b] = p;
    let [so, sa, sb] = s;
    let is_a = out == a && so == sa;
    let is_b = out == b && so == sb;
    // SAFETY: (whole block) addresses and extents come from the caller's contract. Each arm
    // makes at most one mutable slice, over `out`, and shared slices only over inputs that are
    // not `out` (when an input is `out`, the in-place variant reads it through the one slice);
    // scalars from stride-0 inputs are read before the mutable slice exists.
    unsafe {
        match (so, sa, sb) {
            (1, 1, 1) => match (is_a, is_b) {
                (true, true) => map1_in_place(slice_mut::<T>(out, len), |x| f(x, x)),
                (true, false) => map2_in_place(slice_mut::<T>(out, len), slice::<T>(b, len), f),
                (false, true) => map2_in_place(slice_mut::<T>(out, len), slice::<T>(a, len), |cur, x| f(x, cur)),
                (false, false) => map2(slice::<T>(a, len), slice::<T>(b, len), slice_mut::<T>(out, len), f),
            },
            (1, 1, 0) => {
                let y = *(b as *const T);
                if is_a {
                    map1_in_place(slice_mut::<T>(out, len), |x| f(x, y));
                } else {
                    map1(slice::<T>(a, len), slice_mut::<T>(out, len), |x| f(x, y));
                }
            }
            (1, 0, 1) => {
                let x = *(a as *const T);
                if is_b {
                    map1_in_place(slice_mut::<T>(out, len), |y| f(x, y));
                } else {
                    map1(slice::<T>(b, len), slice_mut::<T>(out, len), |y| f(x, y));
                }
            }
            (1, 0, 0) => {
                let v = f(*(a as *const T), *(b as *const T));
                slice_mut::<T>(out, len).fill(v);
            }
            _ => {
                let (out, a, b) = (out as *mut T, a as *const T, b as *const T);
                for i in 0..len as isize {
                    *out.offset(i * so) = f(*a.offset(i * sa), *b.offset(i * sb));
                }
            }
        }
    }
}

/// Whether some dimension of size > 1 has stride 0: such a view names one element several
/// times, so it cannot be written elementwise (and certainly not in parallel).
pub(crate) fn has_repeated_elements(view: &TensorView) -> bool {
    view.numel() > 1 && view.shape.iter().zip(&view.strides).any(|(&d, &s)| d > 1 && s == 0)
}

/// Host memory for test views in every layout the kernels must handle.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::cpu::Element;
    use opbridge_runtime::DType;

    /// How a test view lays out its elements.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Layout {
        Contiguous,
        /// Axes stored in reverse order (numpy's `.T` of a C array).
        Fortran,
        /// C order walked backwards on every axis (`a[::-1, ::-1]`).
        Reversed,
        /// Rows padded: inner stride 1, outer strides larger (a slice of a wider array).
        Padded,
        /// Every stride doubled (`a[::2]`-style), last axis reversed too.
        Stepped,
    }

    pub const LAYOUTS: [Layout; 5] =
        [Layout::Contiguous, Layout::Fortran, Layout::Reversed, Layout::Padded, Layout::Stepped];

    /// Owned storage plus a view into it (the storage's heap block never moves).
    #[derive(Debug)]
    pub struct Owned {
        _buf: Vec<u64>,
        pub view: TensorView,
    }

    pub fn alloc(dtype: DType, shape: &[usize], layout: Layout) -> Owned {
        let nd = shape.len();
        let mut strides = vec![0isize; nd];
        let mut acc = 1isize;
        let order: Vec<usize> = if layout == Layout::Fortran { (0..nd).collect() } else { (0..nd).rev().collect() };
        for (rank, &axis) in order.iter().enumerate() {
            strides[axis] = acc;
            let pad = if layout == Layout::Padded && rank == 0 { 3 } else { 0 };
            acc *= shape[axis].max(1) as isize + pad;
        }
        match layout {
            Layout::Reversed => strides.iter_mut().for_each(|s| *s = -*s),
            Layout::Stepped => {
                strides.iter_mut().for_each(|s| *s *= 2);
                if let Some(last) = strides.last_mut() {
                    *last = -*last;
                }
            }
            _ => {}
        }
        let (mut low, mut high) = (0isize, 0isize);
        for (&d, &s) in shape.iter().zip(&strides) {
            let reach = (d.max(1) as isize - 1) * s;
            if reach < 0 {
                low += reach;
            } else {
                high += reach;
            }
        }
        let bytes = (high - low + 1) as usize * dtype.size();
        let buf = vec![0u64; bytes.div_ceil(8) + 1];
        let data = buf.as_ptr() as usize + (-low) as usize * dtype.size();
        Owned { _buf: buf, view: TensorView { data, dtype, shape: shape.into(), strides: strides.into() } }
    }

    /// Element offsets of `view` in logical (C) order.
    pub fn offsets(view: &TensorView) -> Vec<isize> {
        let n = view.numel();
        let mut out = Vec::with_capacity(n);
        let mut index = vec![0usize; view.ndim()];
        for _ in 0..n {
            out.push(index.iter().zip(&view.strides).map(|(&i, &s)| i as isize * s).sum());
            for axis in (0..view.ndim()).rev() {
                index[axis] += 1;
                if index[axis] < view.shape[axis] {
                    break;
                }
                index[axis] = 0;
            }
        }
        out
    }

    /// Writes `values` (logical order) into the view's elements.
    pub fn fill<T: Element>(view: &TensorView, values: &[T]) {
        assert_eq!(T::DTYPE, view.dtype);
        assert_eq!(values.len(), view.numel());
        for (&off, &v) in offsets(view).iter().zip(values) {
            // SAFETY: test views come from `alloc`, whose storage covers every offset.
            unsafe { *(view.data as *mut T).offset(off) = v };
        }
    }

    /// Reads the view's elements in logical order.
    pub fn read<T: Element>(view: &TensorView) -> Vec<T> {
        assert_eq!(T::DTYPE, view.dtype);
        // SAFETY: as for `fill`.
        offsets(view).iter().map(|&off| unsafe { *(view.data as *const T).offset(off) }).collect()
    }

    /// A view of `shape` in `layout` holding `values`.
    pub fn make<T: Element>(shape: &[usize], layout: Layout, values: &[T]) -> Owned {
        let owned = alloc(T::DTYPE, shape, layout);
        fill(&owned.view, values);
        owned
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use opbridge_runtime::DType;

    #[test]
    fn broadcast_shapes_follow_numpy() {
        let ok: [(&[&[usize]], &[usize]); 8] = [
            (&[&[3, 1, 4], &[1, 5, 1]], &[3, 5, 4]),
            (&[&[], &[4]], &[4]),
            (&[&[], &[]], &[]),
            (&[&[2, 0, 3], &[3]], &[2, 0, 3]),
            (&[&[0], &[1]], &[0]),
            (&[&[8, 1, 6, 1], &[7, 1, 5]], &[8, 7, 6, 5]),
            (&[&[5, 4], &[1], &[4]], &[5, 4]),
            (&[], &[]),
        ];
        for (shapes, want) in ok {
            assert_eq!(broadcast_shapes(shapes).unwrap(), want, "{shapes:?}");
        }
        let err = broadcast_shapes(&[&[3, 4], &[5]]).unwrap_err().to_string();
        assert!(err.contains("(3, 4)") && err.contains("(5,)") && err.contains("4 vs 5"), "{err}");
        assert!(broadcast_shapes(&[&[2, 1], &[8, 4, 3]]).is_err());
        assert!(broadcast_shapes(&[&[0], &[2]]).is_err());
    }

    #[test]
    fn broadcast_view_sets_zero_strides() {
        let v = TensorView {
            data: 64,
            dtype: DType::F32,
            shape: smallvec::smallvec![3, 1],
            strides: smallvec::smallvec![-2, 7],
        };
        let b = broadcast_view(&v, &[2, 3, 4]);
        assert_eq!(b.shape.as_slice(), [2, 3, 4]);
        assert_eq!(b.strides.as_slice(), [0, -2, 0]);
        assert_eq!(b.data, 64);
        assert_eq!(broadcast_view(&v, &[3, 1]), v);
        assert!(try_broadcast_view(&v, &[3, 2, 1]).is_err());
        assert!(try_broadcast_view(&v, &[1]).is_err());
        let scalar = TensorView::contiguous(8, DType::I64, &[]);
        assert_eq!(broadcast_view(&scalar, &[0, 2]).strides.as_slice(), [0, 0]);
    }

    #[test]
    #[should_panic(expected = "cannot be broadcast")]
    fn broadcast_view_panics_on_mismatch() {
        broadcast_view(&TensorView::contiguous(8, DType::F32, &[3]), &[4]);
    }

    #[test]
    fn loop_collapses_and_flips() {
        let c = TensorView::contiguous(0, DType::F32, &[3, 1, 4, 5]);
        let lp = StridedLoop::new([&c, &c]);
        assert_eq!((lp.ndim(), lp.inner_len(), lp.numel()), (1, 60, 60));

        let rev = alloc(DType::F64, &[4, 5], Layout::Reversed).view;
        let lp = StridedLoop::new([&rev]);
        assert_eq!(lp.ndim(), 1);
        let mut runs = vec![];
        lp.for_each_run(0, 20, |p, s, len| runs.push((p, s, len)));
        // Walked forwards from the lowest address.
        assert_eq!(runs, [([rev.data - 19 * 8], [1], 20)]);

        // A broadcast row stays contiguous in the inner dimension, stride 0 outside.
        let out = TensorView::contiguous(0, DType::F32, &[6, 7]);
        let row = broadcast_view(&TensorView::contiguous(1000, DType::F32, &[7]), &[6, 7]);
        let lp = StridedLoop::new([&out, &row]);
        assert_eq!((lp.ndim(), lp.inner_len()), (2, 7));

        // Fortran-ordered output: walked in its memory order.
        let f = alloc(DType::F32, &[3, 4], Layout::Fortran).view;
        let lp = StridedLoop::new([&f, &f]);
        assert_eq!((lp.ndim(), lp.inner_len()), (1, 12));

        let empty = TensorView::contiguous(0, DType::F32, &[2, 0, 3]);
        let lp = StridedLoop::new([&empty]);
        let mut calls = 0;
        lp.for_each_run(0, usize::MAX, |_, _, _| calls += 1);
        assert_eq!((lp.numel(), calls), (0, 0));

        let scalar = TensorView::contiguous(48, DType::F32, &[]);
        let mut runs = vec![];
        StridedLoop::new([&scalar]).for_each_run(0, 1, |p, s, len| runs.push((p, s, len)));
        assert_eq!(runs, [([48], [0], 1)]);
    }

    #[test]
    fn overlap_kinds() {
        let x = alloc(DType::F32, &[4, 4], Layout::Contiguous).view;
        let y = alloc(DType::F32, &[4, 4], Layout::Contiguous).view;
        assert_eq!(view_overlap(&x, &x), ViewOverlap::Exact);
        assert_eq!(view_overlap(&x, &y), ViewOverlap::Disjoint);
        let xt = TensorView { strides: smallvec::smallvec![1, 4], ..x.clone() };
        assert_eq!(view_overlap(&x, &xt), ViewOverlap::Partial);
        // A row of `x` broadcast over it.
        let row = TensorView { shape: smallvec::smallvec![4], strides: smallvec::smallvec![1], ..x.clone() };
        assert_eq!(view_overlap(&x, &row), ViewOverlap::Partial);
        // Size-1 dimensions may carry any stride.
        let col = TensorView { shape: smallvec::smallvec![4, 1], strides: smallvec::smallvec![4, 1], ..x.clone() };
        let col2 = TensorView { strides: smallvec::smallvec![4, 99], ..col.clone() };
        assert_eq!(view_overlap(&col, &col2), ViewOverlap::Exact);
        let as_int = TensorView { dtype: DType::I32, ..x.clone() };
        assert_eq!(view_overlap(&x, &as_int), ViewOverlap::Partial);
        let empty = TensorView { shape: smallvec::smallvec![0, 4], ..x.clone() };
        assert_eq!(view_overlap(&empty, &x), ViewOverlap::Disjoint);
    }

    /// Every position visited once, in runs that partition any range, for every layout.
    #[test]
    fn runs_cover_every_element_once() {
        for layout in LAYOUTS {
            for shape in [&[3usize, 5, 4][..], &[7, 1, 9], &[2, 3, 2, 5], &[11], &[1, 1]] {
                let view = alloc(DType::I32, shape, layout).view;
                let want: Vec<usize> = {
                    let mut v: Vec<usize> =
                        offsets(&view).iter().map(|&o| view.data.wrapping_add_signed(o * 4)).collect();
                    v.sort_unstable();
                    v
                };
                let lp = StridedLoop::new([&view, &view]);
                let n = lp.numel();
                for split in [0, 1, n / 3, n - 1, n] {
                    let mut got = vec![];
                    for (start, end) in [(0, split), (split, n)] {
                        lp.for_each_run(start, end, |p, s, len| {
                            assert_eq!(p[0], p[1]);
                            assert!(len >= 1);
                            got.extend((0..len as isize).map(|i| p[0].wrapping_add_signed(i * s[0] * 4)));
                        });
                    }
                    got.sort_unstable();
                    assert_eq!(got, want, "{layout:?} {shape:?} split {split}");
                }
            }
        }
    }
}
