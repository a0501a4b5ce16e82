//! The pre-LN transformer layers both CLIP towers share: self-attention and an MLP, each with
//! a residual; the text tower passes a causal mask, the vision tower none.

use candle_core::Tensor;
use ft_kernels::{activation, attention};
use ft_params::{Init, ParamBuilder};

use crate::error::{ModelError, Result};
use crate::layers::{Linear, Norm};

/// The MLP's activation: `quick_gelu` (OpenAI CLIP) or `gelu` (OpenCLIP bigG).
#[derive(Debug, Clone, Copy)]
pub(super) enum Act {
    QuickGelu,
    Gelu,
}

impl Act {
    pub fn parse(name: &str) -> std::result::Result<Act, String> {
        match name {
            "quick_gelu" => Ok(Act::QuickGelu),
            "gelu" => Ok(Act::Gelu),
            other => Err(format!(
                "hidden_act `{other}` is not supported (quick_gelu, gelu)"
            )),
        }
    }

    fn apply(self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            // x * sigmoid(1.702 x) = silu(1.702 x) / 1.702
            Act::QuickGelu => activation::silu(&(x * 1.702)?)? / 1.702,
            Act::Gelu => activation::gelu_erf(x),
        }
    }
}

/// The sizes of a tower's layers (transformers' config fields).
pub(super) struct Sizes {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub eps: f64,
    pub act: Act,
}

struct Layer {
    ln1: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: Norm,
    fc1: Linear,
    fc2: Linear,
}

/// `encoder.layers.{i}` of a CLIP tower.
pub(super) struct Encoder {
    layers: Vec<Layer>,
    heads: usize,
    act: Act,
}

impl Encoder {
    /// The layers under `pb` (a tower's `encoder` prefix).
    pub fn new(pb: &ParamBuilder, s: &Sizes) -> Result<Self> {
        if s.hidden == 0 || s.heads == 0 || !s.hidden.is_multiple_of(s.heads) {
            return Err(ModelError::Invalid(format!(
                "hidden_size {} must be a positive multiple of num_attention_heads {}",
                s.hidden, s.heads
            )));
        }
        let d = s.hidden;
        // CLIP's initialisation: N(0, 0.02) weights, zero biases.
        let lin = |pb: &ParamBuilder, din: usize, dout: usize| {
            Linear::with_init(pb, din, dout, true, Init::Normal { std: 0.02 })
        };
        let mut layers = Vec::with_capacity(s.layers);
        for i in 0..s.layers {
            let l = pb.pp(format!("layers.{i}"));
            let a = l.pp("self_attn");
            layers.push(Layer {
                ln1: Norm::layer(&l.pp("layer_norm1"), d, s.eps)?,
                q: lin(&a.pp("q_proj"), d, d)?,
                k: lin(&a.pp("k_proj"), d, d)?,
                v: lin(&a.pp("v_proj"), d, d)?,
                o: lin(&a.pp("out_proj"), d, d)?,
                ln2: Norm::layer(&l.pp("layer_norm2"), d, s.eps)?,
                fc1: lin(&l.pp("mlp.fc1"), d, s.intermediate)?,
                fc2: lin(&l.pp("mlp.fc2"), s.intermediate, d)?,
            });
        }
        Ok(Encoder {
            layers,
            heads: s.heads,
            act: s.act,
        })
    }

    /// Runs every layer on `x` [B, L, D] with the additive `mask` (broadcast to [B, H, L, L]);
    /// pushes each layer's output onto `hidden_states` and returns the last.
    pub fn forward(
        &self,
        mut x: Tensor,
        mask: Option<&Tensor>,
        hidden_states: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let (h, hd) = (self.heads, d / self.heads);
        let split = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((b, l, h, hd))?.transpose(1, 2)
        };
        for layer in &self.layers {
            let n = layer.ln1.forward(&x)?;
            let (q, k, v) = (
                split(layer.q.forward(&n)?)?,
                split(layer.k.forward(&n)?)?,
                split(layer.v.forward(&n)?)?,
            );
            let a = attention::attend(&q, &k, &v, mask, (hd as f64).powf(-0.5))?;
            let a = a.transpose(1, 2)?.reshape((b, l, d))?;
            x = (x + layer.o.forward(&a)?)?;
            let m = layer.fc2.forward(
                &self
                    .act
                    .apply(&layer.fc1.forward(&layer.ln2.forward(&x)?)?)?,
            )?;
            x = (x + m)?;
            hidden_states.push(x.clone());
        }
        Ok(x)
    }
}
