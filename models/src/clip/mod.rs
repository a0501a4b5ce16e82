//! CLIP text encoders as SDXL uses them: CLIPTextModel (ViT-L) and CLIPTextModelWithProjection
//! (OpenCLIP bigG), returning every layer's hidden state (SDXL conditions on the penultimate one)
//! and the pooled, optionally projected, end-of-text feature. Hugging Face tensor names.

mod config;
mod model;

pub use config::ClipTextConfig;
pub use model::{ClipTextModel, ClipTextOutput};
