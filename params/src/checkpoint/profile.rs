//! What a forward keeps for its backward under each `--checkpointing` strategy, from what each
//! segment keeps (measured under `blocks`, or predicted by a model's activation formulas).
//!
//! The accounting is exact for the tensors a graph holds ([`super::graph_bytes`]): with `O` the
//! caller's graph when every segment runs as one op (the segments' outputs, the tensors between
//! them and everything outside them), `g_i` what segment `i` keeps (its graph, and dropout
//! masks beside it) and `o_i` its output,
//!
//! | strategy | held from forward to backward | rebuilt during backward, at most at once |
//! |---|---|---|
//! | `none` | `O + sum(g_i - o_i)` (a segment's output is one tensor with the caller's) | 0 |
//! | `blocks` | `O + sum(g_i)` (the op's output is a copy of the graph's) | 0 |
//! | `full` | `O` | `max(g_i)` |
//! | `every:K` | `O + sum(g_i, i % K != 0)` | `max(g_i, i % K == 0)` |
//! | `budget:B` | `O + min(B, sum(g_i))` | `max(g_i)` |
//! | `full-host` | `O - sum(o_i)` on the device, `sum(o_i)` on the host | `max(g_i)` |
//!
//! `full-host`'s split is an estimate: a segment's output that the model also reads outside the
//! segments (the UNet's skip connections) stays on the device as well.

use super::{SegmentBytes, Strategy};

/// A forward's activations: the caller's graph and each segment's, in forward order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActivationProfile {
    /// `O`: the caller's graph with every segment run as one op.
    pub outer: u64,
    pub segments: Vec<SegmentBytes>,
    /// Buffers ops keep for their backward that are not tensors of the graph (a fused loss's
    /// gradients, dropout masks), held under every strategy.
    pub op_held: u64,
}

/// What a strategy keeps (see the module's table), in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// On the training device from the end of forward until backward frees it.
    pub kept: u64,
    /// On top of `kept` while backward rebuilds the largest recomputed segment.
    pub recompute: u64,
    /// In host memory (`full-host`).
    pub host: u64,
}

impl Held {
    /// The most the activations hold on the device at once.
    pub fn peak(&self) -> u64 {
        self.kept + self.recompute
    }
}

impl ActivationProfile {
    /// The sum of every segment's graph.
    fn graphs(&self) -> u64 {
        self.segments.iter().map(|s| s.kept()).sum()
    }

    fn largest(&self, pick: impl Fn(usize) -> bool) -> u64 {
        let it = self.segments.iter().enumerate();
        it.filter(|(i, _)| pick(*i))
            .map(|(_, s)| s.kept())
            .max()
            .unwrap_or(0)
    }

    /// What `strategy` keeps.
    pub fn held(&self, strategy: Strategy) -> Held {
        let o = self.outer + self.op_held;
        let outputs: u64 = self.segments.iter().map(|s| s.output).sum();
        match strategy {
            Strategy::None => Held {
                kept: o + self.graphs() - outputs,
                ..Held::default()
            },
            Strategy::Blocks => Held {
                kept: o + self.graphs(),
                ..Held::default()
            },
            Strategy::Full => Held {
                kept: o,
                recompute: self.largest(|_| true),
                host: 0,
            },
            Strategy::Every(k) => {
                let k = k.max(1);
                Held {
                    kept: o + self.graphs_where(|i| !i.is_multiple_of(k)),
                    recompute: self.largest(|i| i.is_multiple_of(k)),
                    host: 0,
                }
            }
            Strategy::Budget(b) => Held {
                kept: o + b.min(self.graphs()),
                recompute: self.largest(|_| true),
                host: 0,
            },
            Strategy::FullHost => Held {
                kept: o.saturating_sub(outputs),
                recompute: self.largest(|_| true),
                host: outputs,
            },
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
            off_graph: 0,
        };
        let p = ActivationProfile {
            outer: 1000,
            segments: vec![s(100, 10), s(300, 10), s(200, 10)],
            op_held: 5,
        };
        let h = |st: &str| p.held(st.parse().expect("strategy"));
        assert_eq!(h("none").peak(), 1005 + 600 - 30);
        assert_eq!(h("blocks").peak(), 1605);
        assert_eq!((h("full").kept, h("full").recompute), (1005, 300));
        // Segments 0 and 2 recomputed, 1 kept.
        assert_eq!((h("every:2").kept, h("every:2").recompute), (1305, 200));
        assert_eq!(h("budget:250B").kept, 1255);
        assert_eq!(
            h("full-host"),
            Held {
                kept: 975,
                recompute: 300,
                host: 30
            }
        );
    }
}
