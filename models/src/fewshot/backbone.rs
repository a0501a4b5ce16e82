//! Feature extractors of the few-shot literature (the "CloserLook" code FSCT builds on): Conv4 and
//! Conv6 (3x3 conv, batch norm, ReLU, 2x2 max pool per block, 64 channels), and ResNet10/18/34
//! (basic blocks). Features are flattened (the paper's choice: 64x5x5 for Conv4 at 84 px,
//! 512x7x7 for ResNet at 224 px) or globally average-pooled.

use candle_core::{Tensor, D};
use ft_kernels::pool;
use ft_params::{Init, ParamBuilder};

use super::batch_norm::BatchNorm2d;
use crate::error::{ModelError, Result};
use crate::layers::Conv2d as Conv;

/// Which backbone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackboneKind {
    Conv4,
    Conv6,
    ResNet10,
    ResNet18,
    ResNet34,
}

impl std::str::FromStr for BackboneKind {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "conv4" => BackboneKind::Conv4,
            "conv6" => BackboneKind::Conv6,
            "resnet10" => BackboneKind::ResNet10,
            "resnet18" => BackboneKind::ResNet18,
            "resnet34" => BackboneKind::ResNet34,
            other => {
                return Err(ModelError::Invalid(format!(
                    "unknown backbone `{other}` (conv4, conv6, resnet10, resnet18, resnet34)"
                )))
            }
        })
    }
}

/// A conv with the CloserLook code's Kaiming-normal (fan_out, ReLU) weights.
fn conv(
    pb: &ParamBuilder,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    padding: usize,
    bias: bool,
) -> Result<Conv> {
    let std = (2.0 / (cout * k * k) as f64).sqrt();
    Conv::with_init(
        pb,
        cin,
        cout,
        k,
        stride,
        padding,
        bias,
        Init::Normal { std },
    )
}

#[derive(Clone)]
struct ConvBlock {
    conv: Conv,
    bn: BatchNorm2d,
    pool: bool,
}

#[derive(Clone)]
struct BasicBlock {
    c1: Conv,
    bn1: BatchNorm2d,
    c2: Conv,
    bn2: BatchNorm2d,
    shortcut: Option<(Conv, BatchNorm2d)>,
}

impl BasicBlock {
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.bn1.forward(&self.c1.forward(x)?, train)?.relu()?;
        let h = self.bn2.forward(&self.c2.forward(&h)?, train)?;
        let s = match &self.shortcut {
            Some((c, bn)) => bn.forward(&c.forward(x)?, train)?,
            None => x.clone(),
        };
        Ok((h + s)?.relu()?)
    }
}

#[derive(Clone)]
enum Body {
    Conv(Vec<ConvBlock>),
    ResNet {
        stem: Conv,
        stem_bn: BatchNorm2d,
        blocks: Vec<BasicBlock>,
    },
}

/// A backbone and its output size.
#[derive(Clone)]
pub struct Backbone {
    body: Body,
    flatten: bool,
    /// Length of the feature vector for the configured image size.
    pub feat_dim: usize,
}

impl Backbone {
    /// Builds `kind` for `image_size` x `image_size` RGB inputs. `flatten` keeps the spatial map
    /// (the paper's choice); otherwise features are globally average-pooled.
    pub fn new(
        pb: &ParamBuilder,
        kind: BackboneKind,
        image_size: usize,
        flatten: bool,
    ) -> Result<Self> {
        let pb = pb.pp("feature");
        match kind {
            BackboneKind::Conv4 | BackboneKind::Conv6 => {
                let depth = if kind == BackboneKind::Conv4 { 4 } else { 6 };
                let mut blocks = Vec::new();
                let mut size = image_size;
                for i in 0..depth {
                    let b = pb.pp(format!("trunk.{i}"));
                    let pool = i < 4;
                    blocks.push(ConvBlock {
                        conv: conv(&b.pp("C"), if i == 0 { 3 } else { 64 }, 64, 3, 1, 1, true)?,
                        bn: BatchNorm2d::new(&b.pp("BN"), 64)?,
                        pool,
                    });
                    if pool {
                        size /= 2;
                    }
                }
                if size == 0 {
                    return Err(ModelError::Invalid(format!(
                        "images of {image_size} px are too small for {kind:?}"
                    )));
                }
                let feat_dim = if flatten { 64 * size * size } else { 64 };
                Ok(Backbone {
                    body: Body::Conv(blocks),
                    flatten,
                    feat_dim,
                })
            }
            BackboneKind::ResNet10 | BackboneKind::ResNet18 | BackboneKind::ResNet34 => {
                let layers: [usize; 4] = match kind {
                    BackboneKind::ResNet10 => [1, 1, 1, 1],
                    BackboneKind::ResNet18 => [2, 2, 2, 2],
                    _ => [3, 4, 6, 3],
                };
                let stem = conv(&pb.pp("trunk.0"), 3, 64, 7, 2, 3, false)?;
                let stem_bn = BatchNorm2d::new(&pb.pp("trunk.1"), 64)?;
                let mut blocks = Vec::new();
                let (mut cin, mut idx) = (64, 4);
                for (stage, n) in layers.iter().enumerate() {
                    let cout = 64 << stage;
                    for j in 0..*n {
                        let stride = if stage > 0 && j == 0 { 2 } else { 1 };
                        let b = pb.pp(format!("trunk.{idx}"));
                        idx += 1;
                        let shortcut = if stride != 1 || cin != cout {
                            Some((
                                conv(&b.pp("shortcut"), cin, cout, 1, stride, 0, false)?,
                                BatchNorm2d::new(&b.pp("BNshortcut"), cout)?,
                            ))
                        } else {
                            None
                        };
                        blocks.push(BasicBlock {
                            c1: conv(&b.pp("C1"), cin, cout, 3, stride, 1, false)?,
                            bn1: BatchNorm2d::new(&b.pp("BN1"), cout)?,
                            c2: conv(&b.pp("C2"), cout, cout, 3, 1, 1, false)?,
                            bn2: BatchNorm2d::new(&b.pp("BN2"), cout)?,
                            shortcut,
                        });
                        cin = cout;
                    }
                }
                // The stem conv, the max pool and the three strided stages each give
                // ceil(size / 2): 224 -> 112 -> 56 -> 28 -> 14 -> 7, 112 -> ... -> 4.
                let size = (0..5).fold(image_size, |s, _| s.div_ceil(2));
                if size == 0 {
                    return Err(ModelError::Invalid(format!(
                        "images of {image_size} px are too small for {kind:?}"
                    )));
                }
                let feat_dim = if flatten { 512 * size * size } else { 512 };
                Ok(Backbone {
                    body: Body::ResNet {
                        stem,
                        stem_bn,
                        blocks,
                    },
                    flatten,
                    feat_dim,
                })
            }
        }
    }

    /// Features [N, feat_dim] of images [N, 3, S, S].
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = match &self.body {
            Body::Conv(blocks) => {
                let mut h = x.clone();
                for b in blocks {
                    h = b.bn.forward(&b.conv.forward(&h)?, train)?.relu()?;
                    if b.pool {
                        h = pool::max_pool2d(&h, (2, 2), (2, 2))?;
                    }
                }
                h
            }
            Body::ResNet {
                stem,
                stem_bn,
                blocks,
            } => {
                let h = stem_bn.forward(&stem.forward(x)?, train)?.relu()?;
                // 3x3 stride-2 max pool with padding 1: after ReLU every value is >= 0, so zero
                // padding gives the result of PyTorch's -inf padding.
                let h = h.pad_with_zeros(2, 1, 1)?.pad_with_zeros(3, 1, 1)?;
                let mut h = pool::max_pool2d(&h, (3, 3), (2, 2))?;
                for b in blocks {
                    h = b.forward(&h, train)?;
                }
                h
            }
        };
        Ok(if self.flatten {
            h.flatten_from(1)?
        } else {
            h.flatten_from(2)?.mean(D::Minus1)?
        })
    }
}
