//! CLIP's two towers with Hugging Face tensor names. The text encoders as SDXL uses them:
//! CLIPTextModel (ViT-L) and CLIPTextModelWithProjection (OpenCLIP bigG), returning every
//! layer's hidden state (SDXL conditions on the penultimate one) and the pooled, optionally
//! projected, end-of-text feature. The vision tower (CLIPVisionModelWithProjection), whose
//! image embeddings CMMD compares.

mod encoder;
mod text;
mod text_config;
mod vision;
mod vision_config;

pub use text::{ClipTextModel, ClipTextOutput};
pub use text_config::ClipTextConfig;
pub use vision::{ClipVisionModel, ClipVisionOutput};
pub use vision_config::{ClipImageNorm, ClipVisionConfig};
