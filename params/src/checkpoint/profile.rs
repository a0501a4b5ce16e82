//! What a forward keeps for its backward under each `--checkpointing` strategy, from what each
//! segment keeps (measured under `blocks`, or predicted by a model's activation formulas).
//!
//! The accounting is exact for the tensors a graph holds ([`super::graph_bytes`]): with `O` the
//! caller's graph when every segment runs as one op (the segments' outputs, the tensors between
//! them and everything outside them), `g_i` what segment `i` keeps run as one op (its graph
//! and the copies of its inputs that are its leaves, `c_i`) and `o_i`
//! its output,
//!
//! | strategy | held from forward to backward | rebuilt during backward, at most at once |
//! |---|---|---|
//! | `none` | `O + sum(g_i - c_i - o_i)` (no leaves; a segment's output is one tensor with the caller's) | 0 |
//! | `blocks` | `O + sum(g_i)` (the op's output is a copy of the graph's) | 0 |
//! | `full` | `O` | `max(g_i)` |
//! | `every:K` | `O + sum(g_i, i % K != 0)` | `max(g_i, i % K == 0)` |
//! | `budget:B` | `O + sum(g_i, i kept)` | `max(g_i, i not kept)` |
//! | `full-host` | `O - sum(o_i)` on the device, `sum(o_i)` on the host | `max(g_i)` |
//!
//! `budget:B` keeps the last segments that fit in B ([`super::budget_keeps`]): the run makes
//! the same choice from the sizes it measures in its first step.
//!
//! `full-host`'s split is an estimate: a segment's output that the model also reads outside the
//! segments (the UNet's skip connections and the ResNet outputs its transformers' norms read,
//! T5's last block of each stack) stays on the device as well, and each rebuild brings its
//! inputs back to the device.
//!
//! Backward's own temporaries (the gradients of activations in flight, the zeros candle's
//! backprop sums into, kernels' buffers) come on top. They are not tensors of the forward's
//! graph, so they are estimated, not counted: a model's formulas give, per strategy class, how
//! many times a segment's graph its backward needs beyond that graph ([`Temporaries`], measured
//! on the CPU by `trainer/tests/backward_temporaries.rs`), plus, where the formulas set it, a
//! segment's temporaries through ops one factor cannot follow (attention scores, a fused op's
//! maps its graph does not keep: [`SegmentBytes::op_temporaries`]).
//! [`ActivationProfile::held`] walks backward from the last segment to the first, each with the kept graphs of the segments
//! before it (those after it are freed by then), and takes the most.
//!
//! [`ActivationProfile::held_with`] adds two moments a plan needs beside that walk: the
//! optimizer step (after backward, or inside a fused backward at each segment's early step),
//! and the gradients backward has formed by each segment (those of the segments after it and
//! its own, where a plan would count one micro-batch's gradients whole at every moment).

use super::{SegmentBytes, Strategy};

/// A forward's activations: the caller's graph and each segment's, in forward order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActivationProfile {
    /// `O`: the caller's graph with every segment run as one op.
    pub outer: u64,
    pub segments: Vec<SegmentBytes>,
    /// Buffers ops keep for their backward that are not tensors of the graph (a fused loss's
    /// gradients), held under every strategy.
    pub op_held: u64,
    /// Backward's temporaries as multiples of a segment's graph.
    pub temporaries: Temporaries,
}

/// Backward's temporaries while it runs through a segment, in thousandths of that segment's
/// graph ([`SegmentBytes::kept`]), by how the segment was treated. They depend on the ops (a
/// batch norm built of elementwise ops has many gradients in flight, a matmul few), so each
/// model's formulas set them from a measurement of its blocks, and the test that measured them
/// keeps them honest at other shapes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Temporaries {
    /// No segments (`none`): one backward over the whole graph.
    pub whole: u32,
    /// A segment whose graph was kept until its backward (`blocks`).
    pub kept: u32,
    /// A segment rebuilt in backward, on top of its rebuilt graph.
    pub recomputed: u32,
}

impl Temporaries {
    fn of(permille: u32, graph: u64) -> u64 {
        (graph as u128 * permille as u128 / 1000) as u64
    }
}

/// The optimizer step's temporaries (its update's new values and intermediates,
/// `OptimSpec::step_bytes` of the largest tensor it updates at once), by where the step runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTemporaries {
    /// What each segment's moment inside backward adds, in forward order: under a fused
    /// backward its early step; in a data-parallel backward that sums each segment's
    /// gradients over the ranks as it ends, that round's buffers. It comes as soon as the
    /// segment's backward has produced its parameters' gradients, while its graph and the
    /// kept graphs of the segments before it are held.
    pub segments: Vec<u64>,
    /// The step after backward: of every parameter, when the run drops the graph first; under
    /// a fused backward, of those outside the segments, beside the caller's graph.
    pub after: u64,
    /// Whether the segments step inside backward (`--fused-backward`).
    pub fused: bool,
}

/// The gradients a backward forms, in bytes: each segment's own parameters' (those in no other
/// segment), in forward order, and the rest's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GradBytes {
    pub segments: Vec<u64>,
    pub outside: u64,
}

/// What a strategy keeps (see the module's table), in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// On the training device from the end of forward until backward frees it.
    pub kept: u64,
    /// The largest segment backward rebuilds (0 when it rebuilds none).
    pub recompute: u64,
    /// On top of `kept`, at most, while backward runs: the segment it is rebuilding and its
    /// temporaries (estimated: [`Temporaries`]), less the segment graphs it has freed by then.
    pub backward: u64,
    /// In host memory (`full-host`).
    pub host: u64,
    /// On top of `kept + backward`: what the optimizer step's temporaries add where its
    /// moment is higher than backward's (0 where they fit under backward's peak).
    pub step: u64,
    /// What a plan that counts one micro-batch's gradients whole beside `kept + backward +
    /// step` may take back: at the highest moment backward has freed some segment graphs and
    /// not yet formed some gradients ([`ActivationProfile::held_with`]).
    pub spare: u64,
}

impl Held {
    /// The most the activations and backward's temporaries hold on the device at once.
    pub fn peak(&self) -> u64 {
        (self.kept + self.backward + self.step).saturating_sub(self.spare)
    }

    /// Kept, rebuilt and host bytes as the cells of a markdown row (the README's activation
    /// tables).
    pub fn cells(&self) -> String {
        let f = |b: u64| crate::bytes::format_bytes(b as i64);
        format!(
            "{} | {} | {}",
            f(self.kept),
            f(self.recompute),
            f(self.host)
        )
    }
}

impl ActivationProfile {
    /// The sum of every segment's graph.
    fn graphs(&self) -> u64 {
        self.graphs_where(|_| true)
    }

    /// Each segment's graph, in forward order.
    fn sizes(&self) -> Vec<u64> {
        self.segments.iter().map(|s| s.kept()).collect()
    }

    /// The segments' ops in a graph without segments (`none`).
    fn unsegmented(&self) -> u64 {
        self.segments.iter().map(|s| s.unsegmented()).sum()
    }

    fn largest(&self, pick: impl Fn(usize) -> bool) -> u64 {
        let it = self.segments.iter().enumerate();
        it.filter(|(i, _)| pick(*i))
            .map(|(_, s)| s.kept())
            .max()
            .unwrap_or(0)
    }

    /// What `strategy` keeps, and the most backward adds to it.
    pub fn held(&self, strategy: Strategy) -> Held {
        let o = self.outer + self.op_held;
        let outputs: u64 = self.segments.iter().map(|s| s.output).sum();
        let all = self.largest(|_| true);
        // The caller's graph kept, the segment graphs kept, the largest rebuilt, host bytes.
        let (outer, graphs, recompute, host) = match strategy {
            Strategy::None => (o, self.unsegmented(), 0, 0),
            Strategy::Blocks => (o, self.graphs(), 0, 0),
            Strategy::Full => (o, 0, all, 0),
            Strategy::Every(_) | Strategy::Budget(_) => {
                let keep = self.kept_segments(strategy);
                (
                    o,
                    self.graphs_where(|i| keep[i]),
                    self.largest(|i| !keep[i]),
                    0,
                )
            }
            Strategy::FullHost => (o.saturating_sub(outputs), 0, all, outputs),
        };
        Held {
            kept: outer + graphs,
            recompute,
            backward: self.backward_walk(strategy).saturating_sub(graphs),
            host,
            step: 0,
            spare: 0,
        }
    }

    /// [`Self::held`] with the optimizer step's moment: after backward (the graph dropped,
    /// or under a fused backward the caller's graph still held), and under a fused backward
    /// (or with the ranks' rounds in segments) each segment's moment, beside the segment's
    /// graph and the kept graphs before it.
    /// Where the step's segments do not match the profile's, every segment is taken to step
    /// the largest of them.
    ///
    /// With `grads` (the gradients backward forms, outside a fused backward) it also finds
    /// what the plan may take back ([`Held::spare`]): a plan counts one micro-batch's gradients
    /// whole beside the activations, while backward forms them segment by segment, from the
    /// last, freeing the segments' graphs as it goes.
    pub fn held_with(
        &self,
        strategy: Strategy,
        step: &StepTemporaries,
        grads: Option<&GradBytes>,
    ) -> Held {
        let mut held = self.held(strategy);
        // The segment graphs `held` counts as kept; under `none` the whole graph, which each
        // moment of the walk already holds.
        let graphs = match strategy {
            Strategy::None => self.unsegmented(),
            _ => {
                let keep = self.kept_segments(strategy);
                self.graphs_where(|i| keep[i])
            }
        };
        let outer = held.kept.saturating_sub(graphs);
        let mut moment = if step.fused {
            outer + step.after
        } else {
            step.after
        };
        let walk = self.walk(strategy);
        if step.fused || !step.segments.is_empty() {
            let largest = step.segments.iter().copied().max().unwrap_or(0);
            let matched = step.segments.len() == self.segments.len();
            let before = self.kept_before(strategy);
            for (i, s) in self.segments.iter().enumerate() {
                let own = if matched { step.segments[i] } else { largest };
                // The graphs held at segment i's early step: under `none` the whole graph.
                let held_graphs = match strategy {
                    Strategy::None => graphs,
                    _ => before[i] + s.kept(),
                };
                moment = moment.max(outer + held_graphs + own);
            }
        }
        held.step = moment.saturating_sub(held.kept + held.backward);
        let Some(grads) = grads.filter(|g| g.segments.len() == self.segments.len()) else {
            return held;
        };
        // Each moment with the gradients formed by then: a segment's backward, with its own
        // parameters' and those of the segments after it (and, to be safe, every gradient
        // outside the segments); the end of backward, the caller's graph and every gradient;
        // the step after it.
        let all: u64 = grads.segments.iter().sum::<u64>() + grads.outside;
        let mut formed = grads.outside;
        let mut most = (outer + all).max(step.after + all);
        for (i, live) in walk.iter().enumerate().rev() {
            formed += grads.segments[i];
            most = most.max(outer + live + formed);
        }
        held.spare = (held.peak() + all).saturating_sub(most);
        held
    }

    /// Per segment, the kept graphs of the segments before it: what backward still holds of
    /// them when it reaches it.
    fn kept_before(&self, strategy: Strategy) -> Vec<u64> {
        let keep = self.kept_segments(strategy);
        let mut before = 0;
        let mut out = Vec::with_capacity(self.segments.len());
        for (s, k) in self.segments.iter().zip(&keep) {
            out.push(before);
            before += if *k { s.kept() } else { 0 };
        }
        out
    }

    /// The most segment graphs and temporaries hold at once while backward walks the segments
    /// from the last to the first: segment `i`'s graph (kept, or rebuilt) and temporaries, with
    /// the kept graphs of the segments before it. Under `none` candle's backward holds the whole
    /// graph until it returns.
    fn backward_walk(&self, strategy: Strategy) -> u64 {
        self.walk(strategy).into_iter().max().unwrap_or(0)
    }

    /// Per segment, what segment graphs and temporaries hold while backward runs through it
    /// ([`Self::backward_walk`] takes the most).
    fn walk(&self, strategy: Strategy) -> Vec<u64> {
        let t = self.temporaries;
        let of = Temporaries::of;
        let keep = self.kept_segments(strategy);
        let kept_before = self.kept_before(strategy);
        let whole = self.unsegmented();
        let it = self.segments.iter().enumerate();
        it.map(|(i, s)| {
            let g = s.kept();
            let of = |permille, g| of(permille, g) + s.op_temporaries;
            match strategy {
                Strategy::None => {
                    whole + Temporaries::of(t.whole, s.unsegmented()) + s.op_temporaries
                }
                _ if keep[i] => kept_before[i] + g + of(t.kept, g),
                _ => kept_before[i] + g + of(t.recomputed, g),
            }
        })
        .collect()
    }

    /// Per segment, whether `strategy` keeps its graph until its backward (rather than
    /// rebuilding it, or running it inside the caller's graph under `none`).
    fn kept_segments(&self, strategy: Strategy) -> Vec<bool> {
        let n = self.segments.len();
        match strategy {
            Strategy::Blocks => vec![true; n],
            Strategy::Every(k) => (0..n).map(|i| !i.is_multiple_of(k.max(1))).collect(),
            Strategy::Budget(b) => super::budget_keeps(&self.sizes(), b),
            Strategy::None | Strategy::Full | Strategy::FullHost => vec![false; n],
        }
    }

    fn graphs_where(&self, pick: impl Fn(usize) -> bool) -> u64 {
        let it = self.segments.iter().enumerate();
        it.filter(|(i, _)| pick(*i)).map(|(_, s)| s.kept()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_strategy_keeps_what_the_table_says() {
        let s = |graph, output| SegmentBytes {
            graph,
            output,
            ..SegmentBytes::default()
        };
        let p = ActivationProfile {
            outer: 1000,
            segments: vec![s(100, 10), s(300, 10), s(200, 10)],
            op_held: 5,
            temporaries: Temporaries::default(),
        };
        let h = |st: &str| p.held(st.parse().expect("strategy"));
        assert_eq!(h("none").peak(), 1005 + 600 - 30);
        assert_eq!(h("blocks").peak(), 1605);
        // Input copies are a segment's leaves: held by a kept segment, absent without segments.
        let mut q = p.clone();
        q.segments[1].inputs = 40;
        let h = |st: &str| q.held(st.parse().expect("strategy"));
        assert_eq!(h("none").peak(), 1005 + 600 - 30);
        assert_eq!(h("blocks").peak(), 1645);
        assert_eq!((h("full").kept, h("full").recompute), (1005, 340));
        let h = |st: &str| p.held(st.parse().expect("strategy"));
        assert_eq!((h("full").kept, h("full").recompute), (1005, 300));
        // Segments 0 and 2 recomputed, 1 kept.
        assert_eq!((h("every:2").kept, h("every:2").recompute), (1305, 200));
        // 250 B hold segment 0 (100) or segment 2 (200), not both: 200 at most.
        assert_eq!(h("budget:250B").kept, 1205);
        assert_eq!(
            h("full-host"),
            Held {
                kept: 975,
                recompute: 300,
                backward: 300,
                host: 30,
                step: 0,
                spare: 0,
            }
        );
    }

    #[test]
    fn backward_walks_the_segments_from_the_last() {
        let s = |graph| SegmentBytes {
            graph,
            ..SegmentBytes::default()
        };
        let p = ActivationProfile {
            outer: 0,
            segments: vec![s(1000), s(3000), s(2000)],
            op_held: 0,
            temporaries: Temporaries {
                whole: 1500,
                kept: 500,
                recomputed: 2000,
            },
        };
        let b = |st: &str| p.held(st.parse().expect("strategy")).backward;
        // The whole graph held, and the largest segment's temporaries.
        assert_eq!(b("none"), 4500);
        // The last segment (2000, with 1000 of temporaries) while the two before are kept.
        assert_eq!(b("blocks"), 1000);
        // The largest segment rebuilt (3000) with 6000 of temporaries.
        assert_eq!(b("full"), 9000);
        assert_eq!(b("full-host"), 9000);
        // Segments 0 and 2 rebuilt, 1 kept: segment 2 rebuilt (2000 + 4000) while segment 1's
        // 3000 are held, which are counted in `kept` already.
        assert_eq!(b("every:2"), 6000);
        // 1 KiB holds segment 0 alone (1000); segment 1 rebuilt with segment 0 kept before
        // it: 3000 rebuilt, 6000 of temporaries; the kept 1000 counted in `kept`.
        assert_eq!(b("budget:1KiB"), 10000 - 1000);
        // 2 KiB holds the last segment (2000), freed before segment 1 is rebuilt beside
        // nothing kept: 3000 + 6000, less the 2000 counted in `kept`.
        assert_eq!(b("budget:2KiB"), 9000 - 2000);
        assert_eq!(
            p.held("budget:2KiB".parse().expect("strategy")).recompute,
            3000
        );
        assert_eq!(p.held("full".parse().expect("strategy")).peak(), 9000);
    }

    /// A caller's graph of 100 and segments of 1000, 3000 and 2000, with temporaries of half a
    /// kept graph and a whole rebuilt one: the walk tests' profile.
    fn three_segments() -> ActivationProfile {
        let s = |graph| SegmentBytes {
            graph,
            ..SegmentBytes::default()
        };
        ActivationProfile {
            outer: 100,
            segments: vec![s(1000), s(3000), s(2000)],
            op_held: 0,
            temporaries: Temporaries {
                whole: 0,
                kept: 500,
                recomputed: 1000,
            },
        }
    }

    #[test]
    fn the_step_counts_where_it_runs() {
        let p = three_segments();
        let st = |x: &str| x.parse::<Strategy>().expect("strategy");
        // blocks: kept 6100, backward's peak the last segment's 1000 of temporaries.
        let plain = p.held(st("blocks"));
        assert_eq!((plain.kept, plain.backward, plain.step), (6100, 1000, 0));
        // After backward, the graph dropped: a step under backward's peak adds nothing, one
        // above it the difference.
        let after = |after| StepTemporaries {
            after,
            ..StepTemporaries::default()
        };
        assert_eq!(p.held_with(st("blocks"), &after(7000), None).step, 0);
        assert_eq!(p.held_with(st("blocks"), &after(9000), None).step, 1900);
        // Fused: segment 2 steps 2500 beside its graph and the two before it (100 + 6000 +
        // 2500 = 8600, 1500 above backward's 7100); segment 0's 4000 beside its own graph
        // alone (5100); the rest 500 after, beside the caller's graph.
        let fused = StepTemporaries {
            segments: vec![4000, 0, 2500],
            after: 500,
            fused: true,
        };
        assert_eq!(p.held_with(st("blocks"), &fused, None).step, 1500);
        // full: nothing kept; segment 1 rebuilt (3000) with 3000 of temporaries is backward's
        // peak (6100); segment 0's step 100 + 1000 + 4000 is under it.
        let full = p.held_with(st("full"), &fused, None);
        assert_eq!((full.kept + full.backward, full.step), (6100, 0));
        // Segments that do not match the profile's: each steps the largest.
        let unmatched = StepTemporaries {
            segments: vec![4000],
            ..fused
        };
        assert_eq!(
            p.held_with(st("full"), &unmatched, None).peak(),
            100 + 3000 + 4000
        );
    }

    #[test]
    fn gradients_are_counted_as_backward_forms_them() {
        let p = three_segments();
        let st = |x: &str| x.parse::<Strategy>().expect("strategy");
        let none = StepTemporaries::default();
        // Gradients: 4000 of segment 0's parameters, 100 each of 1 and 2, 50 outside.
        let grads = GradBytes {
            segments: vec![4000, 100, 100],
            outside: 50,
        };
        let all = 4250;
        // full: nothing kept (kept 100); backward's moments with the gradients formed by then:
        // segment 2 rebuilt 2000 + 2000 with 150 formed, segment 1 3000 + 3000 with 250,
        // segment 0 1000 + 1000 with 4250; the end 100 + 4250. The most: 100 + 6000 + 250.
        let h = p.held_with(st("full"), &none, Some(&grads));
        assert_eq!(h.peak() + all, 6350);
        assert_eq!(h.spare, 100 + 6000 + all - 6350);
        // Segments that do not match the profile's take nothing back.
        let short = GradBytes {
            segments: vec![4000],
            outside: 50,
        };
        assert_eq!(p.held_with(st("full"), &none, Some(&short)).spare, 0);
        // The step after backward, beside every gradient, when it is the highest moment.
        let step = StepTemporaries {
            after: 7000,
            ..StepTemporaries::default()
        };
        let h = p.held_with(st("full"), &step, Some(&grads));
        assert_eq!(h.peak() + all, 7000 + all);
        // none: the whole graph (6000) until backward returns, with each segment's
        // temporaries (none here) and the gradients formed by then; the most is at segment 0,
        // 100 + 6000 + 4250, where the plan without the walk counts the same.
        let h = p.held_with(st("none"), &none, Some(&grads));
        assert_eq!(h.peak() + all, 100 + 6000 + all);
        // With the largest gradients last in forward order, they form first: segment 2's
        // moment holds 6000 + 4050 of 4250, and the plan takes back the 200 of segments 0-1.
        let late = GradBytes {
            segments: vec![100, 100, 4000],
            outside: 50,
        };
        let h = p.held_with(st("none"), &none, Some(&late));
        assert_eq!(h.peak() + all, 100 + 6000 + all);
        let mut t = p.clone();
        t.temporaries.whole = 1000;
        // Segment 2 adds 2000 of temporaries with 4050 formed, segment 1 3000 with 4150,
        // segment 0 1000 with 4250: the most is segment 1's, 100 + 6000 + 3000 + 4150.
        let h = t.held_with(st("none"), &none, Some(&late));
        assert_eq!(h.peak() + all, 100 + 6000 + 3000 + 4150);
        // A fused step under `none` (the fit never picks it: a check of the walk alone) runs
        // beside the whole graph: 100 + 6000 and segment 2's own 30.
        let fused = StepTemporaries {
            segments: vec![10, 20, 30],
            fused: true,
            ..StepTemporaries::default()
        };
        assert_eq!(p.held_with(st("none"), &fused, None).peak(), 6130);
    }
}
