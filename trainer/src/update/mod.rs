//! The update step: what turns a loss into new weights, between the optimizers' math and the
//! training loop.
//!
//! - [`Precision`] (storage dtype, fp32 masters or stochastic rounding) and [`LossScaler`] (f16).
//! - [`StepMode`]: plain, accumulated, or fused into the backward; decided once.
//! - [`GradAccumulator`] and [`LossNorm`]: accumulation that equals one large batch.
//! - [`all_reduce_gradients`]: a step's gradients summed over a data-parallel run's ranks;
//!   `rounds` and `reduce_backward`: summed inside the backward, a checkpoint segment at a time.
//! - [`zero`]: ZeRO-1/2, the optimizer state (and the summed gradients) partitioned over ranks.
//! - `norm`: global and per-tensor gradient norms, clipping factors.
//! - [`MixedOptimizer`]: masters, loss-scale check, clipping, the optimizer's update and the
//!   write-back, with the state beside the model or on the host ([`StatePlacement`]); its
//!   fused backward pass (`fused_backward`).

mod accumulate;
mod fused_backward;
pub(crate) mod gather;
mod mixed;
mod mode;
mod norm;
mod placement;
mod precision;
mod reduce;
mod reduce_backward;
#[cfg(feature = "nccl")]
mod reduce_gpu;
mod rounds;
mod scaler;
pub mod zero;

pub use accumulate::{GradAccumulator, LossNorm};
pub use fused_backward::FusedOutcome;
pub use mixed::{MixedOptimizer, OptimizerState, StepOutcome};
pub use mode::{StepMode, StepModeRequest};
pub use norm::{
    all_finite, clip_coefficient, clip_factor, clip_grad_norm, first_non_finite, global_norm,
    sum_of_squares, sum_of_squares_each,
};
pub use placement::StatePlacement;
pub use precision::Precision;
pub use reduce::all_reduce_gradients;
pub(crate) use reduce::bucket_values;
pub use rounds::BackwardRanks;
pub use scaler::LossScaler;
