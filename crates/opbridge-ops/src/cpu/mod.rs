//! The CPU backend: the host kernels of every built-in operator, one module per family
//! (`binary`, `unary`, `reduce`, `nn`, `matmul`, `batched`, `embedding`, `cast`, ...), the
//! vectorized scalar math they share (`math`), their parallel-dispatch thresholds
//! (`thresholds`), and the element types they are generic over ([`Element`], `with_dtype!`).
//! Each family works on raw host pointers or views handed over by the dispatch layer, which
//! checks shapes, dtypes and aliasing before any kernel runs. Other backends (`ascend`, `cuda`)
//! are meant to stand beside this module.

pub mod batched;
pub mod binary;
pub mod broadcast;
pub mod cast;
pub mod elementwise;
pub mod embedding;
pub mod error;
pub mod features;
pub(crate) mod math;
pub mod matmul;
pub mod nn;
pub mod pool;
pub mod reduce;
pub mod streaming;
pub mod thresholds;
pub mod unary;

pub use error::KernelError;

use half::f16;

/// Element types the CPU kernels are generic over.
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: opbridge_runtime::DType;
    /// `a + b` with numpy's semantics (integers wrap, float16 rounds once from float32).
    fn add(a: Self, b: Self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
}

macro_rules! float_element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: opbridge_runtime::DType = opbridge_runtime::DType::$d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
float_element!(f32, F32);
float_element!(f64, F64);

macro_rules! int_element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: opbridge_runtime::DType = opbridge_runtime::DType::$d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
int_element!(i32, I32);
int_element!(i64, I64);

impl Element for f16 {
    const DTYPE: opbridge_runtime::DType = opbridge_runtime::DType::F16;
    #[inline(always)]
    fn add(a: Self, b: Self) -> Self {
        f16::from_f32(a.to_f32() + b.to_f32())
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_i64(self) -> i64 {
        self.to_f32() as i64
    }
    fn from_i64(v: i64) -> Self {
        f16::from_f64(v as f64)
    }
}

/// Runs `$body` with `$t` bound to the Rust type of a runtime dtype.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            opbridge_runtime::DType::F16 => {
                type $t = half::f16;
                $body
            }
            opbridge_runtime::DType::F32 => {
                type $t = f32;
                $body
            }
            opbridge_runtime::DType::F64 => {
                type $t = f64;
                $body
            }
            opbridge_runtime::DType::I32 => {
                type $t = i32;
                $body
            }
            opbridge_runtime::DType::I64 => {
                type $t = i64;
                $body
            }
        }
    };
}
