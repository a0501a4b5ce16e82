//! The element types collectives move: what gradients, counts and hashes are made of.

/// A value the collectives can sum and move: f32, f64, u64, i64 and u8. Under the `mpi`
/// feature it is also an MPI datatype, so no conversion happens on the way.
#[cfg(not(feature = "mpi"))]
pub trait Element: Copy + Default + std::ops::AddAssign + Send + Sync + 'static {}

/// A value the collectives can sum and move: f32, f64, u64, i64 and u8. Under the `mpi`
/// feature it is also an MPI datatype, so no conversion happens on the way.
#[cfg(feature = "mpi")]
pub trait Element:
    Copy + Default + std::ops::AddAssign + Send + Sync + 'static + mpi::datatype::Equivalence
{
}

impl Element for f32 {}
impl Element for f64 {}
impl Element for u64 {}
impl Element for i64 {}
impl Element for u8 {}
