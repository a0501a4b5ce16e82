"""Fits T5's backward temporaries (models/src/activations/t5.rs) to measured runs.

Reads the JSON lines of `t5_temporaries_fitting_rows` (trainer/tests/backward_temporaries.rs)
on stdin:

    cargo test --release -p ft-trainer --test backward_temporaries -- --ignored --nocapture \
        | grep '^{' | python3 scripts/fit_t5_temporaries.py

and prints the factors that keep the largest error of the predicted peak smallest (an
under-prediction weighs twice): a factor of each block's graph per strategy class (whole graph,
kept, rebuilt; thousandths) and two of the attention scores (per query chunk, and per example-sized bias; thousandths of a score tensor),
then every run's error under them. The walk mirrors ActivationProfile::held_with in
params/src/checkpoint/profile.rs.
"""

import json
import sys


def predicted(run, whole, kept, rec, k1, k2):
    """The peak profile.rs's held_with predicts: the activations kept, backward's walk through
    the blocks from the last with each block's temporaries and the gradients formed by then,
    and the end of backward with every gradient; never more than the plan without the walk
    (the kept activations, the most backward adds, every gradient)."""
    blocks = run["blocks"]
    strategy = run["strategy"]
    odd = lambda i: strategy == "every:2" and i % 2 == 1  # kept under every:2
    temps = lambda b, f, g: f * g + k1 * b["scores"] + k2 * b["bias"]
    everything = sum(b["unsegmented"] for b in blocks)
    live, before, graphs = [], 0, 0
    for i, b in enumerate(blocks):
        if strategy == "none":
            live.append(everything + temps(b, whole, b["unsegmented"]))
            continue
        keeps = strategy == "blocks" or odd(i)
        f = kept if keeps else rec
        live.append(before + b["kept"] + temps(b, f, b["kept"]))
        if keeps:
            before += b["kept"]
            graphs += b["kept"]
    if strategy == "none":
        graphs = everything
    # run["kept"] holds the kept activations and every gradient.
    plain = run["kept"] + max(live) - graphs
    all_grads = sum(b["grads"] for b in blocks) + run["grads_outside"]
    formed, most = run["grads_outside"], run["outer"] + all_grads
    for b, held in reversed(list(zip(blocks, live))):
        formed += b["grads"]
        most = max(most, run["outer"] + held + formed)
    return min(plain, most)


def error(run, *factors):
    return predicted(run, *factors) / run["measured"] - 1


# A plan below the measured peak packs a budget past its end (`--fit` keeps no reserve), so
# an under-prediction costs twice an over-prediction of the same size.
UNDER_WEIGHT = 2


def cost(errors):
    return max(max(errors), -UNDER_WEIGHT * min(errors))


def main():
    runs = [json.loads(line) for line in sys.stdin if line.startswith("{")]
    grid = [x / 20 for x in range(0, 41)]
    best = None
    for k1 in [x / 2 for x in range(0, 25)]:
        for k2 in [x / 2 for x in range(0, 17)]:
            pick = lambda s, at: min(
                grid,
                key=lambda f: cost(
                    [error(r, *at(f), k1, k2) for r in runs if r["strategy"] == s]
                ),
            )
            whole = pick("none", lambda f: (f, 0, 0))
            kept = pick("blocks", lambda f: (0, f, 0))
            rec = pick("full", lambda f: (0, 0, f))
            errors = [error(r, whole, kept, rec, k1, k2) for r in runs]
            if best is None or cost(errors) < best[0]:
                best = (cost(errors), min(errors), max(errors), whole, kept, rec, k1, k2)
    _, low, high, *factors = best
    names = ["whole", "kept", "recomputed", "scores", "bias"]
    print(", ".join(f"{n} {round(1000 * f)}" for n, f in zip(names, factors)))
    print(f"errors {100 * low:+.1f}% to {100 * high:+.1f}%")
    for r in runs:
        print(f"{r['run']:28} {r['strategy']:8} {100 * error(r, *factors):+6.1f}%")


if __name__ == "__main__":
    main()
