//! Few-shot classification: CNN backbones (Conv4/6, ResNet10/18/34) and the heads of the Few-Shot
//! Cosine Transformer (FSCT, cosine and softmax attention) and ProtoNet, with the parameter names
//! of the reference PyTorch code (vinuni-vishc/Few-Shot-Cosine-Transformer).

pub(crate) mod backbone;
mod batch_norm;
pub(crate) mod head;

pub use backbone::{Backbone, BackboneKind};
pub use batch_norm::BatchNorm2d;
pub use head::{Episode, FewShotModel, Method};
