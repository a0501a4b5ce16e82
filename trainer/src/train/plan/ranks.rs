//! The plan of one rank of a data-parallel run: its ZeRO share of the optimizer state, masters
//! and sums, the sums over the ranks a segment at a time, and what those sums hold in flight.

use ft_params::Segments;

use super::{PlanRow, StatePlan};
use crate::optim::OptimSpec;

impl StatePlan {
    /// The plan of one rank of `world` under ZeRO `stage` (0: none, the plan unchanged), for
    /// the trainable tensors of `shapes` trained with `optim`: the optimizer state and fp32
    /// masters of the rank that owns the most (parameters assigned as
    /// [`crate::update::zero::partition`] assigns them), and under stage 2 the step's fp32
    /// gradient sums of its parameters alone. (With one micro-batch a step there is no
    /// accumulator: on the CPU the sums are counted where they arrive, when the gradients are
    /// summed over the ranks after backward or a segment at a time inside it, as under stage
    /// 1, by [`Self::with_sums_in_flight`] and [`Self::reduced_by_segment`]: a row held all
    /// along planned the medium T5 of `scripts/ranks-peaks.sh` 13.5% above its measured peak.
    /// On a GPU, where that has not been measured, such a row is kept. None under the fused
    /// backward, planned first.)
    pub fn per_rank(
        mut self,
        world: usize,
        stage: u8,
        shapes: &[Vec<usize>],
        optim: &OptimSpec,
    ) -> Self {
        if stage == 0 || world < 2 {
            return self;
        }
        let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        let owner = crate::update::zero::partition(&sizes, world);
        let most = |bytes: &dyn Fn(usize) -> u64| {
            (0..world)
                .map(|r| {
                    (0..sizes.len())
                        .filter(|&i| owner[i] == r)
                        .map(bytes)
                        .sum::<u64>()
                })
                .max()
                .unwrap_or(0)
        };
        let state = most(&|i| (optim.state_bytes)(&shapes[i]));
        let r = &mut self.rows[self.state_row];
        r.bytes = state;
        r.component = format!(
            "{}: this rank's share (ZeRO-{stage}, {world} ranks)",
            r.component
        );
        let fp32_share = most(&|i| 4 * sizes[i] as u64);
        if let Some(i) = self.masters_row {
            let r = &mut self.rows[i];
            r.bytes = fp32_share;
            r.component = format!("{}: this rank's share ({world} ranks)", r.component);
        }
        if stage == 2 {
            let label =
                format!("gradient sums of this rank's parameters (fp32, ZeRO-2, {world} ranks)");
            match self.sums_row {
                Some(i) => {
                    self.rows[i].bytes = fp32_share;
                    self.rows[i].component = label;
                }
                // One micro-batch a step under the fused backward: no sums; on the CPU,
                // counted where they arrive.
                None if self.fused || !self.gpu => {}
                // On a GPU (not measured since): held beside the state all along.
                None => {
                    let on_host = self.rows[self.state_row].on_host;
                    self.rows.push(PlanRow {
                        component: label,
                        bytes: fp32_share,
                        on_host,
                        activation: false,
                        less: false,
                    });
                }
            }
        }
        self
    }
    /// The plan of one of `world` ranks under ZeRO `stage` whose backward sums each checkpoint
    /// segment's gradients over the ranks as that segment's ends (`s`, the model's segments;
    /// `update/reduce_backward.rs`: a data-parallel run in segments without the fused
    /// backward). A micro-batch's gradients then never exist all at once, only those of the
    /// parameters outside every segment and of the largest segment (as under the fused
    /// backward); with one micro-batch a step, the fp32 sums arriving take their place (whole,
    /// or under ZeRO this rank's share); each round's bucket holds one segment's values, or
    /// the rest's.
    pub fn reduced_by_segment(
        mut self,
        world: usize,
        stage: u8,
        accum: usize,
        s: &Segments,
        shapes: &[Vec<usize>],
    ) -> Self {
        if world < 2 || self.fused {
            return self;
        }
        self.formed = None;
        // Under ZeRO-1 the last micro-batch's sums go out as they form and only this rank's
        // come back: with two micro-batches, the first one's gradients, or this rank's sums
        // with, at the last round, the fp32 sums of every tensor outside the segments formed
        // at once (`Offers::finish`).
        if accum == 2 && stage == 1 {
            let sizes = shapes.iter().map(|d| d.iter().product());
            let share = 4 * crate::update::zero::largest_share(&sizes.collect::<Vec<_>>(), world);
            let outside: u64 = s
                .outside
                .iter()
                .map(|d| d.iter().product::<usize>() as u64)
                .sum();
            let bytes = (self.grad_size * self.params).max(share as u64 + 4 * outside);
            self.sums_held_as_the_first_gradients(
                bytes,
                "each widened to fp32 and sent, or this rank's sums over the ranks",
            );
        }
        let rows = self.grad_rows.clone();
        let how = "(each segment's summed over the ranks as its backward ends)";
        self.bound_gradients(&rows, s, how);
        // (Under ZeRO-2 on a GPU, [`Self::per_rank`] holds a row of the sums all along.)
        if accum == 1 && (stage < 2 || !self.gpu) {
            let sizes: Vec<usize> = shapes.iter().map(|d| d.iter().product()).collect();
            let (values, whose) = if stage >= 1 {
                (
                    crate::update::zero::largest_share(&sizes, world) as u64,
                    "this rank's parameters",
                )
            } else {
                (self.params, "every parameter")
            };
            let on_host = self.grad_rows.iter().any(|&i| self.rows[i].on_host);
            // On the CPU the sums are counted where they have arrived (`arrived` below); after
            // the backward, all of them.
            if !self.gpu && !on_host {
                self.arriving = 4 * values;
            } else {
                self.rows.push(PlanRow {
                    component: format!(
                    "gradient sums over {world} ranks of {whose} (fp32, arriving in the backward)"
                ),
                    bytes: 4 * values,
                    on_host,
                    activation: false,
                    less: false,
                });
            }
        }
        let values = |shapes: &[Vec<usize>]| {
            crate::update::bucket_values(shapes.iter().map(|d| d.iter().product::<usize>())) as u64
        };
        let rounds = s.own.iter().map(|own| values(own));
        self.round_values = Some(rounds.chain([values(&s.outside)]).max().unwrap_or(0));
        let largest = |own: &[Vec<usize>]| {
            own.iter()
                .map(|d| d.iter().product::<usize>() as u64)
                .max()
                .unwrap_or(0)
        };
        // Each round comes at its segment's moment, on top of the graphs still held: with
        // several micro-batches a step, of the step's sums held from the backward's start;
        // with one on the CPU, of the sums arrived so far, those of the segments after it and
        // its own (made while the round's bucket is still held, `Bucket::flush`), this rank's
        // part of them taken in proportion to their values. (On a GPU with one, a row counts
        // the sums whole all along, and the rounds after the backward alone.)
        if accum > 1 || self.arriving > 0 {
            let own = |o: &[Vec<usize>]| -> u64 {
                o.iter().map(|d| d.iter().product::<usize>() as u64).sum()
            };
            let mut after = 0u64;
            let mut rounds: Vec<(u64, u64, u64)> = s
                .own
                .iter()
                .rev()
                .map(|o| {
                    after += own(o);
                    let arrived =
                        self.arriving as u128 * after as u128 / self.params.max(1) as u128;
                    (values(o), largest(o), arrived as u64)
                })
                .collect();
            rounds.reverse();
            self.segment_rounds = rounds;
        }
        self
    }
    /// The plan of one of `world` ranks under ZeRO `stage` under the fused backward
    /// (`update/fused_backward.rs`), whose rounds sum each checkpoint segment's gradients over
    /// the ranks as that segment's backward ends (`s`, the model's segments of trainable
    /// tensors `shapes`; the rest after the backward) and step them from the sums. A round holds
    /// its fp32 bucket (the segment's values, at most a bucket's or its largest tensor's), the
    /// fp32 copies of gradients narrower than fp32 (one tensor's through host memory, the
    /// bucket's on the GPUs, `on_gpus`) and the fp32 sums arriving (under ZeRO this rank's
    /// share, at most), which the segment's step then reads: with one micro-batch a step,
    /// beside what the gradients they replace held; with more, in place of the step's sums
    /// that went into the offer. Counted at each segment's moment of the fused backward (and
    /// the rest's after it) on the training device, or, for a GPU run whose sums go through
    /// host memory (`through_host`), as a host row of the largest round.
    #[allow(clippy::too_many_arguments)]
    pub fn rounds_under_fused_backward(
        mut self,
        world: usize,
        stage: u8,
        accum: usize,
        s: &Segments,
        shapes: &[Vec<usize>],
        on_gpus: bool,
        through_host: bool,
    ) -> Self {
        if world < 2 || !self.fused {
            return self;
        }
        let sizes: Vec<usize> = shapes.iter().map(|d| d.iter().product()).collect();
        let share = match stage {
            0 => u64::MAX,
            _ => crate::update::zero::largest_share(&sizes, world) as u64,
        };
        let (gs, narrow) = (self.grad_size, self.grad_size < 4);
        // A round of tensors `own`: its peak (the bucket, the copies, the sums arriving beyond
        // the gradients they replace) and what its step reads beside its own temporaries.
        let round = |own: &[Vec<usize>]| -> (u64, u64) {
            let sizes = own.iter().map(|d| d.iter().product::<usize>());
            let values = sizes.clone().sum::<usize>() as u64;
            let bucket = crate::update::bucket_values(sizes.clone()) as u64;
            let largest = sizes.max().unwrap_or(0) as u64;
            let arriving = 4 * values.min(share);
            let sums = match (accum, through_host) {
                (1, true) => arriving,
                (1, false) => arriving.saturating_sub(gs * values),
                _ => 0,
            };
            (bucket_bytes(bucket, largest, narrow, on_gpus) + sums, sums)
        };
        let rounds: Vec<(u64, u64)> = s.own.iter().map(|own| round(own)).collect();
        let rest = round(&s.outside);
        if through_host {
            let largest = rounds.iter().chain([&rest]).map(|r| r.0).max().unwrap_or(0);
            return self.with(
                &format!(
                    "the gradients' sums over {world} ranks in flight (fp32, a segment's round \
                     at a time inside --fused-backward)"
                ),
                largest,
                true,
            );
        }
        self.rounds = rounds.into_iter().chain([rest]).collect();
        self
    }

    /// The plan of one of `world` ranks with what the sum of the gradients over the ranks holds
    /// after backward (`update/reduce.rs`), for trainable tensors of `shapes`: its fp32 bucket
    /// (16 MiB, or the largest tensor where that is larger, never more than all of them), the
    /// fp32 copy of the tensor being added to it when what is summed is not fp32 (summed
    /// through host memory) or of the whole bucket (summed on the GPUs, `on_gpus`), and with
    /// one micro-batch a step (under ZeRO-2, each micro-batch) of gradients narrower than fp32,
    /// the fp32 sums' excess over the gradients they replace (every parameter's, or under ZeRO
    /// this rank's share; under ZeRO-2 on a GPU [`Self::per_rank`] holds the sums). Summed a
    /// segment at a time, each round at its segment's moment of the backward (and with one
    /// micro-batch on the CPU, the sums arrived by then). On the training device
    /// unless `through_host` (a GPU run whose sums go through host memory: a host row). Not
    /// under the fused backward, whose rounds [`Self::rounds_under_fused_backward`] counts.
    pub fn with_sums_in_flight(
        mut self,
        world: usize,
        stage: u8,
        accum: usize,
        shapes: &[Vec<usize>],
        on_gpus: bool,
        through_host: bool,
    ) -> Self {
        if world < 2 || self.fused {
            return self;
        }
        let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
        let all = crate::update::bucket_values(sizes.iter().copied()) as u64;
        // Summed a segment at a time, a round's bucket holds at most that round's values.
        let values = self.round_values.map_or(all, |r| r.min(all));
        let largest = sizes.iter().copied().max().unwrap_or(0) as u64;
        // What the sums read: a micro-batch's gradients in the model's dtype (one micro-batch a
        // step, or ZeRO-2, which sums each micro-batch), else the fp32 sums of the step's.
        let narrow = self.grad_size < 4 && (accum == 1 || stage == 2);
        // With one micro-batch a step, the fp32 sums take the place of the gradients as they
        // arrive: every parameter's without ZeRO, or under ZeRO this rank's alone, the
        // others' gradients dropped (stage 1 too sums onto the owners, in the backward's
        // rounds: counted as every parameter's, the medium T5 in bf16 was planned 6.9% above
        // its peak, which equals ZeRO-2's). Under stage 2 with several, each
        // micro-batch's arrive so beside the accumulator they are then added into (left out,
        // the medium T5 of `scripts/ranks-peaks.sh` in bf16 was planned 7.4% under its peak).
        // (Summed a segment at a time, [`Self::reduced_by_segment`] counts the sums; under
        // ZeRO-2 on a GPU, [`Self::per_rank`]'s row.)
        let counted = stage < 2 || !self.gpu;
        let excess = if narrow && counted && self.round_values.is_none() {
            let values = match stage {
                0 => self.params,
                _ => crate::update::zero::largest_share(&sizes, world) as u64,
            };
            (4 - self.grad_size) * values
        } else {
            0
        };
        let bytes = bucket_bytes(values, largest, narrow, on_gpus);
        // Each segment's round on the training device, at its moment of the backward (the
        // medium T5 of `scripts/ranks-peaks.sh` in bf16, with two micro-batches a step, was
        // planned 5-6% under its peak when they were counted after the backward alone).
        if !through_host {
            self.round_moments = self
                .segment_rounds
                .iter()
                .map(|&(v, l, arrived)| bucket_bytes(v, l, narrow, on_gpus) + arrived)
                .collect();
        }
        if through_host {
            return self.with(
                &format!(
                    "the gradients' sums over {world} ranks in flight (fp32 buckets, after \
                     backward)"
                ),
                bytes + excess,
                true,
            );
        }
        // With several micro-batches a step under ZeRO 0 or 1 on the CPU, not in segments,
        // each of the last micro-batch's gradients is added into the step's sum it offers
        // before anything travels (`GradAccumulator::take_with_each`): the gradients are gone,
        // and the buckets then copy sums the plan holds already. The moment after backward
        // holds, beside those sums, the buckets less the gradients freed, or one tensor's fp32
        // sum as it is formed. (The medium T5 of `scripts/ranks-peaks.sh` in bf16 was planned
        // 9-13% above its measured peak when the buckets came on top of the gradients.)
        let freed = match accum > 1 && stage < 2 && !self.gpu && self.round_values.is_none() {
            true => self.grad_size * self.params,
            false => 0,
        };
        self.in_flight = match freed {
            0 => bytes,
            f => bytes.saturating_sub(f).max(4 * largest),
        };
        // (The sums arriving in segments, when no row holds them: all there after backward.)
        self.excess = excess + self.arriving;
        self
    }
}

/// What one collective of the sums over the ranks holds (`update/reduce.rs`'s `Bucket`): the
/// fp32 bucket of `values` values, and where what it adds is narrower than fp32 (`narrow`),
/// the fp32 copy of it: of one tensor at a time (at most `largest` values) through host
/// memory, of the whole bucket on the GPUs (`on_gpus`).
fn bucket_bytes(values: u64, largest: u64, narrow: bool, on_gpus: bool) -> u64 {
    let copies = match (narrow, on_gpus) {
        (false, _) => 0,
        (true, true) => 4 * values,
        (true, false) => 4 * largest,
    };
    4 * values + copies
}
