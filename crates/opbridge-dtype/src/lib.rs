//! opbridge's element types and the DLPack declarations, in one crate without dependencies.
//!
//! The runtime, the built-in operators, the Python bindings and plugins (through the plugin SDK,
//! which re-exports this crate's items) share these definitions: one [`DType`], one set of
//! DLPack structs and codes. Adding an element type changes this crate, not the plugin ABI crate.
#![forbid(unsafe_code)]

pub mod dlpack;

use std::fmt;

/// An element type. Names and promotion follow numpy, so results never surprise a numpy user.
/// opbridge's runtime uses this very type: built-in operators and plugins speak one vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F16,
    F32,
    F64,
    I32,
    I64,
}

impl DType {
    pub const ALL: [DType; 5] = [DType::F16, DType::F32, DType::F64, DType::I32, DType::I64];

    /// numpy's name (`"float32"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::F32 | DType::F64)
    }

    /// The result type of `a + b` under numpy's rules for arrays (NEP 50): the smallest type
    /// that holds both exactly, with any int mixed with float16 going to float64 the way
    /// numpy does for int32/int64.
    pub fn promote(self, other: DType) -> DType {
        use DType::*;
        if self == other {
            return self;
        }
        match (self.is_float(), other.is_float()) {
            (true, true) => self.max(other), // F16 < F32 < F64 in declaration order
            (false, false) => I64,
            _ => {
                let (float, int) = if self.is_float() { (self, other) } else { (other, self) };
                // float64 is the smallest float that holds every int32/int64 the way numpy decides.
                match (float, int) {
                    (F64, _) | (_, I32 | I64) => F64,
                    _ => float,
                }
            }
        }
    }

    pub const fn to_dl(self) -> dlpack::DLDataType {
        let (code, bits) = match self {
            DType::F16 => (dlpack::kDLFloat, 16),
            DType::F32 => (dlpack::kDLFloat, 32),
            DType::F64 => (dlpack::kDLFloat, 64),
            DType::I32 => (dlpack::kDLInt, 32),
            DType::I64 => (dlpack::kDLInt, 64),
        };
        dlpack::DLDataType { code, bits, lanes: 1 }
    }

    pub fn from_dl(t: dlpack::DLDataType) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.to_dl() == t)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
