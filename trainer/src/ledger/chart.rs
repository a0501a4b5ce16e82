//! The memory timeline as a picture: `memory.svg`, drawn from the ledger's profile points
//! (what memory.jsonl holds). Memory above the baseline over time, stacked by component (the
//! told bytes, then "activations & other" for the rest of what was measured), the peak of
//! each phase as a red step line with the run's peak marked, the `--fit` budget and the plan's
//! prediction as lines, evaluations shaded, and a strip under the axis coloured by phase.
//!
//! Plain SVG written by hand: a plotting crate would add minutes to a 2-core build for one
//! picture of rectangles, polygons and lines.

use std::fmt::Write as _;

use ft_params::bytes::format_bytes;

use super::book::ProfilePoint;
use super::Category;

/// What the picture draws besides the points.
#[derive(Debug, Clone, Default)]
pub struct ChartLines {
    /// `--fit`'s budget, in the plan's terms (above the baseline, less the data held before the
    /// first step).
    pub budget: Option<u64>,
    /// The plan's predicted peak, in the same terms.
    pub predicted: Option<u64>,
    /// What the run held above the baseline before its first step that the plan does not count
    /// (data, tokenizer): the budget and prediction lines are drawn that much higher, where the
    /// measured bytes they bound are.
    pub unplanned: u64,
    /// The heading: the run and its device.
    pub title: String,
}

const W: f64 = 960.0;
const H: f64 = 440.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 64.0;
/// More points than this are thinned: each bucket keeps its highest peak (and every
/// evaluation point), so the peaks a long run reached stay in the picture.
const MOST_POINTS: usize = 2400;

/// The stacked bands, bottom to top, with their colours.
const BANDS: [(Category, &str, &str); 6] = [
    (Category::Parameters, "parameters", "#4e79a7"),
    (Category::MasterWeights, "fp32 master weights", "#a0cbe8"),
    (Category::OptimizerState, "optimizer state", "#f28e2b"),
    (Category::Ema, "EMA", "#59a14f"),
    (Category::Gradients, "gradients", "#e15759"),
    (Category::Activations, "activations & other", "#edc948"),
];

fn phase_colour(phase: &str) -> &'static str {
    match phase {
        "forward" => "#76b7b2",
        "backward" => "#ff9da7",
        "step" => "#9c755f",
        "out-of-memory" => "#d00000",
        p if p.starts_with("eval") => "#bab0ac",
        _ => "#b07aa1",
    }
}

/// One point's bands: told bytes per band (in the measured memory), the rest of the measured
/// bytes above the baseline in the last band.
fn bands(p: &ProfilePoint) -> [f64; 6] {
    let mut out = [0f64; 6];
    let mut told = 0u64;
    for (i, (c, _, _)) in BANDS.iter().enumerate() {
        if *c == Category::Activations {
            continue;
        }
        let b = p.told.get(c).copied().unwrap_or(0);
        told += b;
        out[i] = b as f64;
    }
    let act = p.told.get(&Category::Activations).copied().unwrap_or(0);
    out[5] = (p.delta.max(0) as u64).saturating_sub(told).max(act) as f64;
    out
}

/// The points the picture draws: all of them, or for a long run the highest peak of each
/// bucket and every evaluation point.
fn thinned(points: &[ProfilePoint]) -> Vec<&ProfilePoint> {
    if points.len() <= MOST_POINTS {
        return points.iter().collect();
    }
    let per = points.len().div_ceil(MOST_POINTS / 2);
    let mut out = Vec::new();
    for chunk in points.chunks(per) {
        let top = chunk.iter().max_by_key(|p| p.peak);
        for p in chunk {
            let keep = p.phase.starts_with("eval") || top.is_some_and(|t| std::ptr::eq(t, p));
            if keep {
                out.push(p);
            }
        }
    }
    out
}

/// A round step for an axis spanning `span`: 1, 2 or 5 times a power of `base`.
fn tick_step(span: f64, base: f64, ticks: f64) -> f64 {
    let raw = (span / ticks).max(f64::MIN_POSITIVE);
    let mut unit = 1.0;
    while unit * base <= raw {
        unit *= base;
    }
    while unit > raw {
        unit /= base;
    }
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * unit)
        .find(|s| *s >= raw)
        .unwrap_or(raw)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The picture of `points` (memory above the baseline; `delta` and `peak - live + delta`).
pub fn svg(points: &[ProfilePoint], lines: &ChartLines) -> String {
    let pts = thinned(points);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
         viewBox=\"0 0 {W} {H}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(s, "<rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{LEFT}\" y=\"22\" font-size=\"15\">{}</text>",
        esc(&lines.title)
    );
    if pts.is_empty() {
        let _ = writeln!(
            s,
            "<text x=\"{LEFT}\" y=\"{}\">no profile points</text>\n</svg>",
            TOP + 20.0
        );
        return s;
    }
    // x: seconds since the first point, or the point's index when no time passed.
    let t0 = pts[0].at;
    let span_t = pts.iter().map(|p| p.at - t0).fold(0f64, f64::max);
    let by_index = span_t <= 0.0;
    let xs: Vec<f64> = pts
        .iter()
        .enumerate()
        .map(|(i, p)| if by_index { i as f64 } else { p.at - t0 })
        .collect();
    let x_max = xs.last().copied().unwrap_or(1.0).max(1e-9);
    let peak_of = |p: &ProfilePoint| (p.peak as i64 - p.live as i64 + p.delta).max(0) as f64;
    let stacks: Vec<[f64; 6]> = pts.iter().map(|p| bands(p)).collect();
    let mut y_max = pts.iter().map(|p| peak_of(p)).fold(1f64, f64::max);
    for stack in &stacks {
        y_max = y_max.max(stack.iter().sum());
    }
    for line in [lines.budget, lines.predicted].into_iter().flatten() {
        y_max = y_max.max((line + lines.unplanned) as f64);
    }
    let y_step = tick_step(y_max * 1.05, 2.0, 6.0);
    let y_top = (y_max * 1.05 / y_step).ceil() * y_step;
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let x = |v: f64| LEFT + pw * v / x_max;
    let y = |v: f64| TOP + ph * (1.0 - v / y_top);

    // Evaluations shaded: from each `eval/before` to the next `eval/after`.
    let mut open: Option<f64> = None;
    for (p, &xv) in pts.iter().zip(&xs) {
        match p.phase.as_str() {
            "eval/before" => open = Some(xv),
            "eval/after" => {
                if let Some(a) = open.take() {
                    let _ = writeln!(
                        s,
                        "<rect x=\"{:.1}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{ph}\" \
                         fill=\"#000\" fill-opacity=\"0.07\"/><text x=\"{:.1}\" y=\"{}\" \
                         font-size=\"10\" fill=\"#555\">eval</text>",
                        x(a),
                        (x(xv) - x(a)).max(1.0),
                        x(a) + 2.0,
                        TOP + ph - 4.0
                    );
                }
            }
            _ => {}
        }
    }
    // Grid and axes.
    let mut v = 0.0;
    while v <= y_top + 1e-9 {
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            LEFT + pw,
            y(v),
            y(v),
            LEFT - 6.0,
            y(v) + 4.0,
            format_bytes(v as i64)
        );
        v += y_step;
    }
    let x_step = tick_step(x_max, 10.0, 8.0);
    let mut v = 0.0;
    while v <= x_max + 1e-9 {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            x(v),
            TOP + ph + 30.0,
            if by_index {
                format!("{v:.0}")
            } else {
                format!("{v:.0} s")
            }
        );
        v += x_step;
    }
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#555\">{}</text>",
        LEFT + pw / 2.0,
        H - 8.0,
        if by_index {
            "profile point"
        } else {
            "seconds since the first profile point"
        }
    );
    // The stacked bands.
    let mut below = vec![0f64; pts.len()];
    for (k, (_, _, colour)) in BANDS.iter().enumerate() {
        let above: Vec<f64> = below.iter().zip(&stacks).map(|(b, st)| b + st[k]).collect();
        if above.iter().zip(&below).all(|(a, b)| a <= b) {
            continue;
        }
        let mut poly = String::new();
        for (xv, a) in xs.iter().zip(&above) {
            let _ = write!(poly, "{:.1},{:.1} ", x(*xv), y(*a));
        }
        for (xv, b) in xs.iter().zip(&below).rev() {
            let _ = write!(poly, "{:.1},{:.1} ", x(*xv), y(*b));
        }
        let _ = writeln!(
            s,
            "<polygon points=\"{}\" fill=\"{colour}\" fill-opacity=\"0.85\"/>",
            poly.trim_end()
        );
        below = above;
    }
    // Each phase's peak, over the span it covers.
    let mut steps = String::new();
    for i in 0..pts.len() {
        let a = if i == 0 { xs[0] } else { xs[i - 1] };
        let pk = y(peak_of(pts[i]));
        let _ = write!(steps, "{:.1},{pk:.1} {:.1},{pk:.1} ", x(a), x(xs[i]));
    }
    let _ = writeln!(
        s,
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#b00000\" stroke-width=\"1\" \
         stroke-opacity=\"0.8\"/>",
        steps.trim_end()
    );
    // The run's peak.
    if let Some((i, p)) = pts
        .iter()
        .enumerate()
        .max_by(|a, b| peak_of(a.1).total_cmp(&peak_of(b.1)))
    {
        let (cx, cy) = (x(xs[i]), y(peak_of(p)));
        let label = format!("peak {} in {}", format_bytes(peak_of(p) as i64), p.phase);
        let anchor = if cx > LEFT + pw * 0.7 { "end" } else { "start" };
        let dx = if anchor == "end" { -6.0 } else { 6.0 };
        let _ = writeln!(
            s,
            "<circle cx=\"{cx:.1}\" cy=\"{cy:.1}\" r=\"4\" fill=\"#b00000\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"{anchor}\" fill=\"#b00000\">{}</text>",
            cx + dx,
            (cy - 6.0).max(TOP + 10.0),
            esc(&label)
        );
    }
    // Budget and prediction: the budget's label above its line at the right, the plan's below
    // its line at the left (the two are close when the plan fits the budget tightly).
    let marks = [
        (lines.budget, "--fit budget", "#d00000", "", true),
        (
            lines.predicted,
            "planned peak",
            "#333",
            " stroke-dasharray=\"6 4\"",
            false,
        ),
    ];
    for (value, name, colour, dash, right) in marks {
        if let Some(b) = value {
            let yy = y((b + lines.unplanned) as f64);
            let (tx, ty, anchor) = if right {
                (LEFT + pw - 6.0, yy - 5.0, "end")
            } else {
                (LEFT + 6.0, yy + 15.0, "start")
            };
            let _ = writeln!(
                s,
                "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" \
                 stroke=\"{colour}\" stroke-width=\"1.5\"{dash}/>\
                 <text x=\"{tx:.1}\" y=\"{ty:.1}\" text-anchor=\"{anchor}\" \
                 fill=\"{colour}\">{} {}</text>",
                LEFT + pw,
                esc(name),
                format_bytes(b as i64)
            );
        }
    }
    // The phase strip under the axis.
    for i in 1..pts.len() {
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.2}\" height=\"8\" fill=\"{}\"/>",
            x(xs[i - 1]),
            TOP + ph + 6.0,
            (x(xs[i]) - x(xs[i - 1])).max(0.3),
            phase_colour(&pts[i].phase)
        );
    }
    let _ = writeln!(
        s,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" \
         stroke=\"#888\"/>"
    );
    // Legend.
    let mut ly = TOP + 44.0;
    let lx = LEFT + pw + 12.0;
    for (_, name, colour) in BANDS.iter().rev() {
        let _ = writeln!(
            s,
            "<rect x=\"{lx}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{colour}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            ly - 10.0,
            lx + 18.0,
            ly,
            esc(name)
        );
        ly += 18.0;
    }
    ly += 8.0;
    let _ = writeln!(
        s,
        "<line x1=\"{lx}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#b00000\"/>\
         <text x=\"{:.1}\" y=\"{ly:.1}\">peak of each phase</text>",
        lx + 12.0,
        ly - 4.0,
        ly - 4.0,
        lx + 18.0
    );
    ly += 22.0;
    let _ = writeln!(
        s,
        "<text x=\"{lx}\" y=\"{ly:.1}\" fill=\"#555\">phase strip:</text>"
    );
    for phase in ["forward", "backward", "step", "eval", "load / cache"] {
        ly += 16.0;
        let _ = writeln!(
            s,
            "<rect x=\"{lx}\" y=\"{:.1}\" width=\"12\" height=\"8\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{ly:.1}\">{phase}</text>",
            ly - 8.0,
            phase_colour(if phase == "load / cache" {
                "load"
            } else {
                phase
            }),
            lx + 18.0
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{svg, ChartLines, ProfilePoint};
    use crate::ledger::Category;

    fn point(phase: &str, at: f64, delta: i64, peak_extra: u64, params: u64) -> ProfilePoint {
        let mut told = BTreeMap::new();
        told.insert(Category::Parameters, params);
        ProfilePoint {
            phase: phase.into(),
            step: 0,
            at,
            live: 1000 + delta as u64,
            peak: 1000 + delta as u64 + peak_extra,
            delta,
            told,
            host: BTreeMap::new(),
        }
    }

    #[test]
    fn the_picture_has_the_bands_the_peak_the_budget_and_the_evaluations() {
        let mib = 1i64 << 20;
        let pts = vec![
            point("load", 0.0, 4 * mib, 0, 4 << 20),
            point("forward", 1.0, 40 * mib, mib as u64, 4 << 20),
            point("backward", 2.0, 10 * mib, 60 << 20, 4 << 20),
            point("step", 3.0, 12 * mib, mib as u64, 4 << 20),
            point("eval/before", 4.0, 12 * mib, 0, 4 << 20),
            point("eval/after", 6.0, 12 * mib, 5 << 20, 4 << 20),
        ];
        let lines = ChartLines {
            budget: Some(80 << 20),
            predicted: Some(64 << 20),
            unplanned: 0,
            title: "test run".into(),
        };
        let s = svg(&pts, &lines);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        // Parameters and activations & other: two bands.
        assert_eq!(s.matches("<polygon").count(), 2, "{s}");
        // The backward's peak: 10 MiB live + 60 MiB above it.
        assert!(s.contains("peak 70.00 MiB in backward"), "{s}");
        assert!(s.contains("--fit budget 80.00 MiB"), "{s}");
        assert!(s.contains("planned peak 64.00 MiB"), "{s}");
        // One evaluation shaded (the legend names the phase once more).
        assert_eq!(s.matches("fill-opacity=\"0.07\"").count(), 1, "{s}");
        // The y axis reaches above the budget.
        assert!(
            s.contains(">80.00 MiB</text>")
                || s.contains(">90.00 MiB</text>")
                || s.contains(">100.00 MiB</text>"),
            "{s}"
        );
        assert_eq!(s.matches("<svg").count(), s.matches("</svg>").count());
    }

    #[test]
    fn a_long_run_keeps_its_highest_peak() {
        let mut pts: Vec<ProfilePoint> = (0..10_000)
            .map(|i| point("forward", i as f64, 1 << 20, 0, 0))
            .collect();
        pts[7_777] = point("backward", 7_777.0, 1 << 20, 99 << 20, 0);
        let s = svg(&pts, &ChartLines::default());
        assert!(s.contains("peak 100.00 MiB in backward"), "{s}");
        assert!(s.len() < 1 << 20, "{} bytes", s.len());
    }
}
