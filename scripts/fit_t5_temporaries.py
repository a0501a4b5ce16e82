"""Fits T5's backward temporaries (models/src/activations/t5.rs) to measured runs.

Reads the JSON lines of `t5_temporaries_fitting_rows` (trainer/tests/backward_temporaries.rs)
on stdin:

    cargo test --release -p ft-trainer --test backward_temporaries -- --ignored --nocapture \
        | grep '^{' | python3 scripts/fit_t5_temporaries.py

and prints the factors that keep the largest error of the predicted peak smallest: a factor of
each block's graph per strategy class (whole graph, kept, rebuilt; thousandths) and two of the
attention scores (per query chunk, and per example-sized bias; thousandths of a score tensor),
then every run's error under them. The walk mirrors ActivationProfile::held in
params/src/checkpoint/profile.rs.
"""

import json
import sys


def backward_on_top(run, whole, kept, rec, k1, k2):
    """What backward adds on top of the kept activations, as profile.rs's walk predicts."""
    blocks = run["blocks"]
    strategy = run["strategy"]
    odd = lambda i: strategy == "every:2" and i % 2 == 1  # kept under every:2
    temps = lambda b, f, g: f * g + k1 * b["scores"] + k2 * b["bias"]
    if strategy == "none":
        return max(temps(b, whole, b["unsegmented"]) for b in blocks)
    before, peak, graphs = 0, 0, 0
    for i, b in enumerate(blocks):
        keeps = strategy == "blocks" or odd(i)
        f = kept if keeps else rec
        peak = max(peak, before + b["kept"] + temps(b, f, b["kept"]))
        if keeps:
            before += b["kept"]
            graphs += b["kept"]
    return peak - graphs


def error(run, *factors):
    return (run["kept"] + backward_on_top(run, *factors)) / run["measured"] - 1


def main():
    runs = [json.loads(line) for line in sys.stdin if line.startswith("{")]
    grid = [x / 20 for x in range(0, 41)]
    best = None
    for k1 in [x / 2 for x in range(0, 13)]:
        for k2 in [x / 2 for x in range(0, 17)]:
            pick = lambda s, at: min(
                grid,
                key=lambda f: max(
                    abs(error(r, *at(f), k1, k2)) for r in runs if r["strategy"] == s
                ),
            )
            whole = pick("none", lambda f: (f, 0, 0))
            kept = pick("blocks", lambda f: (0, f, 0))
            rec = pick("full", lambda f: (0, 0, f))
            worst = max(abs(error(r, whole, kept, rec, k1, k2)) for r in runs)
            if best is None or worst < best[0]:
                best = (worst, whole, kept, rec, k1, k2)
    worst, *factors = best
    names = ["whole", "kept", "recomputed", "scores", "bias"]
    print(", ".join(f"{n} {round(1000 * f)}" for n, f in zip(names, factors)))
    print(f"largest error {100 * worst:.1f}%")
    for r in runs:
        print(f"{r['run']:28} {r['strategy']:8} {100 * error(r, *factors):+6.1f}%")


if __name__ == "__main__":
    main()
