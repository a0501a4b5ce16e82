//! Creates a model's parameters with Hugging Face names, from a checkpoint or a seeded
//! initialiser, into a [`ParamStore`].

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var, WithDType};

use crate::error::{Error, Result};
use crate::rng::SplitMix64;
use crate::store::ParamStore;
use crate::weights::SafetensorsFiles;

/// How a parameter is initialised when no checkpoint provides it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    Const(f64),
    /// Normal(0, std).
    Normal {
        std: f64,
    },
    /// Uniform(-bound, bound).
    Uniform {
        bound: f64,
    },
}

/// Creates parameters under a name prefix, loading them from a checkpoint when one is attached.
///
/// Mirrors the shape of candle's `VarBuilder` (`pp` for a sub-module, `get` for a tensor), with
/// three differences that matter for training: parameters are registered in a [`ParamStore`]
/// with their full names, trainable ones are `Var`s created without an extra copy, and a missing
/// or misshapen tensor is an error that names the file and the tensor.
#[derive(Clone)]
pub struct ParamBuilder {
    store: Arc<ParamStore>,
    source: Option<Arc<SafetensorsFiles>>,
    prefix: String,
    dtype: DType,
    device: Device,
    trainable: bool,
    seed: u64,
    shapes_only: bool,
}

impl ParamBuilder {
    /// Trainable parameters of `dtype` on `device`, initialised from `seed` unless a source is set.
    pub fn new(store: Arc<ParamStore>, dtype: DType, device: &Device, seed: u64) -> Self {
        ParamBuilder {
            store,
            source: None,
            prefix: String::new(),
            dtype,
            device: device.clone(),
            trainable: true,
            seed,
            shapes_only: false,
        }
    }

    /// Records every parameter's name and shape without allocating it: each is a one-element
    /// tensor broadcast to its shape. For counting a model that does not fit in memory (the full
    /// SDXL UNet's memory plan); such a model can be built and counted, not run or trained.
    pub fn shapes_only(mut self) -> Self {
        self.shapes_only = true;
        self
    }

    /// Loads every parameter from `files` instead of initialising it.
    pub fn with_source(mut self, files: Arc<SafetensorsFiles>) -> Self {
        self.source = Some(files);
        self
    }

    /// Parameters created from here on are frozen (plain tensors, no gradient).
    pub fn frozen(mut self) -> Self {
        self.trainable = false;
        self
    }

    /// Parameters created from here on have `dtype`.
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The builder for sub-module `name` (`encoder` then `block.0` gives `encoder.block.0.*`).
    pub fn pp(&self, name: impl AsRef<str>) -> Self {
        let mut b = self.clone();
        b.prefix = self.full_name(name.as_ref());
        b
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn store(&self) -> &Arc<ParamStore> {
        &self.store
    }

    fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        }
    }

    /// The parameter `name` of `shape`: an existing one of that name (weights tied between
    /// modules), else loaded from the source, else initialised with `init`.
    pub fn get(&self, shape: &[usize], name: &str, init: Init) -> Result<Tensor> {
        let full = self.full_name(name);
        if let Some(t) = self.store.get(&full) {
            if t.dims() != shape {
                return Err(Error::Invalid(format!(
                    "parameter `{full}` exists with shape {:?}, asked for {shape:?}",
                    t.dims()
                )));
            }
            return Ok(t);
        }
        if self.shapes_only {
            let t = Tensor::zeros((), self.dtype, &self.device)?.broadcast_as(shape)?;
            self.store.insert(full, t.clone(), self.trainable);
            return Ok(t);
        }
        let t = match &self.source {
            Some(files) => {
                files.load(&full, Some(shape), self.dtype, &self.device, self.trainable)?
            }
            None => self.init(&full, shape, init)?,
        };
        self.store.insert(full, t.clone(), self.trainable);
        Ok(t)
    }

    /// A non-trainable state tensor that the model updates in place (batch-norm running
    /// statistics): a `Var` for `set`, registered as frozen so optimizers skip it and checkpoints
    /// keep it.
    pub fn buffer(&self, shape: &[usize], name: &str, init: Init) -> Result<Var> {
        let full = self.full_name(name);
        if let Some(t) = self.store.get(&full) {
            return Ok(Var::from_tensor(&t)?);
        }
        let mut b = self.clone();
        b.trainable = true; // creates a Var
        let t = match &self.source {
            Some(files) if files.meta(&full).is_some() => {
                files.load(&full, Some(shape), self.dtype, &self.device, true)?
            }
            _ => b.init(&full, shape, init)?,
        };
        self.store.insert(full, t.clone(), false);
        Ok(Var::from_tensor(&t)?)
    }

    fn init(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let mut rng = SplitMix64::new(self.seed ^ crate::rng::hash_str(name));
        fn sample(init: Init, rng: &mut SplitMix64) -> f64 {
            match init {
                Init::Zeros => 0.0,
                Init::Ones => 1.0,
                Init::Const(c) => c,
                Init::Normal { std } => rng.normal() * std,
                Init::Uniform { bound } => (rng.uniform() * 2.0 - 1.0) * bound,
            }
        }
        /// Tensors of at least this many elements are filled in parallel chunks, each with its
        /// own stream derived from the tensor's seed: a FLAN-T5-XL from random weights took
        /// 100 s on one core. Smaller tensors (every test model's) keep one sequential stream.
        const PARALLEL_FROM: usize = 1 << 20;
        const CHUNK: usize = 1 << 16;
        fn fill<T: WithDType>(n: usize, init: Init, rng: &mut SplitMix64) -> Vec<T> {
            if n < PARALLEL_FROM {
                return (0..n).map(|_| T::from_f64(sample(init, rng))).collect();
            }
            use rayon::prelude::*;
            let base = rng.next_u64();
            let mut out = vec![T::zero(); n];
            out.par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, chunk)| {
                    let mut r =
                        SplitMix64::new(base ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    for x in chunk.iter_mut() {
                        *x = T::from_f64(sample(init, &mut r));
                    }
                });
            out
        }
        let dev = &self.device;
        let tr = self.trainable;
        let t = match self.dtype {
            DType::F32 => {
                SafetensorsFiles::host_vec_tensor(fill::<f32>(n, init, &mut rng), shape, dev, tr)?
            }
            DType::F64 => {
                SafetensorsFiles::host_vec_tensor(fill::<f64>(n, init, &mut rng), shape, dev, tr)?
            }
            DType::BF16 => SafetensorsFiles::host_vec_tensor(
                fill::<half::bf16>(n, init, &mut rng),
                shape,
                dev,
                tr,
            )?,
            DType::F16 => SafetensorsFiles::host_vec_tensor(
                fill::<half::f16>(n, init, &mut rng),
                shape,
                dev,
                tr,
            )?,
            other => {
                return Err(Error::Invalid(format!(
                    "parameter `{name}`: unsupported dtype {other:?}"
                )))
            }
        };
        Ok(t)
    }
}
