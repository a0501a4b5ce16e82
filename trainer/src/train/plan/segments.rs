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
        self
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
