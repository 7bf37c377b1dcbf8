//! Element types the runtime knows, their sizes, and numpy's promotion rules for `a + b`.
//!
//! The type is the plugin SDK's (`opbridge_plugin_sdk::DType`, a crate without dependencies):
//! the runtime, the built-in operators and plugins share one definition.

pub use opbridge_plugin_sdk::DType;

#[cfg(test)]
mod tests {
    use super::DType::*;

    #[test]
    fn promotion_matches_numpy() {
        // Each row checked against `(np.zeros(1, a) + np.zeros(1, b)).dtype` with numpy 2.
        let table = [
            (F16, F16, F16),
            (F16, F32, F32),
            (F16, F64, F64),
            (F16, I32, F64),
            (F16, I64, F64),
            (F32, F64, F64),
            (F32, I32, F64),
            (F32, I64, F64),
            (F64, I64, F64),
            (I32, I64, I64),
            (I32, I32, I32),
        ];
        for (a, b, want) in table {
            assert_eq!(a.promote(b), want, "{a} + {b}");
            assert_eq!(b.promote(a), want, "{b} + {a}");
        }
    }
}
