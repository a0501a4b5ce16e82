//! Distribution metrics of generated samples against real ones, from feature arrays on the
//! host: the MMD family (KID, CMMD) that diffusion evaluations report beside the loss.

mod mmd;

pub use mmd::{cmmd, kid, mmd2, Estimator, Features, Kernel};
