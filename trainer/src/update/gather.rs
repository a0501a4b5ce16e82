//! Named tensors that a data-parallel run's ranks hold between them, taken by rank 0 one at a
//! time: a checkpoint's optimizer state under ZeRO, the shares of an EMA. Rank 0 writes the
//! whole into one file (or into its model) while never holding more than one tensor from the
//! other ranks; gathering it all first would put a second copy of every rank's share on rank 0
//! (a fifth of the model's moments from each of four ranks: gigabytes on a large model).
//!
//! Each rank but 0 sends a list of what it holds (names, dtypes, shapes: one line of JSON),
//! then each tensor's values as the bytes of its own dtype ([`append_bytes`], the one wire
//! format of the ranks' tensors, ZeRO's updated weights too: 8-bit codes in a byte a value,
//! bf16 in two), in name order ([`name_key`]). Rank 0 reads every list first, so it knows
//! the whole before the first tensor (what a file's header needs), then takes the tensors in
//! name order across the ranks, its own where it holds them: each rank's tensors arrive in
//! the order that rank sent them, so any number of ranks writes the file one process writes.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use ft_dist::Comm;
use ft_kernels::host::with_slice;
use ft_params::fs::TensorEntry;

use crate::error::{Error, Result};

/// Rank 0's side of a gather: the whole list, then the tensors in its order.
pub struct Gathered<'a> {
    comm: &'a Comm,
    /// Every rank's tensors in name order, with the rank holding each.
    entries: Vec<(TensorEntry, usize)>,
    /// Rank 0's own tensors, by name.
    own: HashMap<String, Tensor>,
    next: usize,
}

/// Every rank's `local` tensors, for rank 0 to take one at a time: `Some` on rank 0 (its own
/// list given to the others' lists), `None` on the other ranks once they have sent theirs.
/// Every rank must call it, and rank 0 must then take every tensor ([`Gathered::next`]).
pub fn gather(comm: &Comm, mut local: Vec<(String, Tensor)>) -> Result<Option<Gathered<'_>>> {
    local.sort_by(|(a, _), (b, _)| name_key(a).cmp(&name_key(b)));
    let me = comm.rank();
    if me != 0 {
        // Every dtype checked before the first send: an error after it would leave rank 0
        // waiting for a message that never comes. Each tensor is laid out as it goes, so the
        // sender holds one message at a time.
        for (name, t) in &local {
            travels(name, t.dtype())?;
        }
        let list: Vec<serde_json::Value> = local
            .iter()
            .map(|(n, t)| serde_json::json!([n, t.dtype().as_str(), t.dims()]))
            .collect();
        let header = serde_json::Value::from(list).to_string().into_bytes();
        comm.send(&[header.len() as u64], 0)?;
        comm.send(&header, 0)?;
        for (_, t) in &local {
            comm.send(&message(t)?, 0)?;
        }
        return Ok(None);
    }
    let mut entries: Vec<(TensorEntry, usize)> = local
        .iter()
        .map(|(n, t)| (TensorEntry::of(n, t), 0))
        .collect();
    for from in 1..comm.world() {
        let mut len = [0u64];
        comm.recv(&mut len, from)?;
        let mut header = vec![0u8; len[0] as usize];
        comm.recv(&mut header, from)?;
        let list: Vec<(String, String, Vec<usize>)> = serde_json::from_slice(&header)
            .map_err(|e| Error::Invalid(format!("rank {from}'s list of tensors: {e}")))?;
        for (name, dtype, shape) in list {
            let dtype: DType = dtype.parse().map_err(|_| {
                Error::Invalid(format!("rank {from}'s tensor `{name}`: dtype {dtype}"))
            })?;
            entries.push((TensorEntry { name, dtype, shape }, from));
        }
    }
    // Stable: each rank's own order (already by name) is kept.
    entries.sort_by(|(a, _), (b, _)| name_key(&a.name).cmp(&name_key(&b.name)));
    Ok(Some(Gathered {
        comm,
        entries,
        own: local.into_iter().collect(),
        next: 0,
    }))
}

impl Gathered<'_> {
    /// What every rank holds, in the order [`Gathered::next`] hands it out.
    pub fn entries(&self) -> Vec<TensorEntry> {
        self.entries.iter().map(|(e, _)| e.clone()).collect()
    }

    /// The next tensor with its name: rank 0's own as it holds it, another rank's on the host.
    pub fn next(&mut self) -> Result<Option<(String, Tensor)>> {
        let Some((entry, from)) = self.entries.get(self.next) else {
            return Ok(None);
        };
        self.next += 1;
        let t = if *from == 0 {
            self.own
                .remove(&entry.name)
                .ok_or_else(|| Error::Invalid(format!("tensor `{}` is listed twice", entry.name)))?
        } else {
            let mut buf = vec![0u8; message_len(entry)];
            self.comm.recv(&mut buf, *from)?;
            from_bytes(&buf, entry.dtype, &entry.shape, &Device::Cpu)?
        };
        Ok(Some((entry.name.clone(), t)))
    }

    /// Writes every tensor into one safetensors file at `path` as it arrives; returns the
    /// names written, in order.
    pub fn write(mut self, path: &std::path::Path) -> Result<Vec<String>> {
        let entries = self.entries();
        ft_params::fs::save_safetensors_streamed(path, &entries, |i| match self.next()? {
            Some((_, t)) => Ok(t),
            None => Err(Error::Invalid(format!("tensor {i} of a gather never came"))),
        })?;
        Ok(entries.into_iter().map(|e| e.name).collect())
    }
}

/// `exp_avg.12` as (`exp_avg`, 12, the name), so parameter 12 comes after parameter 2; a name
/// without a numeric last part sorts by itself after those with one of the same prefix.
pub(crate) fn name_key(name: &str) -> (&str, usize, &str) {
    match name.rsplit_once('.') {
        Some((kind, i)) => (kind, i.parse().unwrap_or(usize::MAX), name),
        None => (name, 0, name),
    }
}

/// The bytes of `t`'s values in its own dtype: the length of what [`append_bytes`] appends.
pub(crate) fn byte_len(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// What a rank sends of tensor `t`: its values in its own dtype's bytes.
fn message(t: &Tensor) -> Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(byte_len(t));
    append_bytes(t, &mut bytes)?;
    Ok(bytes)
}

/// The length of the [`message`] of the tensor `entry` lists.
fn message_len(entry: &TensorEntry) -> usize {
    entry.shape.iter().product::<usize>() * entry.dtype.size_in_bytes()
}

/// Whether a tensor of `dtype` can travel between ranks ([`append_bytes`]'s dtypes: those of
/// weights, masters, optimizer state and 8-bit codes).
fn travels(name: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 | DType::U8 => Ok(()),
        other => Err(Error::Invalid(format!(
            "`{name}`: a {other:?} tensor cannot travel between ranks"
        ))),
    }
}

/// `t`'s values appended to `out` as the bytes of its own dtype (native order): what every
/// tensor sent between ranks is, ZeRO's updated weights as the model holds them (bf16 in two
/// bytes a value) and the gathered state. [`from_bytes`] reads them back bit for bit.
pub(crate) fn append_bytes(t: &Tensor, out: &mut Vec<u8>) -> Result<()> {
    travels("a tensor", t.dtype())?;
    // Read where it lies (a host tensor in place, with no typed copy beside the message; a
    // GPU one copied to the host first), laid out contiguously when it is a view.
    let t = t.to_device(&Device::Cpu)?;
    let t = match t.is_contiguous() {
        true => t,
        false => t.contiguous()?,
    };
    let read = match t.dtype() {
        DType::F32 => with_slice(&t, |s: &[f32]| put(out, s, |v| v.to_ne_bytes())),
        DType::F64 => with_slice(&t, |s: &[f64]| put(out, s, |v| v.to_ne_bytes())),
        DType::BF16 => with_slice(&t, |s: &[half::bf16]| {
            put(out, s, |v| v.to_bits().to_ne_bytes())
        }),
        DType::F16 => with_slice(&t, |s: &[half::f16]| {
            put(out, s, |v| v.to_bits().to_ne_bytes())
        }),
        DType::U8 => with_slice(&t, |s: &[u8]| out.extend_from_slice(s)),
        _ => None,
    };
    read.ok_or_else(|| Error::Invalid("a tensor to send could not be read on the host".into()))
}

/// `values` appended to `out`, each as its `N` bytes.
fn put<T: Copy, const N: usize>(out: &mut Vec<u8>, values: &[T], bytes: impl Fn(T) -> [u8; N]) {
    out.reserve(values.len() * N);
    for &v in values {
        out.extend_from_slice(&bytes(v));
    }
}

/// What [`append_bytes`] wrote of one tensor, back as a tensor of `dtype` and `dims` on
/// `device`.
pub(crate) fn from_bytes(
    bytes: &[u8],
    dtype: DType,
    dims: &[usize],
    device: &Device,
) -> Result<Tensor> {
    Ok(Tensor::from_raw_buffer(bytes, dtype, dims, &Device::Cpu)?.to_device(device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_travel_in_their_own_dtype_bit_for_bit() -> Result<()> {
        let t = Tensor::new(&[1.5f32, -3.25e-5, 7e30, f32::NAN, -0.0], &Device::Cpu)?;
        let bits = |x: &Tensor| -> Result<Vec<u8>> {
            let mut b = Vec::new();
            append_bytes(x, &mut b)?;
            Ok(b)
        };
        for (dt, width) in [
            (DType::F32, 4),
            (DType::F64, 8),
            (DType::BF16, 2),
            (DType::F16, 2),
        ] {
            let x = t.to_dtype(dt)?.reshape((5, 1))?;
            let mut b = vec![7u8];
            append_bytes(&x, &mut b)?;
            // Appended after what was there, a value in its dtype's width: a bf16 model's
            // weights in half the bytes of their fp32 masters.
            assert_eq!((b[0], b.len()), (7, 1 + 5 * width), "{dt:?}");
            let back = from_bytes(&b[1..], dt, &[5, 1], &Device::Cpu)?;
            assert_eq!((back.dtype(), back.dims()), (dt, &[5, 1][..]));
            assert_eq!(bits(&back)?, bits(&x)?, "{dt:?}");
        }
        // A view is sent as its values in order, as its contiguous copy is.
        let view = Tensor::arange(0f32, 6., &Device::Cpu)?
            .reshape((2, 3))?
            .t()?;
        assert_eq!(bits(&view)?, bits(&view.contiguous()?)?);
        let codes = Tensor::new(&[0u8, 9, 255], &Device::Cpu)?;
        assert_eq!(bits(&codes)?, [0, 9, 255]);
        assert!(append_bytes(&codes.to_dtype(DType::I64)?, &mut Vec::new()).is_err());
        Ok(())
    }

    /// A gathered tensor travels in its own dtype's bytes, as long as the list says: 8-bit
    /// codes in a byte a value, bf16 moments in two (not fp32's four), bit for bit.
    #[test]
    fn a_gathered_tensor_is_its_own_bytes() -> Result<()> {
        let v = Tensor::new(&[1.5f32, -3.25e-5, 7e30], &Device::Cpu)?;
        for (t, bytes) in [
            (Tensor::new(&[0u8, 9, 255, 4, 1], &Device::Cpu)?, 5),
            (v.to_dtype(DType::BF16)?, 6),
            (v.reshape((3, 1))?, 12),
        ] {
            let m = message(&t)?;
            let entry = TensorEntry::of("exp_avg.0", &t);
            assert_eq!((m.len(), message_len(&entry)), (bytes, bytes));
            let back = from_bytes(&m, entry.dtype, &entry.shape, &Device::Cpu)?;
            assert_eq!(message(&back)?, m);
        }
        Ok(())
    }

    /// One process: its own tensors in name order (parameter 12 after parameter 2), written
    /// whole.
    #[test]
    fn one_rank_takes_its_own_in_name_order() -> Result<()> {
        let comm = Comm::solo();
        let t = |v: f32| Tensor::new(&[v], &Device::Cpu);
        let local = vec![
            ("exp_avg.12".to_string(), t(12.)?),
            ("master.0".to_string(), t(0.)?),
            ("exp_avg.2".to_string(), t(2.)?),
            ("unet.bias".to_string(), t(5.)?),
            ("unet".to_string(), t(6.)?),
        ];
        let mut g = gather(&comm, local)?.expect("rank 0 takes them");
        let mut names = Vec::new();
        while let Some((name, _)) = g.next()? {
            names.push(name);
        }
        assert_eq!(
            names,
            ["exp_avg.2", "exp_avg.12", "master.0", "unet", "unet.bias"]
        );
        Ok(())
    }
}
