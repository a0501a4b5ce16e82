//! What every optimizer writes the same way: the stochastic rounding of bf16 weights without
//! masters, and the parameters weight decay skips.

/// Whether HF Trainer's `get_decay_parameter_names` leaves a parameter out of weight decay: a
/// name containing "bias" (T5's `relative_attention_bias` included, as in transformers) or a
/// layer norm's (T5's `layer_norm`, `final_layer_norm`).
pub fn hf_trainer_no_decay(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("bias") || n.contains("layer_norm") || n.contains("layernorm")
}

/// How an optimizer writes its updated weights and which ones decay, the same for every
/// optimizer: the stochastic-rounding seed of bf16 weights without masters (none: to nearest)
/// and the parameters weight decay skips (none unless told). Set through
/// [`super::Optimizer::set_stochastic_rounding`] and
/// [`super::Optimizer::exempt_from_weight_decay`].
#[derive(Debug, Clone, Default)]
pub struct WriteRules {
    pub(super) sr: Option<u64>,
    pub(super) exempt: Vec<bool>,
}

impl WriteRules {
    /// The stochastic-rounding seed, if bf16 weights are rounded stochastically.
    pub(crate) fn sr(&self) -> Option<u64> {
        self.sr
    }

    /// The weight decay parameter `i` gets from the configured `wd`.
    pub(crate) fn wd(&self, i: usize, wd: f64) -> f64 {
        if self.exempt.get(i).copied().unwrap_or(false) {
            0.0
        } else {
            wd
        }
    }
}
