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

/// The FP16 nearest to `x`, rounded once (ties to even). `half::f16::from_f64` rounds twice on
/// x86 with F16C (through f32), and its software path drops the low 32 bits of the mantissa
/// before rounding: either turns a value just above a tie into the even neighbour below.
pub fn f16_from_f64(x: f64) -> half::f16 {
    half::f16::from_bits(round_to_half(x, 10, -14))
}

/// The bits of the 16-bit float with `man_bits` mantissa bits and smallest normal exponent
/// `min_exp` (FP16: 10, -14; BF16: 7, -126) nearest to `x`; exact integer arithmetic on the
/// scaled value, so one rounding.
fn round_to_half(x: f64, man_bits: u32, min_exp: i32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000u16 } else { 0 };
    let max_exp = -min_exp + 1;
    let exp_field_all = ((2 * max_exp + 1) as u16) << man_bits;
    if x.is_nan() {
        return sign | exp_field_all | (1 << (man_bits - 1));
    }
    let a = x.abs();
    let biased = ((a.to_bits() >> 52) & 0x7ff) as i32;
    let exp = if biased == 0 { -1023 } else { biased - 1023 };
    if exp > max_exp {
        return sign | exp_field_all;
    }
    // Count of the result's ulps in `a`: the ulp is 2^(e - man_bits) with e clamped to the
    // subnormal range; scaling by a power of two is exact, and the result is below 2^(man_bits + 1).
    let ulp_exp = exp.max(min_exp) - man_bits as i32;
    let scale = f64::from_bits(((1023 - ulp_exp) as u64) << 52);
    let ulps = (a * scale).round_ties_even() as u32;
    let bits = if exp < min_exp {
        // Subnormal; rounding up to 2^man_bits is exactly the smallest normal's encoding.
        ulps
    } else {
        // A carry out of the mantissa bumps the exponent (to infinity past the largest finite).
        (((exp + max_exp) as u32) << man_bits) + ulps - (1 << man_bits)
    };
    sign | bits as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_from_f64_rounds_once() {
        // Just above the tie between 1 and 1 + 2^-10: an f32 step (or a truncated mantissa)
        // lands on the tie and rounds to even (1.0); the nearest FP16 is the one above.
        let x = 1.0 + 2f64.powi(-11) + 1e-8;
        assert_eq!(f16_from_f64(x).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(f16_from_f64(1.0 + 2f64.powi(-11)).to_f64(), 1.0, "an exact tie goes to even");
        for x in [0.0, -0.0, 1.0, -2.5, 65504.0, 6.1035156e-5, 5.9604645e-8, 1e-3, 1234.567] {
            assert_eq!(f16_from_f64(x), half::f16::from_f64_const(x), "{x}");
        }
        assert_eq!(f16_from_f64(65519.99), half::f16::MAX);
        assert_eq!(f16_from_f64(65520.0), half::f16::INFINITY);
        assert_eq!(f16_from_f64(-1e300), half::f16::NEG_INFINITY);
        assert_eq!(f16_from_f64(f64::INFINITY), half::f16::INFINITY);
        assert!(f16_from_f64(f64::NAN).is_nan());
        assert_eq!(f16_from_f64(2.9802322387695312e-8).to_bits(), 0, "half the smallest subnormal: ties to 0");
        assert_eq!(f16_from_f64(2.98023224e-8).to_bits(), 1, "just above: the smallest subnormal");
        assert_eq!(f16_from_f64(1e-300).to_bits(), 0);
        assert_eq!(f16_from_f64(6.1035156e-5 - 1e-12), half::f16::MIN_POSITIVE, "subnormal rounding up to normal");
        // Every FP16 round-trips, and every midpoint between neighbours goes to the even one.
        for bits in 0..0x7c00u16 {
            let v = half::f16::from_bits(bits);
            assert_eq!(f16_from_f64(v.to_f64()).to_bits(), bits);
            let next = half::f16::from_bits(bits + 1).to_f64();
            let mid = (v.to_f64() + next) / 2.0;
            let even = if bits % 2 == 0 { bits } else { bits + 1 };
            assert_eq!(f16_from_f64(mid).to_bits(), even, "midpoint after {bits:#x}");
            assert_eq!(f16_from_f64(-mid).to_bits(), even | 0x8000);
        }
    }

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
