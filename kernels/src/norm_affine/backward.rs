//! The op's backward on the CPU: each row's statistics recomputed, the input's gradient in
//! three passes over the row, the weight's and bias's gradients summed per task of rows and
//! added in the tasks' order (the formulas are in the parent module's doc).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape};
use rayon::prelude::*;

use super::{Affine, Geometry, Spec};
use crate::activation::{Activation, Real};
use crate::cpu::{row_stats, LANES};
use crate::elem::{per_dtype, Elem};

/// The weight's and bias's gradients summed over some rows, per channel.
pub(super) struct Sums {
    pub(super) dw: Vec<f64>,
    pub(super) db: Vec<f64>,
}

impl Sums {
    fn zeros(c: usize) -> Self {
        Sums {
            dw: vec![0.0; c],
            db: vec![0.0; c],
        }
    }
}

/// The backward's parameters: the weight and bias in f64 (exactly the `T` values), and where
/// it leaves the weight's and bias's gradients.
pub(super) struct Backward {
    pub(super) spec: Spec,
    pub(super) w: Option<Vec<f64>>,
    pub(super) b: Option<Vec<f64>>,
    pub(super) sums: Arc<Mutex<Option<Sums>>>,
}

impl Backward {
    /// The input's gradient over rows starting at `row0`, adding the parameters' to `sums`;
    /// `dxh` is scratch for one row. `dz(g, xhat, affine)` is the gradient at the affine
    /// part's output (through the activation, if any), in f64. Inlined into
    /// [`crate::wide::run`] by its caller, whole, as [`forward_rows`].
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn rows<T: Elem>(
        &self,
        geo: Geometry,
        row0: usize,
        x: &[T],
        g: &[T],
        dx: &mut [T],
        sums: &mut Sums,
        dxh: &mut Vec<f64>,
        dz: impl Fn(T, T::R, Affine<T::R>) -> f64 + Copy,
    ) {
        let Spec { eps, center, .. } = self.spec;
        let cols = geo.cols.max(1);
        let inner = geo.inner.max(1);
        let it = x.chunks(cols).zip(g.chunks(cols)).zip(dx.chunks_mut(cols));
        for (j, ((xr, gr), dr)) in it.enumerate() {
            let (mean, r) = row_stats(xr, center, eps);
            let c0 = geo.first_channel(row0 + j);
            // Every value is written by the first loop below before it is read.
            if dxh.len() != xr.len() {
                dxh.resize(xr.len(), 0.0);
            }
            let (mut s1, mut s2) = (0f64, 0f64);
            let parts = xr
                .chunks(inner)
                .zip(gr.chunks(inner))
                .zip(dxh.chunks_mut(inner));
            for (k, ((xs, gs), ds)) in parts.enumerate() {
                let c = c0 + k;
                let w = self.w.as_ref().map(|w| w[c]);
                let aff = Affine::<T::R> {
                    w: w.map(T::R::f),
                    b: self.b.as_ref().map(|b| T::R::f(b[c])),
                };
                // First the gradients at the affine part's output, a loop without a sum that
                // the compiler vectorises (the activation's derivative is most of the work);
                // then the sums: in partial sums (`LANES`), independent chains, over a group
                // norm's channel; in order over shorter ones (a layer or RMS norm's channel is
                // one value), as they always were.
                for ((v, gv), d) in xs.iter().zip(gs).zip(ds.iter_mut()) {
                    let xhat = T::from_f64((v.to_f64() - mean) * r).load();
                    *d = dz(*gv, xhat, aff);
                }
                // [weight's, bias's, s1's, s2's] sums.
                let add = |at: &mut [f64; 4], v: &T, d: &mut f64| {
                    let exact = (v.to_f64() - mean) * r;
                    let xhat = T::from_f64(exact).load();
                    let dz = *d;
                    *d = w.map_or(dz, |w| dz * w);
                    at[0] += dz * xhat.wide();
                    at[1] += dz;
                    at[2] += *d;
                    at[3] += *d * exact;
                };
                let (sw, sb) = if xs.len() < LANES {
                    let mut at = [0.0, 0.0, s1, s2];
                    for (v, d) in xs.iter().zip(ds.iter_mut()) {
                        add(&mut at, v, d);
                    }
                    (s1, s2) = (at[2], at[3]);
                    (at[0], at[1])
                } else {
                    let mut acc = [[0f64; LANES]; 4];
                    let mut tail = [0f64; 4];
                    let mut xc = xs.chunks_exact(LANES);
                    let mut dc = ds.chunks_exact_mut(LANES);
                    for (xv, dv) in (&mut xc).zip(&mut dc) {
                        for i in 0..LANES {
                            let mut at = [acc[0][i], acc[1][i], acc[2][i], acc[3][i]];
                            add(&mut at, &xv[i], &mut dv[i]);
                            for (a, v) in acc.iter_mut().zip(at) {
                                a[i] = v;
                            }
                        }
                    }
                    for (v, d) in xc.remainder().iter().zip(dc.into_remainder()) {
                        add(&mut tail, v, d);
                    }
                    let total = |k: usize| acc[k].iter().sum::<f64>() + tail[k];
                    s1 += total(2);
                    s2 += total(3);
                    (total(0), total(1))
                };
                sums.dw[c] += sw;
                sums.db[c] += sb;
            }
            let n = xr.len().max(1) as f64;
            let m1 = if center { s1 / n } else { 0.0 };
            let m2 = s2 / n;
            for ((o, v), d) in dr.iter_mut().zip(xr).zip(dxh.iter()) {
                let exact = (v.to_f64() - mean) * r;
                *o = T::from_f64(r * (d - m1 - exact * m2));
            }
        }
    }

    /// The input's gradient, with the activation's derivative chosen outside the loops (as
    /// the forward's).
    fn run<T: Elem>(&self, geo: Geometry, x: &[T], g: &[T]) -> Result<Vec<T>> {
        // A closure per activation, each with its activation as a constant: one captured
        // `Activation` would be matched per value again.
        macro_rules! through {
            ($a:expr) => {
                #[inline(always)]
                |gv: T, xhat, aff: Affine<T::R>| $a.backward(gv.load(), aff.apply::<T>(xhat)).wide()
            };
        }
        match self.spec.act {
            None => self.run_with(
                geo,
                x,
                g,
                #[inline(always)]
                |gv: T, _, _| gv.to_f64(),
            ),
            Some(Activation::Silu) => self.run_with(geo, x, g, through!(Activation::Silu)),
            Some(Activation::GeluTanh) => self.run_with(geo, x, g, through!(Activation::GeluTanh)),
            Some(Activation::GeluErf) => self.run_with(geo, x, g, through!(Activation::GeluErf)),
            Some(Activation::Relu) => self.run_with(geo, x, g, through!(Activation::Relu)),
        }
    }

    fn run_with<T: Elem>(
        &self,
        geo: Geometry,
        x: &[T],
        g: &[T],
        dz: impl Fn(T, T::R, Affine<T::R>) -> f64 + Copy + Sync,
    ) -> Result<Vec<T>> {
        let mut dx = vec![T::zero(); x.len()];
        let c = geo.channels();
        let total = if geo.cols == 0 {
            Sums::zeros(c)
        } else {
            let rows = geo.rows_a_task();
            let parts: Vec<Sums> = dx
                .par_chunks_mut(rows * geo.cols)
                .enumerate()
                .map(|(t, d)| {
                    let at = t * rows * geo.cols;
                    let r = at..at + d.len();
                    let mut sums = Sums::zeros(c);
                    let mut scratch = Vec::with_capacity(geo.cols);
                    let (x, g) = (&x[r.clone()], &g[r]);
                    crate::wide::run(
                        #[inline(always)]
                        || self.rows(geo, t * rows, x, g, d, &mut sums, &mut scratch, dz),
                    );
                    sums
                })
                .collect();
            let mut total = Sums::zeros(c);
            for p in parts {
                total.dw.iter_mut().zip(&p.dw).for_each(|(a, b)| *a += b);
                total.db.iter_mut().zip(&p.db).for_each(|(a, b)| *a += b);
            }
            total
        };
        *self.sums.lock().map_err(|_| poisoned())? = Some(total);
        Ok(dx)
    }
}

pub(super) fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("norm affine: the parameters' sums were poisoned".into())
}

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "ft-norm-affine-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let what = "norm affine backward";
        if xl.shape() != gl.shape() {
            bail!("{what}: gradient {:?} for input {:?}", gl.dims(), xl.dims());
        }
        let geo = Geometry::of(xl.dims(), self.spec.groups)?;
        let dx = per_dtype!(what, xs, [(xs, xl), (gs, gl)], |x, g| self
            .run(geo, x, g)?);
        Ok((dx, xl.shape().clone()))
    }
}
