//! Failures on purpose, for the tests of what a failure leaves behind (where no input can make
//! the code fail at that point on one rank alone): `FT_FAULT=POINT:RANK:STEP` makes
//! [`fires`] say so (and [`at`] return an error) the first time the code reaches the place it names `POINT` on rank
//! `RANK` in the loop's step `STEP` (counted from 1, skipped steps too); once only, so that a step retried after it
//! goes through. Unset, [`fires`] is one load of a cached `None`.
//!
//! Points: `fused-round` (each round of the fused backward across ranks, where the others are
//! waiting in the same collective); `reduce-round` (before each segment's round of the plain
//! backward across ranks: the rank takes itself to have run out of memory there);
//! `fit-budget-forward` and `fit-budget-backward` (the check
//! of that phase's peak against the CPU `--fit` budget: the phase is taken to have passed it);
//! `nan-gradient` (the first tensor a rank offers to the fused backward's rounds in that step
//! turns NaN, as a micro-batch that diverged on that rank alone would make it).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// What `FT_FAULT` asks for: the point, the rank and the step.
type Spec = (String, usize, u64);

/// The points the code names (a spec naming another is refused: it would never fire).
const POINTS: [&str; 5] = [
    "fused-round",
    "reduce-round",
    "fit-budget-forward",
    "fit-budget-backward",
    "nan-gradient",
];

/// Parses `POINT:RANK:STEP`.
fn parse(text: &str) -> Result<Spec> {
    let bad = || {
        Error::Invalid(format!(
            "FT_FAULT={text:?}: expected POINT:RANK:STEP (as fused-round:1:3)"
        ))
    };
    let mut parts = text.split(':');
    let (Some(point), Some(rank), Some(step), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if !POINTS.contains(&point) {
        return Err(Error::Invalid(format!(
            "FT_FAULT={text:?}: no point `{point}` (the points: {})",
            POINTS.join(", ")
        )));
    }
    Ok((
        point.to_string(),
        rank.parse().map_err(|_| bad())?,
        step.parse().map_err(|_| bad())?,
    ))
}

/// Whether `FT_FAULT` names this point, rank and step and has not fired yet (it fires now); an
/// error when `FT_FAULT` is malformed.
pub fn fires(point: &str, rank: usize, step: u64) -> Result<bool> {
    static SPEC: OnceLock<Option<std::result::Result<Spec, String>>> = OnceLock::new();
    static FIRED: AtomicBool = AtomicBool::new(false);
    let spec = SPEC.get_or_init(|| {
        std::env::var("FT_FAULT")
            .ok()
            .map(|t| parse(&t).map_err(|e| e.to_string()))
    });
    match spec {
        None => Ok(false),
        Some(Err(e)) => Err(Error::Invalid(e.clone())),
        Some(Ok((p, r, s))) => {
            Ok(p == point && *r == rank && *s == step && !FIRED.swap(true, Ordering::Relaxed))
        }
    }
}

/// An error when [`fires`] says so (or `FT_FAULT` is malformed); else nothing.
pub fn at(point: &str, rank: usize, step: u64) -> Result<()> {
    if fires(point, rank, step)? {
        return Err(Error::Invalid(format!(
            "a failure made on purpose at {point}, rank {rank}, step {step} (FT_FAULT)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn the_spec_is_point_rank_step() {
        assert_eq!(
            parse("fused-round:1:3").ok(),
            Some(("fused-round".to_string(), 1, 3))
        );
        for bad in ["fused-round", "fused-round:1", "fused-round:x:3", "a:1:2:3"] {
            let e = parse(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("POINT:RANK:STEP"), "{bad}: {e}");
        }
        let e = parse("fused_round:1:3")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("no point `fused_round`"), "{e}");
    }
}
