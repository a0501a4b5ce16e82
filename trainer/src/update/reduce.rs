//! A step's gradients summed over the ranks of a data-parallel run, before the update.
//!
//! Each rank's accumulator holds the sum over its own micro-batches, each already divided by the
//! units (tokens or samples) of the whole step on all ranks, so the sum over the ranks is the
//! gradient one process would get from all the micro-batches: the ranks then take the same
//! update. The sums travel in fp32 through the host, in buckets of at most [`BUCKET`] values
//! (fewer, larger messages than one a tensor; a tensor larger than a bucket goes alone).

use candle_core::{DType, Device, Tensor, Var};
use ft_dist::Comm;

use crate::error::{Error, Result};

/// Values a message carries at most (16 MiB of fp32) unless one tensor is larger.
const BUCKET: usize = 4 << 20;

/// `grads` (one entry per parameter of `params`, `None` for a parameter without a gradient)
/// summed over the ranks of `comm`, as fp32 tensors on `device`. A parameter keeps `None` only
/// when no rank has a gradient for it (as one process skips it); a rank without one adds zeros.
/// The identity for a world of one.
pub fn all_reduce_gradients(
    comm: &Comm,
    grads: Vec<Option<Tensor>>,
    params: &[Var],
    device: &Device,
) -> Result<Vec<Option<Tensor>>> {
    if comm.world() == 1 {
        return Ok(grads);
    }
    if grads.len() != params.len() {
        return Err(Error::Invalid(format!(
            "{} gradients for {} parameters",
            grads.len(),
            params.len()
        )));
    }
    // Which parameters have a gradient on some rank: all ranks must reduce the same ones.
    let mut present: Vec<u64> = grads.iter().map(|g| g.is_some() as u64).collect();
    comm.all_reduce_sum(&mut present)?;
    let mut out: Vec<Option<Tensor>> = vec![None; grads.len()];
    let mut bucket: Vec<f32> = Vec::new();
    let mut members: Vec<usize> = Vec::new();
    for (i, g) in grads.into_iter().enumerate() {
        if present[i] == 0 {
            continue;
        }
        let n = params[i].elem_count();
        if !bucket.is_empty() && bucket.len() + n > BUCKET {
            flush(comm, &mut bucket, &mut members, params, device, &mut out)?;
        }
        match g {
            Some(g) => {
                if g.elem_count() != n {
                    return Err(Error::Invalid(format!(
                        "parameter {i}: a gradient of {} values for {n}",
                        g.elem_count()
                    )));
                }
                bucket.extend(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
            }
            None => bucket.resize(bucket.len() + n, 0.0),
        }
        members.push(i);
    }
    flush(comm, &mut bucket, &mut members, params, device, &mut out)?;
    Ok(out)
}

/// Sums `bucket` over the ranks and puts each member's part back as its parameter's gradient.
fn flush(
    comm: &Comm,
    bucket: &mut Vec<f32>,
    members: &mut Vec<usize>,
    params: &[Var],
    device: &Device,
    out: &mut [Option<Tensor>],
) -> Result<()> {
    if members.is_empty() {
        return Ok(());
    }
    comm.all_reduce_sum(bucket)?;
    let mut at = 0;
    for &i in members.iter() {
        let n = params[i].elem_count();
        let part = bucket
            .get(at..at + n)
            .ok_or_else(|| Error::Invalid(format!("parameter {i}: the reduced bucket is short")))?;
        out[i] = Some(Tensor::from_slice(part, params[i].shape(), device)?);
        at += n;
    }
    bucket.clear();
    members.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_keeps_the_gradients_as_they_are() -> Result<()> {
        let p = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let g = Tensor::new(&[0.5f32, -1.0], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let out = all_reduce_gradients(
            &Comm::solo(),
            vec![Some(g), None],
            &[p.clone(), p],
            &Device::Cpu,
        )?;
        assert_eq!(out[0].as_ref().map(|t| t.dtype()), Some(DType::BF16));
        assert!(out[1].is_none());
        Ok(())
    }
}
