//! Where the fp32 master weights and the optimizer state live.

/// Where the fp32 master weights and the optimizer state (AdamW's moments) live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatePlacement {
    /// Beside the model, on its device: the fastest step.
    #[default]
    WithModel,
    /// In host memory, as DeepSpeed's ZeRO-Offload does with the optimizer: the device keeps
    /// only the model's weights, its gradients and activations (2 + 2 bytes per bf16 parameter
    /// instead of 16). Each step moves a gradient to the host, updates its fp32 master and
    /// moments there, and writes the rounded weight back, one parameter at a time. fp32 masters
    /// exist even for an fp32 model: they are the values the host updates.
    Host,
}

impl StatePlacement {
    /// `true` -> [`StatePlacement::Host`].
    pub fn offload(host: bool) -> Self {
        if host {
            StatePlacement::Host
        } else {
            StatePlacement::WithModel
        }
    }
}
