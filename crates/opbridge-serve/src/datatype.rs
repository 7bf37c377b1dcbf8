//! The protocol's tensor datatypes (`"FP32"`, ...) and how they map to opbridge dtypes.

use opbridge_runtime::DType;

/// A V2 / Triton tensor datatype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Datatype {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bf16,
    Bytes,
}

impl Datatype {
    pub const ALL: [Datatype; 14] = [
        Datatype::Bool,
        Datatype::Uint8,
        Datatype::Uint16,
        Datatype::Uint32,
        Datatype::Uint64,
        Datatype::Int8,
        Datatype::Int16,
        Datatype::Int32,
        Datatype::Int64,
        Datatype::Fp16,
        Datatype::Fp32,
        Datatype::Fp64,
        Datatype::Bf16,
        Datatype::Bytes,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Datatype::Bool => "BOOL",
            Datatype::Uint8 => "UINT8",
            Datatype::Uint16 => "UINT16",
            Datatype::Uint32 => "UINT32",
            Datatype::Uint64 => "UINT64",
            Datatype::Int8 => "INT8",
            Datatype::Int16 => "INT16",
            Datatype::Int32 => "INT32",
            Datatype::Int64 => "INT64",
            Datatype::Fp16 => "FP16",
            Datatype::Fp32 => "FP32",
            Datatype::Fp64 => "FP64",
            Datatype::Bf16 => "BF16",
            Datatype::Bytes => "BYTES",
        }
    }

    pub fn parse(name: &str) -> Option<Datatype> {
        Datatype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element; `None` for BYTES (variable length).
    pub fn size(self) -> Option<usize> {
        Some(match self {
            Datatype::Bool | Datatype::Uint8 | Datatype::Int8 => 1,
            Datatype::Uint16 | Datatype::Int16 | Datatype::Fp16 | Datatype::Bf16 => 2,
            Datatype::Uint32 | Datatype::Int32 | Datatype::Fp32 => 4,
            Datatype::Uint64 | Datatype::Int64 | Datatype::Fp64 => 8,
            Datatype::Bytes => return None,
        })
    }

    /// The opbridge dtype of the same layout, if operators can take it.
    pub fn dtype(self) -> Option<DType> {
        Some(match self {
            Datatype::Fp16 => DType::F16,
            Datatype::Fp32 => DType::F32,
            Datatype::Fp64 => DType::F64,
            Datatype::Int32 => DType::I32,
            Datatype::Int64 => DType::I64,
            _ => return None,
        })
    }

    pub fn of(dtype: DType) -> Datatype {
        match dtype {
            DType::F16 => Datatype::Fp16,
            DType::F32 => Datatype::Fp32,
            DType::F64 => Datatype::Fp64,
            DType::I32 => Datatype::Int32,
            DType::I64 => Datatype::Int64,
        }
    }

    /// Triton's model-config enum value (`TYPE_FP32` = 11, ...).
    pub fn config_code(self) -> i32 {
        match self {
            Datatype::Bool => 1,
            Datatype::Uint8 => 2,
            Datatype::Uint16 => 3,
            Datatype::Uint32 => 4,
            Datatype::Uint64 => 5,
            Datatype::Int8 => 6,
            Datatype::Int16 => 7,
            Datatype::Int32 => 8,
            Datatype::Int64 => 9,
            Datatype::Fp16 => 10,
            Datatype::Fp32 => 11,
            Datatype::Fp64 => 12,
            Datatype::Bytes => 13,
            Datatype::Bf16 => 14,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_match_the_protocol() {
        for d in Datatype::ALL {
            assert_eq!(Datatype::parse(d.name()), Some(d));
        }
        assert_eq!(Datatype::parse("fp32"), None, "names are case-sensitive, as in Triton");
        assert_eq!(Datatype::Fp32.size(), Some(4));
        assert_eq!(Datatype::Bytes.size(), None);
        for dtype in DType::ALL {
            assert_eq!(Datatype::of(dtype).dtype(), Some(dtype));
            assert_eq!(Datatype::of(dtype).size(), Some(dtype.size()));
        }
    }
}
