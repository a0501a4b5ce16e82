//! Nearest-neighbour upsampling by 2 whose backward accumulates.
//!
//! candle's `upsample_nearest2d` backward overwrites the input's gradient instead of adding to
//! it, so an input that also feeds another op (a UNet skip connection) loses a term. Here the op
//! is a broadcast then a reshape; both have correct backwards (the broadcast's sums each 2x2
//! block) and candle accumulates them like any other op.

use candle_core::{Result, Tensor};

/// [N, C, H, W] -> [N, C, 2H, 2W], each pixel repeated in a 2x2 block.
pub fn upsample_nearest2x(x: &Tensor) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    x.reshape((n, c, h, 1, w, 1))?
        .broadcast_as((n, c, h, 2, w, 2))?
        .reshape((n, c, 2 * h, 2 * w))
}
