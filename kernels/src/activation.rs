//! GELU (tanh approximation and exact erf), SiLU and ReLU as single passes forward and backward.
//!
//! candle computes these activations' backward as a chain of ops (GELU: a cube by `powf`, a
//! tanh, then `powf(2)` and five elementwise maps, each a fresh tensor and, on the CPU, a rayon
//! dispatch however small the tensor): on the tiny T5 of t5-ft's demo that chain was about a
//! tenth of the step (docs/benchmarks.md, #21). Here the forward is one pass and the backward one
//! pass `g * f'(x)`, with exact derivatives (candle's GELU backward rounds its constants to six
//! digits). ReLU's backward is `g` where `x > 0`, else 0, as PyTorch's (candle's makes five
//! tensors of the input's size and passes the gradient at exactly 0). On the CPU the pass runs on the calling thread below [`host::CHUNK`] elements and in
//! chunks on rayon's threads above; f32, f16 and bf16 compute in f32, f64 in f64. On CUDA the
//! candle ops run as before.

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use crate::host;

/// Which activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// transformers' `gelu_new`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    GeluTanh,
    /// The exact GELU: 0.5 x (1 + erf(x / sqrt(2))).
    GeluErf,
    /// x sigmoid(x).
    Silu,
    /// max(x, 0) (the original T5's feed-forward).
    Relu,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// A float type the passes compute in (f32 or f64).
pub(crate) trait Real: Copy + Send + Sync {
    fn f(x: f64) -> Self;
    /// The value as f64 (exact).
    fn wide(self) -> f64;
    fn positive(self) -> bool;
    fn tanh(self) -> Self;
    fn exp(self) -> Self;
    fn erf(self) -> Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
}

macro_rules! real {
    ($t:ty, $erf:path, $tanh:path, $exp:path) => {
        impl Real for $t {
            #[inline(always)]
            fn f(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn wide(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn positive(self) -> bool {
                self > 0.0
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                $tanh(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn sub(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn div(self, o: Self) -> Self {
                self / o
            }
        }
    };
}
// f32 (and f16/bf16, computed in f32) without libm's calls, so that the loops vectorise
// (`crate::fastmath`: a few ulp); f64, the finite-difference checks' dtype, keeps libm's.
real!(
    f32,
    crate::fastmath::erf,
    crate::fastmath::tanh,
    crate::fastmath::exp
);
real!(f64, candle_core::cpu::erf::erf_f64, f64::tanh, f64::exp);

impl Activation {
    #[inline(always)]
    pub(crate) fn forward<R: Real>(self, x: R) -> R {
        let (half, one) = (R::f(0.5), R::f(1.0));
        match self {
            Activation::GeluTanh => {
                let inner = R::f(SQRT_2_OVER_PI)
                    .mul(x)
                    .mul(one.add(R::f(0.044715).mul(x).mul(x)));
                half.mul(x).mul(one.add(inner.tanh()))
            }
            Activation::GeluErf => half
                .mul(x)
                .mul(one.add(x.mul(R::f(std::f64::consts::FRAC_1_SQRT_2)).erf())),
            Activation::Silu => x.div(one.add(R::f(0.0).sub(x).exp())),
            Activation::Relu if x.positive() => x,
            Activation::Relu => R::f(0.0),
        }
    }

    /// f'(x).
    #[inline(always)]
    fn derivative<R: Real>(self, x: R) -> R {
        let (half, one) = (R::f(0.5), R::f(1.0));
        match self {
            Activation::GeluTanh => {
                let x2 = x.mul(x);
                let t = R::f(SQRT_2_OVER_PI)
                    .mul(x)
                    .mul(one.add(R::f(0.044715).mul(x2)))
                    .tanh();
                let du = R::f(SQRT_2_OVER_PI).mul(one.add(R::f(3.0 * 0.044715).mul(x2)));
                half.mul(one.add(t))
                    .add(half.mul(x).mul(one.sub(t.mul(t))).mul(du))
            }
            Activation::GeluErf => {
                let cdf = half.mul(one.add(x.mul(R::f(std::f64::consts::FRAC_1_SQRT_2)).erf()));
                let pdf = R::f(FRAC_1_SQRT_2PI).mul(R::f(-0.5).mul(x).mul(x).exp());
                cdf.add(x.mul(pdf))
            }
            Activation::Silu => {
                let s = one.div(one.add(R::f(0.0).sub(x).exp()));
                s.mul(one.add(x.mul(one.sub(s))))
            }
            Activation::Relu if x.positive() => one,
            Activation::Relu => R::f(0.0),
        }
    }

    /// `g * f'(x)`; for ReLU `g` where `x > 0` and 0 elsewhere, whatever `g` is (an infinite
    /// or NaN gradient where the ReLU cut gives 0, as PyTorch's, not `g * 0`).
    #[inline(always)]
    pub(crate) fn backward<R: Real>(self, g: R, x: R) -> R {
        match self {
            Activation::Relu if x.positive() => g,
            Activation::Relu => R::f(0.0),
            _ => g.mul(self.derivative(x)),
        }
    }
}

/// Where the i-th element (row-major over the shape) of a tensor with `layout` sits in its
/// storage: strided inputs (a `narrow` of GEGLU's projection) are read in place, not copied, so
/// the graph keeps no extra tensor.
struct Index<'a> {
    start: usize,
    contiguous: bool,
    dims: &'a [usize],
    strides: &'a [usize],
}

impl<'a> Index<'a> {
    fn new(l: &'a Layout) -> Self {
        Index {
            start: l.start_offset(),
            contiguous: l.is_contiguous(),
            dims: l.dims(),
            strides: l.stride(),
        }
    }

    fn at(&self, i: usize) -> usize {
        if self.contiguous {
            return self.start + i;
        }
        let mut rem = i;
        let mut off = self.start;
        for (d, s) in self.dims.iter().zip(self.strides).rev() {
            off += (rem % d) * s;
            rem /= d;
        }
        off
    }
}

/// `out[i] = f(i)` over `out`, on this thread when short, in chunks on rayon's when long.
fn fill<T: Send>(out: &mut [T], f: impl Fn(usize) -> T + Sync) {
    if out.len() <= host::CHUNK {
        for (i, o) in out.iter_mut().enumerate() {
            *o = f(i);
        }
    } else {
        host::par_chunks(out, |at, c| {
            for (j, o) in c.iter_mut().enumerate() {
                *o = f(at + j);
            }
        });
    }
}

/// `run(offset, chunk)` over `out`: on this thread when short, in chunks on rayon's when long.
fn chunked(out: &mut [f32], run: impl Fn(usize, &mut [f32]) + Sync) {
    if out.len() <= host::CHUNK {
        run(0, out);
    } else {
        host::par_chunks(out, run);
    }
}

/// `out[i] = f(x[i])` over contiguous slices of equal length, on this thread when short, in
/// chunks on rayon's when long, compiled for the CPU's widest vector unit ([`crate::wide`]: 16
/// lanes with AVX-512; GELU-tanh and SiLU forward 3.5-3.8x faster at 64k elements in
/// `activation_bench`, the exact GELU 5x).
///
/// `f` must be an `#[inline(always)]` closure: one the compiler leaves out of line is compiled
/// for the baseline and called once per value, which is slower than the plain loop (the exact
/// GELU's closure was left out of line, and its wide loop ran 3x slower than the plain one,
/// until the closure was marked).
fn map1(out: &mut [f32], x: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    let run = |at: usize, c: &mut [f32]| {
        let (x, f) = (&x[at..at + c.len()], &f);
        crate::wide::run(
            #[inline(always)]
            move || {
                for (o, &v) in c.iter_mut().zip(x) {
                    *o = f(v);
                }
            },
        )
    };
    chunked(out, run);
}

/// `out[i] = f(g[i], x[i])`, as [`map1`].
fn map2(out: &mut [f32], g: &[f32], x: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    let run = |at: usize, c: &mut [f32]| {
        let len = c.len();
        let (g, x, f) = (&g[at..at + len], &x[at..at + len], &f);
        crate::wide::run(
            #[inline(always)]
            move || {
                for ((o, &g), &x) in c.iter_mut().zip(g).zip(x) {
                    *o = f(g, x);
                }
            },
        )
    };
    chunked(out, run);
}

/// The forward of contiguous f32, one loop per activation (the match outside the loop).
fn forward_f32(a: Activation, out: &mut [f32], x: &[f32]) {
    macro_rules! with {
        ($a:expr) => {
            map1(
                out,
                x,
                #[inline(always)]
                |v| $a.forward(v),
            )
        };
    }
    match a {
        Activation::GeluTanh => with!(Activation::GeluTanh),
        Activation::GeluErf => with!(Activation::GeluErf),
        Activation::Silu => with!(Activation::Silu),
        Activation::Relu => with!(Activation::Relu),
    }
}

/// The backward of contiguous f32, as [`forward_f32`].
fn backward_f32(a: Activation, out: &mut [f32], g: &[f32], x: &[f32]) {
    macro_rules! with {
        ($a:expr) => {
            map2(
                out,
                g,
                x,
                #[inline(always)]
                |g, v| $a.backward(g, v),
            )
        };
    }
    match a {
        Activation::GeluTanh => with!(Activation::GeluTanh),
        Activation::GeluErf => with!(Activation::GeluErf),
        Activation::Silu => with!(Activation::Silu),
        Activation::Relu => with!(Activation::Relu),
    }
}

struct Forward(Activation);

impl CustomOp1 for Forward {
    fn name(&self) -> &'static str {
        "ft-activation"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, n, ix) = (self.0, l.shape().elem_count(), Index::new(l));
        let out = match s {
            CpuStorage::F32(x) => {
                let mut o = vec![0f32; n];
                match l.contiguous_offsets() {
                    Some((lo, hi)) => forward_f32(a, &mut o, &x[lo..hi]),
                    None => fill(&mut o, |i| a.forward(x[ix.at(i)])),
                }
                CpuStorage::F32(o)
            }
            CpuStorage::F64(x) => {
                let mut o = vec![0f64; n];
                fill(&mut o, |i| a.forward(x[ix.at(i)]));
                CpuStorage::F64(o)
            }
            CpuStorage::BF16(x) => {
                let mut o = vec![bf16::ZERO; n];
                fill(&mut o, |i| bf16::from_f32(a.forward(x[ix.at(i)].to_f32())));
                CpuStorage::BF16(o)
            }
            CpuStorage::F16(x) => {
                let mut o = vec![f16::ZERO; n];
                fill(&mut o, |i| f16::from_f32(a.forward(x[ix.at(i)].to_f32())));
                CpuStorage::F16(o)
            }
            _ => bail!(
                "{:?}: a float tensor is required (f32, f64, f16, bf16)",
                self.0
            ),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            g.contiguous()?
                .apply_op2_no_bwd(&arg.contiguous()?, &Backward(self.0))?,
        ))
    }
}

/// `g * f'(x)`.
struct Backward(Activation);

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "ft-activation-backward"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        xs: &CpuStorage,
        xl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if gl.shape() != xl.shape() {
            bail!(
                "{:?} backward: gradient {:?} for input {:?}",
                self.0,
                gl.dims(),
                xl.dims()
            );
        }
        let (a, n) = (self.0, xl.shape().elem_count());
        let (gi, xi) = (Index::new(gl), Index::new(xl));
        let out = match (gs, xs) {
            (CpuStorage::F32(g), CpuStorage::F32(x)) => {
                let mut o = vec![0f32; n];
                match (gl.contiguous_offsets(), xl.contiguous_offsets()) {
                    (Some((g0, g1)), Some((x0, x1))) => {
                        backward_f32(a, &mut o, &g[g0..g1], &x[x0..x1])
                    }
                    _ => fill(&mut o, |i| a.backward(g[gi.at(i)], x[xi.at(i)])),
                }
                CpuStorage::F32(o)
            }
            (CpuStorage::F64(g), CpuStorage::F64(x)) => {
                let mut o = vec![0f64; n];
                fill(&mut o, |i| a.backward(g[gi.at(i)], x[xi.at(i)]));
                CpuStorage::F64(o)
            }
            (CpuStorage::BF16(g), CpuStorage::BF16(x)) => {
                let mut o = vec![bf16::ZERO; n];
                fill(&mut o, |i| {
                    bf16::from_f32(a.backward(g[gi.at(i)].to_f32(), x[xi.at(i)].to_f32()))
                });
                CpuStorage::BF16(o)
            }
            (CpuStorage::F16(g), CpuStorage::F16(x)) => {
                let mut o = vec![f16::ZERO; n];
                fill(&mut o, |i| {
                    f16::from_f32(a.backward(g[gi.at(i)].to_f32(), x[xi.at(i)].to_f32()))
                });
                CpuStorage::F16(o)
            }
            _ => bail!(
                "{:?} backward: the gradient and input differ in dtype",
                self.0
            ),
        };
        Ok((out, xl.shape().clone()))
    }
}

/// `act` of `x` with its backward: this crate's passes on the CPU, candle's ops elsewhere.
pub fn activate(x: &Tensor, act: Activation) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return match act {
            Activation::GeluTanh => x.gelu(),
            Activation::GeluErf => x.gelu_erf(),
            Activation::Silu => x.silu(),
            Activation::Relu => x.relu(),
        };
    }
    x.apply_op1(Forward(act))
}

/// transformers' `gelu_new` (T5's gated-gelu).
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    activate(x, Activation::GeluTanh)
}

/// The exact GELU (diffusers' GEGLU, the FSCT's MLP, OpenCLIP's `gelu`).
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    activate(x, Activation::GeluErf)
}

/// SiLU (the UNet's and VAE's nonlinearity).
pub fn silu(x: &Tensor) -> Result<Tensor> {
    activate(x, Activation::Silu)
}

/// ReLU (the original T5's feed-forward).
pub fn relu(x: &Tensor) -> Result<Tensor> {
    activate(x, Activation::Relu)
}
