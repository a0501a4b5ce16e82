//! The plan when a micro-batch's gradients are handed on segment by segment as the backward
//! ends each checkpoint segment: the fused backward's update, one process's sums, and the
//! ranks' sums ([`super::StatePlan::reduced_by_segment`] is in `ranks.rs`).

use ft_params::checkpoint::StepTemporaries;
use ft_params::Segments;

use super::{fmt, largest_step, StatePlan};
use crate::optim::OptimSpec;

impl StatePlan {
    /// The plan under a fused backward pass (`--fused-backward`) with `optim`: one
    /// micro-batch's gradients never exist all at once, only those of the parameters outside
    /// every checkpoint segment and of the largest segment (at most; the rows say so), and each
    /// segment's step runs inside backward.
    pub fn under_fused_backward(mut self, s: Segments, optim: &OptimSpec) -> Self {
        self.fused = true;
        self.formed = None;
        if self.step_on_device {
            let step = |shapes: &[Vec<usize>]| largest_step(optim, shapes.iter()).unwrap_or(0);
            self.step = StepTemporaries {
                segments: s.own.iter().map(|own| step(own)).collect(),
                after: step(&s.outside),
                fused: true,
            };
        }
        let rows = self.grad_rows.clone();
        self.bound_gradients(&rows, &s, "under --fused-backward");
        // With two micro-batches a step, the second's sums are taken as they form, each
        // stepped at once: the accumulator holds the first one's gradients alone.
        if self.accum == 2 {
            let bytes = self.grad_size * self.params;
            self.sums_held_as_the_first_gradients(bytes, "each widened to fp32 and stepped");
        }
        self
    }
    /// The plan of one process whose backward forms a micro-batch's gradients whole and adds
    /// them into the step's sums after it (not in segments, not fused): with two micro-batches
    /// a step, the accumulator holds the first one's gradients in their dtype through the
    /// second's backward, and the fp32 sums formed after it take the place of both (bf16's 2
    /// bytes a value twice are the fp32 sum's 4; fp32's 8 become 4). Counted as fp32 sums
    /// beside the gradients, the medium T5 of `scripts/ranks-peaks.sh` (`NP=1`) in bf16 was
    /// planned 9.4% above its peak. (Not where the sums are on the host of a GPU run: the host
    /// then holds the first one's gradients and the second's at once.)
    pub fn added_after_backward(mut self) -> Self {
        let beside = self
            .sums_row
            .is_some_and(|i| !self.gpu || !self.rows[i].on_host);
        if self.accum == 2 && !self.fused && beside {
            let bytes = self.grad_size * self.params;
            self.sums_held_as_the_first_gradients(bytes, "all widened to fp32 after it");
        }
        self
    }
    /// The sums row, where two micro-batches a step never hold every fp32 sum at once: the
    /// accumulator keeps the first one's gradients in their dtype (it widens a tensor's sum
    /// only as the second's gradient is added, `GradAccumulator::combine`) and gives each sum
    /// up as it forms, so it holds at most `bytes`; `then` says what becomes of them in the
    /// second's backward. (Counted as fp32 sums whole, the medium T5 of
    /// `scripts/ranks-peaks.sh` in bf16 was planned 11-17% above its peak.)
    pub(super) fn sums_held_as_the_first_gradients(&mut self, bytes: u64, then: &str) {
        let dt = match self.grad_size {
            2 => "16-bit",
            _ => "fp32",
        };
        if let Some(i) = self.sums_row {
            let r = &mut self.rows[i];
            r.bytes = r.bytes.min(bytes);
            r.component = format!(
                "gradient sums: the first micro-batch's gradients ({dt}) through the second's \
                 backward, {then}"
            );
        }
    }
    /// The gradient rows `rows` bounded to what a backward that hands each segment's
    /// gradients on as the segment's backward ends holds at once (`how` it does): those of the
    /// parameters outside every segment of `s` and of its largest segment.
    pub(super) fn bound_gradients(&mut self, rows: &[usize], s: &Segments, how: &str) {
        let outside = self.params.saturating_sub(s.inside);
        let live = self.grad_size * (outside + s.largest);
        for &i in rows {
            let r = &mut self.rows[i];
            r.bytes = r.bytes.min(live);
            r.component = format!(
                "{}: at most at once {how}, {} outside checkpoint segments + {} of the largest \
                 segment",
                r.component,
                fmt(self.grad_size * outside),
                fmt(self.grad_size * s.largest)
            );
        }
    }
    /// The plan with the model's checkpoint segments `s` known: backward forms one
    /// micro-batch's gradients segment by segment from the last, so the plan need not count
    /// them whole beside every segment's backward ([`ActivationProfile::held_with`]). Not under
    /// the fused backward, whose gradient rows count what it holds at once already.
    pub fn formed_by_segment(mut self, s: &Segments) -> Self {
        if self.fused {
            return self;
        }
        self.formed = Some(s.grad_bytes(self.grad_size));
        self
    }
    /// The plan of one process whose backward adds each checkpoint segment's gradients (`s`,
    /// the model's segments) into the step's sums as the segment's backward ends (the loop's
    /// plain step in segments, as the fused backward's earlier micro-batches): with `--accum`
    /// above 1 beside the fp32 sums, and with the sums on the host of a GPU run on the GPU, a
    /// micro-batch's gradients never exist all at once, only those of the parameters outside
    /// every segment and of the largest segment. (One micro-batch a step on its own device:
    /// its gradients are the step's, whole, as before.)
    pub fn accumulated_by_segment(mut self, s: &Segments) -> Self {
        let device: Vec<usize> = self
            .grad_rows
            .iter()
            .copied()
            .filter(|&i| !self.rows[i].on_host)
            .collect();
        let beside = self.sums_row.is_some() || device.len() < self.grad_rows.len();
        if self.fused || !beside {
            return self;
        }
        self.formed = None;
        self.bound_gradients(
            &device,
            s,
            "(each segment's added to the step's sums as its backward ends)",
        );
        self
    }
}
