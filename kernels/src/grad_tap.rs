//! Parameter gradients an op hands over itself, past candle's gradient store.
//!
//! candle's backward sums every gradient an op returns into a slot it first fills with zeros
//! (`GradStore::or_insert`, then `add`): for a parameter used once, a zeroed tensor of its size
//! and an add that reads two and writes a third, to get back the gradient the op had formed. For
//! the weights of a network that is a pass over three times the model's size per backward, on
//! top of what the optimizer reads (a UNet's 32.8 M parameters: 525 MB a step).
//!
//! While a tap is open on this thread ([`open`]: the checkpointer opens one for each backward
//! it runs), an op that forms the gradient of a variable ([`hand_over`]: the linear layer's and
//! the convolution's weights and biases where they are this crate's one op, the CPU in f32 and
//! f64; the norms' weights and biases and the output projection of the cross-entropy wherever
//! they run) keeps it here and returns none to candle: the first gradient of a parameter is
//! kept as it is, a later one added to it (as candle would). The values are candle's, but a
//! `-0.0` stays `-0.0` where candle's `0 + g` made it `+0.0`, and a parameter that also gets
//! gradients through candle's store (a weight read by one of candle's ops too) is summed
//! store + tap rather than in the backward's order. Whoever reads the gradients takes both
//! ([`remove`]). With no tap open (a plain `loss.backward()`, a test, a finite
//! difference check) the ops return every gradient to candle as before. `FT_GRAD_TAP=0` keeps
//! it closed, for before-and-after measurements.
//!
//! Thread-local because candle runs an op's backward on the thread that called `backward`, and
//! tests run backwards on several threads at once.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, TensorId};

thread_local! {
    static TAP: RefCell<Option<HashMap<TensorId, Tensor>>> = const { RefCell::new(None) };
}

/// An open tap; closing it (on drop) forgets whatever was not taken.
#[must_use = "the tap closes when this is dropped"]
pub struct Tap {
    /// False when a tap was already open on this thread (then the outer one closes it).
    owner: bool,
}

impl Drop for Tap {
    fn drop(&mut self) {
        if self.owner {
            TAP.with(|t| t.borrow_mut().take());
        }
    }
}

/// Opens a tap on this thread until the returned guard is dropped (nested opens share the
/// outer tap).
pub fn open() -> Tap {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !crate::switched_on(&ON, "FT_GRAD_TAP") {
        return Tap { owner: false };
    }
    TAP.with(|t| {
        let mut t = t.borrow_mut();
        let owner = t.is_none();
        if owner {
            *t = Some(HashMap::new());
        }
        Tap { owner }
    })
}

/// An op's gradient `g` of its input `p`: kept by the tap when one is open and `p` is a
/// variable (then `None` goes back to candle), else returned as it is.
pub fn hand_over(p: &Tensor, g: Option<Tensor>) -> Result<Option<Tensor>> {
    let Some(g) = g else { return Ok(None) };
    if !p.is_variable() {
        return Ok(Some(g));
    }
    keep(p.id(), g)
}

/// Adds `g` to what the tap holds for `id`; `Some(g)` back when no tap is open.
fn keep(id: TensorId, g: Tensor) -> Result<Option<Tensor>> {
    TAP.with(|t| {
        let mut t = t.borrow_mut();
        let Some(map) = t.as_mut() else {
            return Ok(Some(g));
        };
        if let Some(sum) = sum(map.remove(&id), Some(g.detach()))? {
            map.insert(id, sum);
        }
        Ok(None)
    })
}

/// Puts back a gradient [`take`]n for `id` (added to whatever the tap got for it since): a
/// checkpoint segment sets aside what ops outside it handed over for its parameters while its
/// own backward runs, so that it hands on only the gradients it formed. Dropped when no tap
/// is open.
pub fn restore(id: TensorId, g: Tensor) -> Result<()> {
    keep(id, g).map(|_| ())
}

/// Takes the gradient the tap holds for `id`.
pub fn take(id: TensorId) -> Option<Tensor> {
    TAP.with(|t| t.borrow_mut().as_mut().and_then(|m| m.remove(&id)))
}

/// The whole gradient of `t` after a backward: what candle's store holds for it plus what the
/// tap holds, both taken.
pub fn remove(grads: &mut GradStore, t: &Tensor) -> Result<Option<Tensor>> {
    sum(grads.remove(t), take(t.id()))
}

/// `a + b` of two parts of one gradient, either of which may be missing: how the tap, the
/// checkpointer's sink and its end of backward put the parts together.
pub fn sum(a: Option<Tensor>, b: Option<Tensor>) -> Result<Option<Tensor>> {
    Ok(match (a, b) {
        (Some(a), Some(b)) => Some(a.add(&b)?),
        (a, b) => a.or(b),
    })
}
