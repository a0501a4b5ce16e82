//! Feature extractors of the few-shot literature (the "CloserLook" code FSCT builds on): Conv4 and
//! Conv6 (3x3 conv, batch norm, ReLU, 2x2 max pool per block, 64 channels), and ResNet10/18/34
//! (basic blocks). Features are flattened (the paper's choice: 64x5x5 for Conv4 at 84 px,
//! 512x7x7 for ResNet at 224 px) or globally average-pooled.
//!
//! Each block (and the ResNet stem) is one checkpoint segment. A segment that backward
//! recomputes runs its batch norms in [`BnMode::Recompute`], so the running statistics move
//! once per training forward whatever the strategy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle_core::{Tensor, Var, D};
use ft_kernels::batch_norm_pool::MaxPool;
use ft_kernels::conv::BnTail;
use ft_params::checkpoint::{Checkpointer, SegmentFn};
use ft_params::{Init, ParamBuilder};

use super::batch_norm::{BatchNorm2d, BnMode};
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
pub(crate) struct ConvBlock {
    pub(crate) conv: Conv,
    bn: BatchNorm2d,
    pub(crate) pool: bool,
}

#[derive(Clone)]
pub(crate) struct BasicBlock {
    pub(crate) c1: Conv,
    bn1: BatchNorm2d,
    pub(crate) c2: Conv,
    bn2: BatchNorm2d,
    pub(crate) shortcut: Option<(Conv, BatchNorm2d)>,
}

impl ConvBlock {
    fn forward(&self, x: &Tensor, mode: BnMode) -> candle_core::Result<Tensor> {
        let tail = match self.pool {
            true => BnTail::ReluMaxPool(MaxPool::square(2, 2, 0)),
            false => BnTail::Relu,
        };
        self.bn.forward_conv(&self.conv, x, mode, tail)
    }

    fn tensors(&self) -> Vec<Tensor> {
        let mut ts = self.conv.tensors();
        ts.extend(self.bn.tensors());
        ts
    }
}

impl BasicBlock {
    fn forward(&self, x: &Tensor, mode: BnMode) -> candle_core::Result<Tensor> {
        let h = self.bn1.forward_conv(&self.c1, x, mode, BnTail::Relu)?;
        let s = match &self.shortcut {
            Some((c, bn)) => bn.forward_conv(c, x, mode, BnTail::Plain)?,
            None => x.clone(),
        };
        // The second batch norm, the join and its ReLU: one op on the CPU.
        self.bn2.forward_add_relu(&self.c2.forward(&h)?, &s, mode)
    }

    fn tensors(&self) -> Vec<Tensor> {
        let mut ts = self.c1.tensors();
        ts.extend(self.bn1.tensors());
        ts.extend(self.c2.tensors());
        ts.extend(self.bn2.tensors());
        if let Some((c, bn)) = &self.shortcut {
            ts.extend(c.tensors());
            ts.extend(bn.tensors());
        }
        ts
    }
}

/// The ResNet stem: 7x7 stride-2 conv, batch norm, ReLU, 3x3 stride-2 max pool.
#[derive(Clone)]
pub(crate) struct Stem {
    pub(crate) conv: Conv,
    bn: BatchNorm2d,
}

impl Stem {
    fn forward(&self, x: &Tensor, mode: BnMode) -> candle_core::Result<Tensor> {
        // 3x3 stride-2 max pool with padding 1: after ReLU every value is >= 0, so zero
        // padding gives the result of PyTorch's -inf padding.
        let tail = BnTail::ReluMaxPool(MaxPool::square(3, 2, 1));
        self.bn.forward_conv(&self.conv, x, mode, tail)
    }

    fn tensors(&self) -> Vec<Tensor> {
        let mut ts = self.conv.tensors();
        ts.extend(self.bn.tensors());
        ts
    }
}

/// One checkpoint segment of the backbone.
#[derive(Clone)]
pub(crate) enum Block {
    Conv(ConvBlock),
    Stem(Stem),
    Basic(BasicBlock),
}

impl Block {
    fn forward(&self, x: &Tensor, mode: BnMode) -> candle_core::Result<Tensor> {
        match self {
            Block::Conv(b) => b.forward(x, mode),
            Block::Stem(b) => b.forward(x, mode),
            Block::Basic(b) => b.forward(x, mode),
        }
    }

    fn tensors(&self) -> Vec<Tensor> {
        match self {
            Block::Conv(b) => b.tensors(),
            Block::Stem(b) => b.tensors(),
            Block::Basic(b) => b.tensors(),
        }
    }
}

/// A backbone and its output size.
#[derive(Clone)]
pub struct Backbone {
    /// The blocks in order, each with its trainable parameters.
    pub(crate) blocks: Vec<(Block, Vec<Var>)>,
    pub(crate) flatten: bool,
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
                    blocks.push(Block::Conv(ConvBlock {
                        conv: conv(&b.pp("C"), if i == 0 { 3 } else { 64 }, 64, 3, 1, 1, true)?,
                        bn: BatchNorm2d::new(&b.pp("BN"), 64)?,
                        pool,
                    }));
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
                Backbone::of(blocks, flatten, feat_dim)
            }
            BackboneKind::ResNet10 | BackboneKind::ResNet18 | BackboneKind::ResNet34 => {
                let layers: [usize; 4] = match kind {
                    BackboneKind::ResNet10 => [1, 1, 1, 1],
                    BackboneKind::ResNet18 => [2, 2, 2, 2],
                    _ => [3, 4, 6, 3],
                };
                let mut blocks = vec![Block::Stem(Stem {
                    conv: conv(&pb.pp("trunk.0"), 3, 64, 7, 2, 3, false)?,
                    bn: BatchNorm2d::new(&pb.pp("trunk.1"), 64)?,
                })];
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
                        blocks.push(Block::Basic(BasicBlock {
                            c1: conv(&b.pp("C1"), cin, cout, 3, stride, 1, false)?,
                            bn1: BatchNorm2d::new(&b.pp("BN1"), cout)?,
                            c2: conv(&b.pp("C2"), cout, cout, 3, 1, 1, false)?,
                            bn2: BatchNorm2d::new(&b.pp("BN2"), cout)?,
                            shortcut,
                        }));
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
                Backbone::of(blocks, flatten, feat_dim)
            }
        }
    }

    fn of(blocks: Vec<Block>, flatten: bool, feat_dim: usize) -> Result<Self> {
        let blocks = blocks
            .into_iter()
            .map(|b| {
                let vars = b
                    .tensors()
                    .iter()
                    .filter(|t| t.is_variable())
                    .map(Var::from_tensor)
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok((b, vars))
            })
            .collect::<Result<_>>()?;
        Ok(Backbone {
            blocks,
            flatten,
            feat_dim,
        })
    }

    /// The trainable tensors of each checkpoint segment, in forward order (what the fused
    /// backward's plan counts per segment).
    pub fn segments(&self) -> Vec<Vec<Tensor>> {
        self.blocks.iter().map(|(b, _)| b.tensors()).collect()
    }

    /// The last block's map as features: flattened, or averaged over its positions.
    fn features(&self, h: Tensor) -> Result<Tensor> {
        Ok(if self.flatten {
            h.flatten_from(1)?
        } else {
            h.flatten_from(2)?.mean(D::Minus1)?
        })
    }

    /// Features [N, feat_dim] of images [N, 3, S, S]; each block a segment of `ck`.
    pub fn forward(&self, x: &Tensor, train: bool, ck: &Checkpointer) -> Result<Tensor> {
        if train && ck.is_inference() {
            // It would move the running statistics and hand out no gradient.
            return Err(ModelError::Invalid(
                "a training forward under Checkpointer::inference".into(),
            ));
        }
        let mut h = x.clone();
        for (block, vars) in &self.blocks {
            let b = block.clone();
            // The first run of a training segment moves the running statistics; a
            // recomputation in backward reads the same batch and leaves them.
            let first = Arc::new(AtomicBool::new(true));
            let infer = ck.is_inference();
            let f: SegmentFn = Arc::new(move |xs: &[Tensor]| {
                let mode = match (train, first.swap(false, Ordering::Relaxed)) {
                    (false, _) if infer => BnMode::Infer,
                    (false, _) => BnMode::Eval,
                    (true, true) => BnMode::Train,
                    (true, false) => BnMode::Recompute,
                };
                b.forward(&xs[0], mode)
            });
            h = ck.run(f, &[&h], vars)?;
        }
        self.features(h)
    }
}
