//! Accumulated micro-batch gradients equal the single-batch gradient when each micro-batch's summed
//! loss is divided by the whole step's token count; averaging micro-batch means does not.

use candle_core::{DType, Device, IndexOp, Tensor, Var};
use ft_trainer::update::{GradAccumulator, LossNorm};

mod common;
use common::bits;

/// A token model: logits = E[ids] W, cross-entropy over non-padding labels (-1 = padding).
struct Model {
    emb: Var,
    out: Var,
}

impl Model {
    fn new(dev: &Device) -> anyhow::Result<Self> {
        Ok(Model {
            emb: Var::randn(0f32, 0.5, (11, 6), dev)?,
            out: Var::randn(0f32, 0.5, (6, 11), dev)?,
        })
    }

    /// Summed token loss and the number of label tokens of a batch of rows.
    fn summed_loss(&self, rows: &[Vec<i64>]) -> anyhow::Result<(Tensor, usize)> {
        let dev = self.emb.device();
        let mut total: Option<Tensor> = None;
        let mut count = 0;
        for r in rows {
            let ids: Vec<u32> = r.iter().map(|&t| t.max(0) as u32).collect();
            let n = ids.len() - 1;
            let x = self
                .emb
                .as_tensor()
                .index_select(&Tensor::new(&ids[..n], dev)?, 0)?;
            let logp = candle_nn::ops::log_softmax(&x.matmul(self.out.as_tensor())?, 1)?;
            for (i, &label) in r[1..].iter().enumerate() {
                if label < 0 {
                    continue;
                }
                let term = logp.i((i, label as usize))?.neg()?;
                total = Some(match total {
                    Some(t) => (t + term)?,
                    None => term,
                });
                count += 1;
            }
        }
        Ok((total.ok_or_else(|| anyhow::anyhow!("no tokens"))?, count))
    }

    fn grads(&self, loss: &Tensor) -> anyhow::Result<Vec<Option<Tensor>>> {
        let g = loss.backward()?;
        Ok(vec![
            g.get(self.emb.as_tensor()).cloned(),
            g.get(self.out.as_tensor()).cloned(),
        ])
    }
}

fn max_diff(a: &[Option<Tensor>], b: &[Option<Tensor>]) -> anyhow::Result<f32> {
    let mut m = 0f32;
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.as_ref().expect("grad"), y.as_ref().expect("grad"));
        m = m.max((x - y)?.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    Ok(m)
}

#[test]
fn token_normalised_accumulation_equals_one_big_batch() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let model = Model::new(&dev)?;
    // Micro-batch 1 has 2 label tokens, micro-batch 2 has 9: means would weight them equally.
    let micro = [
        vec![vec![1, 2, 3], vec![4, 5, -1, -1]],
        vec![vec![1, 7, 8, 9, 10, 2], vec![3, 3, 4, 5, 6]],
    ];
    let all: Vec<Vec<i64>> = micro.iter().flatten().cloned().collect();
    let (sum, n) = model.summed_loss(&all)?;
    let big = model.grads(&(sum / n as f64)?)?;

    let counts: Vec<usize> = micro
        .iter()
        .map(|m| model.summed_loss(m).map(|(_, c)| c))
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(counts, vec![3, 9]);
    let norm = LossNorm::tokens(&counts);
    let mut acc = GradAccumulator::new();
    for m in &micro {
        let (s, _) = model.summed_loss(m)?;
        acc.add(model.grads(&norm.scale(&s)?)?)?;
    }
    assert_eq!(acc.micro_batches(), 2);
    assert_eq!(acc.bytes(), (11 * 6 + 6 * 11) * 4);
    let accumulated = acc.take();
    assert!(max_diff(&big, &accumulated)? < 1e-6);

    // The naive mean of micro-batch means is a different gradient: the test can tell.
    let mut naive = GradAccumulator::new();
    for m in &micro {
        let (s, c) = model.summed_loss(m)?;
        naive.add(model.grads(&((s / c as f64)? / micro.len() as f64)?)?)?;
    }
    assert!(max_diff(&big, &naive.take())? > 1e-3);
    Ok(())
}

#[test]
fn sample_normalised_image_accumulation_equals_one_big_batch() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = Var::randn(0f32, 1., (5, 3), &dev)?;
    let x = Tensor::randn(0f32, 1., (7, 5), &dev)?;
    let y = Tensor::randn(0f32, 1., (7, 3), &dev)?;
    let per_sample = |x: &Tensor, y: &Tensor| -> anyhow::Result<Tensor> {
        Ok((x.matmul(w.as_tensor())? - y)?.sqr()?.sum_all()?)
    };
    let big = per_sample(&x, &y)?.affine(1.0 / 7.0, 0.0)?.backward()?;
    let big = big.get(w.as_tensor()).cloned();
    let norm = LossNorm::samples(&[3, 4]);
    let mut acc = GradAccumulator::new();
    for (s, l) in [(0, 3), (3, 4)] {
        let loss = norm.scale(&per_sample(&x.narrow(0, s, l)?, &y.narrow(0, s, l)?)?)?;
        acc.add(vec![loss.backward()?.get(w.as_tensor()).cloned()])?;
    }
    assert!(max_diff(&[big], &acc.take())? < 1e-5);
    assert!(LossNorm::tokens(&[0, 0])
        .scale(&Tensor::zeros((), DType::F32, &dev)?)
        .is_err());
    Ok(())
}

/// One micro-batch's bf16 gradients are kept as they came (2 bytes per value, no fp32 copy of
/// the model's gradients for a step without accumulation); from the second micro-batch on the
/// sum is fp32 and equals adding the widened gradients, also when a parameter skips the first
/// micro-batch and when two parameters' gradients are one shared tensor (as backprop hands an
/// addition's gradient to both operands), which an in-place add into the first would corrupt.
#[test]
fn first_micro_batch_stays_in_its_dtype_and_sums_are_exact() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let g = |seed: u64| -> anyhow::Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, (64, 33), &dev)?
            .affine(1.0, seed as f64 * 0.1)?
            .to_dtype(DType::BF16)?)
    };
    let mut acc = GradAccumulator::new();
    let shared = g(1)?;
    acc.add(vec![Some(shared.clone()), Some(shared.clone()), None])?;
    assert_eq!(acc.bytes(), 2 * 2 * 64 * 33, "bf16 as it came");
    let one = {
        let mut a = GradAccumulator::new();
        a.add(vec![Some(shared.clone())])?;
        a.take()
    };
    assert_eq!(one[0].as_ref().map(|t| t.dtype()), Some(DType::BF16));
    assert_eq!(bits(one[0].as_ref().expect("kept"))?, bits(&shared)?);

    let (g2, g3) = (g(2)?, g(3)?);
    acc.add(vec![Some(g2.clone()), Some(g3.clone()), Some(g2.clone())])?;
    acc.add(vec![Some(g3.clone()), Some(g2.clone()), Some(g3.clone())])?;
    let sums = acc.take();
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let want = [
        ((f(&shared)? + f(&g2)?)? + f(&g3)?)?,
        ((f(&shared)? + f(&g3)?)? + f(&g2)?)?,
        (f(&g2)? + f(&g3)?)?,
    ];
    for (i, (s, w)) in sums.iter().zip(&want).enumerate() {
        let s = s.as_ref().expect("summed");
        assert_eq!(s.dtype(), DType::F32, "sum {i}");
        assert_eq!(bits(s)?, bits(w)?, "sum {i}");
    }
    Ok(())
}

/// The same with fp32 gradients, whose sums the host adds into in place: a gradient shared by
/// two parameters (and the caller's tensor) must not be written into.
#[test]
fn shared_fp32_gradients_are_never_added_into() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let g = |seed: f64| (Tensor::arange(0f32, 120.0, &dev)?.reshape((10, 12))? * seed)?.sin();
    let shared = g(0.1)?;
    let before = bits(&shared)?;
    let mut acc = GradAccumulator::new();
    acc.add(vec![Some(shared.clone()), Some(shared.clone())])?;
    let (a, b) = (g(0.2)?, g(0.3)?);
    acc.add(vec![Some(a.clone()), Some(b.clone())])?;
    acc.add(vec![Some(b.clone()), Some(a.clone())])?;
    let sums = acc.take();
    let want = [((&shared + &a)? + &b)?, ((&shared + &b)? + &a)?];
    for (i, (s, w)) in sums.iter().zip(&want).enumerate() {
        assert_eq!(bits(s.as_ref().expect("summed"))?, bits(w)?, "sum {i}");
    }
    assert_eq!(
        bits(&shared)?,
        before,
        "the shared gradient was written into"
    );
    Ok(())
}
