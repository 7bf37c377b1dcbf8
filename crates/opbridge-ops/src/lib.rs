//! opbridge operators: argument checking (the schema of each op), dispatch to kernels, and the
//! built-in CPU kernels. Works on runtime tensors (async, on a stream) and on raw host memory
//! (the synchronous numpy path, driven by the bindings).

mod builtins;
pub mod cpu;
pub mod error;
mod memo;
pub mod native;
pub mod plugin;
pub mod registry;
pub mod schema;
mod tensor_ops;
pub mod tuning;
pub mod view;

pub use cpu::elementwise::Alias;
pub use cpu::thresholds::ELEMENTWISE_PARALLEL_MIN_ELEMS as PARALLEL_MIN_ELEMS;
pub use error::{OpError, Result};
pub use registry::{Entry, Operator, Registry, Source};
pub use schema::{AttrValue, Attrs, Meta, Schema};
pub use tensor_ops::{contiguous, copy_tensor, matmul, vector_add};
pub use view::TensorView;

use opbridge_runtime::DType;

/// dtypes `vector_add` has kernels for.
pub const ADD_DTYPES: [DType; 5] = DType::ALL;

/// Checks `vector_add` arguments; returns the result dtype (numpy's for `a + b`).
pub fn check_vector_add(a: (DType, &[usize]), b: (DType, &[usize]), out: Option<(DType, &[usize])>) -> Result<DType> {
    const OP: &str = "vector_add";
    if a.1 != b.1 {
        return Err(OpError::Shape {
            op: OP,
            expected: format!("inputs of equal shape (a has {:?})", a.1),
            got: format!("b of shape {:?}", b.1),
        });
    }
    let dtype = a.0.promote(b.0);
    if let Some((out_dtype, out_shape)) = out {
        check_out(OP, dtype, a.1, out_dtype, out_shape)?;
    }
    Ok(dtype)
}

/// Checks `matmul` arguments; returns `(m, k, n, result dtype)`.
pub fn check_matmul(
    a: (DType, &[usize]),
    b: (DType, &[usize]),
    out: Option<(DType, &[usize])>,
) -> Result<(usize, usize, usize, DType)> {
    const OP: &str = "matmul";
    for (name, (dtype, _)) in [("a", a), ("b", b)] {
        if !cpu::matmul::MATMUL_DTYPES.contains(&dtype) {
            return Err(OpError::unsupported_dtype(OP, &cpu::matmul::MATMUL_DTYPES, format!("{dtype} for {name}")));
        }
    }
    let (&[m, k], &[k2, n]) = (a.1, b.1) else {
        return Err(OpError::Shape {
            op: OP,
            expected: "2-D operands (m, k) and (k, n)".into(),
            got: format!("a of shape {:?} and b of shape {:?}", a.1, b.1),
        });
    };
    if k != k2 {
        return Err(OpError::Shape {
            op: OP,
            expected: format!("b with {k} rows to match a's shape {:?}", a.1),
            got: format!("b of shape {:?}", b.1),
        });
    }
    let dtype = a.0.promote(b.0);
    if let Some((out_dtype, out_shape)) = out {
        check_out(OP, dtype, &[m, n], out_dtype, out_shape)?;
    }
    Ok((m, k, n, dtype))
}

fn check_out(op: &'static str, dtype: DType, shape: &[usize], out_dtype: DType, out_shape: &[usize]) -> Result<()> {
    if out_shape != shape {
        return Err(OpError::Shape { op, expected: format!("out of shape {shape:?}"), got: format!("{out_shape:?}") });
    }
    if out_dtype != dtype {
        return Err(OpError::DType { op, expected: format!("out of dtype {dtype}"), got: out_dtype.to_string() });
    }
    Ok(())
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
