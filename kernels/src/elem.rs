//! What the element-wise passes share: the element types and the float each computes in
//! ([`Elem`]), and the dispatch macros that compile one loop per dtype and per activation.

use half::{bf16, f16};

use crate::activation::Real;

/// An element type and the float the passes compute it in (f16 and bf16: f32).
pub(crate) trait Elem: candle_core::WithDType + Copy + Send + Sync {
    type R: Real;
    fn load(self) -> Self::R;
    fn store(r: Self::R) -> Self;
    /// `r` rounded to this type, as a value the two-op path would have stored.
    #[inline(always)]
    fn round(r: Self::R) -> Self::R {
        Self::store(r).load()
    }
}

macro_rules! same {
    ($t:ty) => {
        impl Elem for $t {
            type R = $t;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(r: $t) -> $t {
                r
            }
        }
    };
}
same!(f32);
same!(f64);

macro_rules! narrow {
    ($t:ty) => {
        impl Elem for $t {
            type R = f32;
            #[inline(always)]
            fn load(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn store(r: f32) -> $t {
                <$t>::from_f32(r)
            }
        }
    };
}
narrow!(bf16);
narrow!(f16);

/// Calls `$f` with the activation as a constant, so that each loop is compiled for one.
macro_rules! per_activation {
    ($act:expr, $f:ident($($arg:expr),*)) => {
        match $act {
            Activation::GeluTanh => $f(Activation::GeluTanh, $($arg),*),
            Activation::GeluErf => $f(Activation::GeluErf, $($arg),*),
            Activation::Silu => $f(Activation::Silu, $($arg),*),
            Activation::Relu => $f(Activation::Relu, $($arg),*),
        }
    };
}

pub(crate) use per_activation;

/// `$body` over the operands' contiguous slices (bound to `$x`) in their common dtype, as
/// `CpuStorage` of that dtype; an error for operands of different dtypes or not floats.
macro_rules! per_dtype {
    ($what:expr, $first:expr, [$(($s:expr, $l:expr)),*], |$($x:ident),*| $body:expr) => {{
        macro_rules! arm {
            ($t:ty, $variant:ident) => {{
                $(let $x: &[$t] = crate::cpu::slice($s.as_slice::<$t>()?, $l)?;)*
                candle_core::CpuStorage::$variant($body)
            }};
        }
        let dtype = $first.dtype();
        if [$($s.dtype()),*].iter().any(|d| *d != dtype) {
            candle_core::bail!("{}: the operands differ in dtype", $what);
        }
        match dtype {
            candle_core::DType::F32 => arm!(f32, F32),
            candle_core::DType::F64 => arm!(f64, F64),
            candle_core::DType::BF16 => arm!(half::bf16, BF16),
            candle_core::DType::F16 => arm!(half::f16, F16),
            d => candle_core::bail!("{}: {d:?} (a float tensor is required)", $what),
        }
    }};
}

pub(crate) use per_dtype;
