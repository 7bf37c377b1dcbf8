//! What a CPU kernel family reports when it refuses its arguments: a typed error without the
//! operator's name, which the caller attaches once (`OpError::CpuKernel`). Each message is the
//! one the kernels wrote as a string before (numpy's wording where numpy has one); `kind` is
//! the classification front ends map.

use opbridge_runtime::DType;

use super::broadcast::shape_str;
use crate::error::ErrorKind;

/// The gufunc signature of numpy's `matmul`, as its errors print it.
pub(crate) const MATMUL_SIGNATURE: &str = "(n?,k),(k,m?)->(n?,m?)";

/// The message of [`KernelError::NegativeIntPower`] (numpy's).
pub const NEGATIVE_INT_POWER: &str = "Integers to negative integer powers are not allowed.";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    // Shapes (`ErrorKind::Shape`).
    /// An axis outside `-ndim..ndim` (numpy's `AxisError`).
    #[error("axis {axis} is out of bounds for array of dimension {ndim}")]
    Axis { axis: isize, ndim: usize },
    /// Two shapes that do not broadcast together: `dim` (counted from the end) is `sizes[0]`
    /// in `shapes[0]` and `sizes[1]` in `shapes[1]`.
    #[error(
        "shapes {} and {} cannot be broadcast together: dimension {dim} is {} vs {}",
        shape_str(&.shapes[0]), shape_str(&.shapes[1]), .sizes[0], .sizes[1]
    )]
    Broadcast { shapes: [Vec<usize>; 2], dim: isize, sizes: [usize; 2] },
    /// An operand that does not broadcast to the output's shape (`np.broadcast_to`'s rule).
    #[error("an array of shape {} cannot be broadcast to shape {}", shape_str(.from), shape_str(.to))]
    BroadcastTo { from: Vec<usize>, to: Vec<usize> },
    /// A 0-d operand of `matmul` (numpy's gufunc message).
    #[error(
        "Input operand {operand} does not have enough dimensions (has 0, gufunc core with signature \
         {MATMUL_SIGNATURE} requires 1)"
    )]
    MatmulOperandDims { operand: usize },
    /// `matmul` operands whose contracted dimensions differ: `a`'s last, `b`'s (numpy's message).
    #[error(
        "Input operand 1 has a mismatch in its core dimension 0, with gufunc signature {MATMUL_SIGNATURE} \
         (size {b} is different from {a})"
    )]
    MatmulCoreDims { a: usize, b: usize },
    /// `matmul` operands (their whole shapes) whose batch dimensions do not broadcast.
    #[error(
        "batch dimensions {:?} of a (shape {a:?}) and {:?} of b (shape {b:?}) cannot be broadcast together",
        matmul_batch(.a), matmul_batch(.b)
    )]
    MatmulBatch { a: Vec<usize>, b: Vec<usize> },
    /// An operand (`what`) of the wrong shape; `expected` describes the right one.
    #[error("{what} must have shape {expected}, got {got:?}")]
    Shape { what: &'static str, expected: String, got: Vec<usize> },
    /// An operand with the wrong number of dimensions (`expected`: "1-D", ...).
    #[error("{what} must be {expected}, got shape {got:?}")]
    Rank { what: &'static str, expected: &'static str, got: Vec<usize> },
    /// A 0-d operand where the kernel works along the last dimension.
    #[error("{what} must have at least one dimension")]
    NoDimensions { what: &'static str },

    // Dtypes (`ErrorKind::DType`).
    /// An operand (`what`) whose dtype must be that of another operand (`like`).
    #[error("{what} must have dtype {expected} like {like}, got {got}")]
    DTypeMismatch { what: &'static str, expected: DType, like: &'static str, got: DType },
    /// A reduction's output of another dtype than the result dtype for its input.
    #[error("out must have dtype {expected} for {input} input, got {got}")]
    ResultDType { expected: DType, input: DType, got: DType },
    /// A binary kernel's inputs of another dtype than its output.
    #[error("inputs are {a} and {b} but out is {out} (cast the inputs to the result dtype first)")]
    BinaryDTypes { a: DType, b: DType, out: DType },
    /// A unary kernel's input of another dtype than its output.
    #[error("input is {x} but out is {out}")]
    UnaryDTypes { x: DType, out: DType },
    /// `matmul` operands of more than one dtype.
    #[error("a, b and out must share one dtype, got {a}, {b} and {out}")]
    MatmulDTypes { a: DType, b: DType, out: DType },
    /// `axpy` operands of more than one dtype, or of an integer dtype.
    #[error("expected x, y and out of one float dtype, got {x}, {y} and {out}")]
    AxpyDTypes { x: DType, y: DType, out: DType },
    /// An operand (`what`) of a dtype outside `expected` ("int32 or int64", ...).
    #[error("{what} must be {expected}, got {got}")]
    DTypeNotIn { what: &'static str, expected: &'static str, got: DType },
    /// A float-only kernel given another dtype.
    #[error("float16, float32 or float64 input required, got {got}")]
    FloatRequired { got: DType },
    /// A unary `op` without a kernel for the integer `dtype`: the input is cast to `cast_to`
    /// first (numpy's result dtype).
    #[error("{op} has no {dtype} kernel: cast the input to {cast_to} first (numpy's result dtype)")]
    NoKernel { op: &'static str, dtype: DType, cast_to: DType },
    /// `div` on integers (numpy's true division gives float64).
    #[error("div has no {dtype} kernel: numpy's true division gives float64, cast to it first")]
    IntegerDivision { dtype: DType },

    // Values (`ErrorKind::Argument`).
    /// `indices[position] = index` outside the `rows` rows of an embedding table.
    #[error("indices[{position}] = {index} is out of range for weight with {rows} rows (valid: 0..{rows})")]
    IndexOutOfRange { position: usize, index: i64, rows: usize },
    /// Bag offsets that do not start at 0.
    #[error("offsets[0] must be 0, got {got}")]
    OffsetsStart { got: i64 },
    /// `offsets[position] = offset` below the offset before it (`previous`).
    #[error("offsets must not decrease, but offsets[{position}] = {offset} < offsets[{}] = {previous}", .position - 1)]
    OffsetsDecrease { position: usize, offset: i64, previous: i64 },
    /// `offsets[position] = offset` past the `len` indices.
    #[error("offsets[{position}] = {offset} is beyond the end of indices (length {len})")]
    OffsetBeyondEnd { position: usize, offset: i64, len: usize },
    /// Integer `pow` with a negative exponent (numpy's message); nothing was written.
    #[error("{}", NEGATIVE_INT_POWER)]
    NegativeIntPower,
    /// `max`, `min` or `argmax` over nothing; the message is numpy's for that reduction.
    #[error("{0}")]
    EmptyReduction(&'static str),
    /// An output (`what`) with a stride-0 dimension: it would name one element several times.
    #[error("{what} has a stride-0 dimension (it names one element several times)")]
    RepeatedOutput { what: &'static str },
    /// A view whose shape and strides differ in length.
    #[error("{what} has {dims} dims but {strides} strides")]
    MalformedView { what: &'static str, dims: usize, strides: usize },
    /// Scratch memory a kernel needs (an operand copied or widened: a broadcast view's whole
    /// logical size) that cannot be allocated.
    #[error("out of memory: cannot allocate {bytes} bytes of scratch memory for this call")]
    Scratch { bytes: u128 },
}

impl KernelError {
    /// The classification front ends map (Python's exception class, the server's status).
    pub fn kind(&self) -> ErrorKind {
        use KernelError::*;
        match self {
            Axis { .. }
            | Broadcast { .. }
            | BroadcastTo { .. }
            | MatmulOperandDims { .. }
            | MatmulCoreDims { .. }
            | MatmulBatch { .. }
            | Shape { .. }
            | Rank { .. }
            | NoDimensions { .. } => ErrorKind::Shape,
            DTypeMismatch { .. }
            | ResultDType { .. }
            | BinaryDTypes { .. }
            | UnaryDTypes { .. }
            | MatmulDTypes { .. }
            | AxpyDTypes { .. }
            | DTypeNotIn { .. }
            | FloatRequired { .. }
            | NoKernel { .. }
            | IntegerDivision { .. } => ErrorKind::DType,
            IndexOutOfRange { .. }
            | OffsetsStart { .. }
            | OffsetsDecrease { .. }
            | OffsetBeyondEnd { .. }
            | NegativeIntPower
            | EmptyReduction(_)
            | RepeatedOutput { .. }
            | MalformedView { .. } => ErrorKind::Argument,
            Scratch { .. } => ErrorKind::OutOfMemory,
        }
    }
}

/// The batch dimensions of a `matmul` operand of shape `shape` (none for a 1-D operand).
fn matmul_batch(shape: &[usize]) -> &[usize] {
    &shape[..shape.len().saturating_sub(2)]
}

/// Checks that `elements` elements of `element_bytes` each can be allocated now (a kernel's
/// scratch copy), without aborting the process when they cannot: a typed out-of-memory error.
pub(crate) fn check_scratch(elements: usize, element_bytes: usize) -> Result<(), KernelError> {
    let bytes = elements as u128 * element_bytes as u128;
    let fits = usize::try_from(bytes).ok().filter(|&b| b <= isize::MAX as usize);
    match fits {
        Some(b) if Vec::<u8>::new().try_reserve_exact(b).is_ok() => Ok(()),
        _ => Err(KernelError::Scratch { bytes }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_what_was_wrong() {
        let broadcast = KernelError::Broadcast { shapes: [vec![3, 4], vec![5]], dim: -1, sizes: [4, 5] };
        assert_eq!(broadcast.kind(), ErrorKind::Shape);
        assert_eq!(KernelError::Axis { axis: 2, ndim: 2 }.kind(), ErrorKind::Shape);
        let dtypes = KernelError::BinaryDTypes { a: DType::F32, b: DType::F32, out: DType::F64 };
        assert_eq!(dtypes.kind(), ErrorKind::DType);
        assert_eq!(KernelError::IntegerDivision { dtype: DType::I32 }.kind(), ErrorKind::DType);
        assert_eq!(KernelError::IndexOutOfRange { position: 1, index: 5, rows: 5 }.kind(), ErrorKind::Argument);
        assert_eq!(KernelError::NegativeIntPower.kind(), ErrorKind::Argument);
        assert_eq!(KernelError::RepeatedOutput { what: "out" }.kind(), ErrorKind::Argument);
    }

    #[test]
    fn messages_keep_their_wording() {
        let broadcast = KernelError::Broadcast { shapes: [vec![3, 4], vec![5]], dim: -1, sizes: [4, 5] };
        assert_eq!(
            broadcast.to_string(),
            "shapes (3, 4) and (5,) cannot be broadcast together: dimension -1 is 4 vs 5"
        );
        let batch = KernelError::MatmulBatch { a: vec![2, 2, 3], b: vec![3, 4] };
        assert_eq!(
            batch.to_string(),
            "batch dimensions [2] of a (shape [2, 2, 3]) and [] of b (shape [3, 4]) cannot be broadcast together"
        );
        let decrease = KernelError::OffsetsDecrease { position: 2, offset: 1, previous: 2 };
        assert_eq!(decrease.to_string(), "offsets must not decrease, but offsets[2] = 1 < offsets[1] = 2");
        assert_eq!(KernelError::NegativeIntPower.to_string(), NEGATIVE_INT_POWER);
    }
}
