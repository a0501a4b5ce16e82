//! Which segments keep their graph and which are recomputed: the `--checkpointing` strategies.
//!
//! Every strategy gives the same gradients (plain backprop's, bit for bit on CPU f32 when no
//! parameter is shared between segments); they differ in what stays alive between forward and
//! backward and in how much forward work backward repeats:
//!
//! | strategy | kept until its backward | recomputed |
//! |---|---|---|
//! | `none` | the whole graph, until the backward returns (candle's `backward()`) | nothing |
//! | `blocks` | each segment's graph, dropped as soon as its backward ends | nothing |
//! | `full` | each segment's inputs and output | every segment |
//! | `full-host` | as `full`, with the inputs and outputs between segments in host memory | every segment |
//! | `every:K` | the graphs of the segments not recomputed | segments 0, K, 2K, ... |
//! | `budget:BYTES` | the graphs that fit in BYTES, the last segments first | the others |

use std::fmt;
use std::str::FromStr;

/// A checkpointing strategy (see the module's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Strategy {
    /// No segments: candle's backward over the whole graph.
    #[default]
    None,
    /// Segment graphs kept and cut from each other; each is freed when its backward ends.
    Blocks,
    /// Every segment recomputed in backward (what `--gradient-checkpointing` means).
    Full,
    /// As `Full`, with the tensors passed between segments kept in host memory (kohya's
    /// `--cpu_offload_checkpointing`, PyTorch's `save_on_cpu`): each segment's input is brought
    /// to the device for its forward and again for its recompute.
    FullHost,
    /// Segment `i` recomputed when `i % K == 0`, the others kept as in `Blocks`.
    Every(usize),
    /// Keep the segments' graphs within this many bytes, the last segments first; recompute
    /// the rest ([`budget_keeps`], on the sizes measured in the first step, which recomputes
    /// every segment).
    Budget(u64),
}

/// What one segment does in the current forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Treatment {
    /// Run plainly: part of the caller's graph.
    Plain,
    /// Its graph kept, cut from the rest, freed after its backward.
    Keep,
    /// Only its inputs kept; recomputed in backward.
    Recompute,
    /// Recomputed, its inputs and output held in host memory.
    RecomputeOnHost,
}

impl Strategy {
    /// `true` when `--gradient-checkpointing` (the alias of `full`) should be reported as on:
    /// anything that recomputes.
    pub fn recomputes(self) -> bool {
        matches!(
            self,
            Strategy::Full | Strategy::FullHost | Strategy::Every(_) | Strategy::Budget(_)
        )
    }

    /// `true` when the model runs as separate segments (every strategy but `none`): what a
    /// fused backward pass needs, since a segment's parameter gradients are final when its
    /// backward ends.
    pub fn segmented(self) -> bool {
        self != Strategy::None
    }

    /// The treatment of segment `index` (in forward order); `recompute` is the budget plan,
    /// when one has been made.
    pub(crate) fn treatment(self, index: usize, recompute: Option<&[bool]>) -> Treatment {
        match self {
            Strategy::None => Treatment::Plain,
            Strategy::Blocks => Treatment::Keep,
            Strategy::Full => Treatment::Recompute,
            Strategy::FullHost => Treatment::RecomputeOnHost,
            Strategy::Every(k) if index.is_multiple_of(k.max(1)) => Treatment::Recompute,
            Strategy::Every(_) => Treatment::Keep,
            // Before the plan (the first step) and for segments the plan has not seen (a longer
            // input), recompute: the least memory.
            Strategy::Budget(_) => match recompute.and_then(|r| r.get(index)) {
                Some(false) => Treatment::Keep,
                _ => Treatment::Recompute,
            },
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::None => write!(f, "none"),
            Strategy::Blocks => write!(f, "blocks"),
            Strategy::Full => write!(f, "full"),
            Strategy::FullHost => write!(f, "full-host"),
            Strategy::Every(k) => write!(f, "every:{k}"),
            Strategy::Budget(b) => write!(f, "budget:{}", crate::bytes::format_bytes(*b as i64)),
        }
    }
}

impl FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "checkpointing `{s}`: use none, blocks, full, full-host, every:K (K >= 1) or budget:SIZE \
                 (e.g. budget:300MiB)"
            )
        };
        Ok(match t {
            "none" => Strategy::None,
            "blocks" => Strategy::Blocks,
            "full" => Strategy::Full,
            "full-host" => Strategy::FullHost,
            _ => match t.split_once(':') {
                Some(("every", k)) => match k.trim().parse::<usize>() {
                    Ok(k) if k >= 1 => Strategy::Every(k),
                    _ => return Err(bad()),
                },
                Some(("budget", b)) => Strategy::Budget(
                    crate::bytes::parse_bytes(b).map_err(|e| format!("{}: {e}", bad()))?,
                ),
                _ => return Err(bad()),
            },
        })
    }
}

/// The budget strategy's choice from what each segment holds when kept (`sizes`, in forward
/// order): from the last segment to the first, keep each that fits in what the budget has
/// left; recompute the rest. Returns, per segment, whether it is kept.
///
/// Why the last first: backward runs from the last segment, so a segment kept late is freed
/// early, and the segments rebuilt (the earlier ones) are rebuilt beside few kept graphs. The
/// peak is then the end of forward or a kept segment's backward, not a rebuild stacked on
/// everything kept. And the choice is a function of the sizes alone, which the plan knows
/// (`ActivationProfile::held`), so plan and run keep the same segments.
pub fn budget_keeps(sizes: &[u64], budget: u64) -> Vec<bool> {
    let mut left = budget;
    let mut keep = vec![false; sizes.len()];
    for (k, &size) in keep.iter_mut().zip(sizes).rev() {
        if size <= left {
            *k = true;
            left -= size;
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategies_parse_and_print() {
        for s in ["none", "blocks", "full", "every:3"] {
            assert_eq!(
                s.parse::<Strategy>().map(|x| x.to_string()),
                Ok(s.to_string())
            );
        }
        assert_eq!("budget:300MiB".parse(), Ok(Strategy::Budget(300 << 20)));
        assert!("every:0".parse::<Strategy>().is_err());
        assert!("sometimes".parse::<Strategy>().is_err());
        assert!("budget:lots".parse::<Strategy>().is_err());
    }

    #[test]
    fn every_k_recomputes_one_segment_in_k() {
        let t: Vec<Treatment> = (0..5)
            .map(|i| Strategy::Every(2).treatment(i, None))
            .collect();
        use Treatment::*;
        assert_eq!(t, [Recompute, Keep, Recompute, Keep, Recompute]);
        assert!((0..4).all(|i| Strategy::Every(1).treatment(i, None) == Recompute));
    }

    #[test]
    fn the_budget_keeps_the_last_segments_that_fit() {
        let sizes = [100, 100, 50, 10];
        assert_eq!(budget_keeps(&sizes, 1000), [true; 4]);
        assert_eq!(budget_keeps(&sizes, 160), [false, true, true, true]);
        assert_eq!(budget_keeps(&sizes, 110), [false, false, true, true]);
        assert_eq!(budget_keeps(&sizes, 0), [false; 4]);
        // A segment larger than what is left is passed over; earlier, smaller ones still fit.
        assert_eq!(
            budget_keeps(&[30, 20, 60, 50], 100),
            [true, true, false, true]
        );
        assert_eq!(budget_keeps(&[10, 20], 15), [true, false]);
        // Before a plan, and past its end, the budget strategy recomputes.
        let plan = [false, true];
        let b = Strategy::Budget(1);
        assert_eq!(b.treatment(0, None), Treatment::Recompute);
        assert_eq!(b.treatment(0, Some(&plan)), Treatment::Keep);
        assert_eq!(b.treatment(1, Some(&plan)), Treatment::Recompute);
        assert_eq!(b.treatment(2, Some(&plan)), Treatment::Recompute);
    }
}
