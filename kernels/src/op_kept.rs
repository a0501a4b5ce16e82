//! Bytes that ops keep for their backward beside the graph's tensors, counted where they are
//! kept.
//!
//! An op that holds a map of its own until its backward rather than as a node of the graph
//! (the convolution's output inside [`crate::conv::ConvBatchNorm`], which is no node so that
//! candle's backward forms no gradient slot for it) keeps bytes that a walk of the graph's
//! tensors cannot see. Such an op adds them here, on the thread that ran its forward, when its
//! output joins a graph; whoever measures what a forward keeps (the checkpointer's segments)
//! reads the count before and after. A running total per thread: a forward runs its ops on the
//! thread that called it, and tests run forwards on several threads at once.

use std::cell::Cell;

thread_local! {
    static ADDED: Cell<u64> = const { Cell::new(0) };
}

/// The bytes ops have kept beside a graph on this thread so far (never decreases: the
/// difference across a forward is what that forward's ops keep).
pub fn added() -> u64 {
    ADDED.with(|a| a.get())
}

/// Counts `bytes` an op keeps beside the graph it joins.
pub(crate) fn add(bytes: u64) {
    ADDED.with(|a| a.set(a.get().saturating_add(bytes)));
}
