#!/usr/bin/env python3
"""Reads the JSON lines of `gpu_bench` and `gpu_bench_torch.py` (stdin or files) and prints the
markdown tables of docs/benchmarks.md: per model run, step time and its ratio to PyTorch's
same-settings run (`pytorch-amp`; `pytorch-bf16-adafactor` for the Adafactor runs,
`pytorch-bf16-adafactor-fused` for those with the fused backward pass), and GPU memory by component (model states between steps, the
gradients and activations on top at the peak); per attention shape, time and peak memory."""
import fileinput
import json

GIB = 1024 ** 3


def gib(b):
    return "-" if b is None else f"{b / GIB:.2f} GiB"


def reference(impl):
    """The PyTorch run a row is compared with: the same recipe where one ran (Adafactor on bf16
    weights without masters, with or without the fused backward pass), else PyTorch amp."""
    if impl.endswith("adafactor-fused"):
        return "pytorch-bf16-adafactor-fused"
    return "pytorch-bf16-adafactor" if impl.endswith("adafactor") else "pytorch-amp"


def model_rows(rows, key):
    ref = {}
    for r in rows:
        if r["impl"].startswith("pytorch") and "step_s" in r:
            ref[(r["impl"], key(r))] = r
    out = ["| run | setting | step time | ratio to PyTorch | peak GPU memory | between steps "
           "(weights, masters, optimizer) | peak above that (gradients, activations, temporaries) "
           "| peak vs PyTorch |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        setting = key(r)
        if "error" in r:
            out.append(f"| {r['impl']} | {setting} | {r['error']} | | | | | |")
            continue
        p = ref.get((reference(r["impl"]), setting))
        ratio = f"{r['step_s'] / p['step_s']:.2f}x" if p else "-"
        mem = f"{r['peak'] / p['peak']:.2f}x" if p else "-"
        out.append(f"| {r['impl']} | {setting} | {r['step_s']:.3f} s | {ratio} | {gib(r['peak'])} "
                   f"| {gib(r['base'])} | {gib(r['peak'] - r['base'])} | {mem} |")
    return out


def phase_rows(rows, key):
    out = []
    for r in rows:
        ph = r.get("phases")
        if ph:
            out.append(f"{r['impl']} {key(r)}: forward {ph['forward_s']:.3f} s, backward "
                       f"(recompute included) {ph['backward_s']:.3f} s, optimizer "
                       f"{ph['optimizer_s']:.3f} s")
    return out


def states_rows(rows):
    out = []
    for r in rows:
        s = r.get("states")
        if s and r["impl"] == "candle":
            out.append(f"candle model states ({r['bench']}, {s['params']:,} parameters): weights "
                       f"{gib(s['weights'])}, bf16 gradients {gib(s['grads'])}, fp32 masters "
                       f"{gib(s['masters'])}, AdamW moments {gib(s['optimizer'])}")
            break
    return out


def main():
    rows = [json.loads(line) for line in fileinput.input() if line.startswith("{")]
    sdxl = [r for r in rows if r["bench"] == "sdxl"]
    t5 = [r for r in rows if r["bench"] == "t5"]
    att = [r for r in rows if r["bench"] == "attention"]
    ck = lambda r: ", checkpointing" if r.get("checkpointing") else ""  # noqa: E731
    if sdxl:
        print("\nFull SDXL UNet train step, batch 1, AdamW (Adafactor where the run says so)\n")
        print("\n".join(model_rows(sdxl, lambda r: f"{r['px']} px{ck(r)}")))
        print("\n".join(states_rows(sdxl) + phase_rows(sdxl, lambda r: f"{r['px']} px")))
    if t5:
        print("\nFLAN-T5-XL-shaped train step, AdamW (Adafactor where the run says so)\n")
        print("\n".join(model_rows(
            t5, lambda r: f"batch {r['batch']}, {r['src']}+{r['tgt']} tokens{ck(r)}")))
        print("\n".join(states_rows(t5) + phase_rows(t5, lambda r: f"batch {r['batch']}")))
    if att:
        print("\nAttention forward + backward, bf16, 64-dim heads\n")
        print("| shape (B, H, Lq, Lk) | implementation | time | peak memory above inputs |")
        print("|---|---|---|---|")
        for r in att:
            res = r["result"]
            shape = f"{r['shape']} ({r['b']}, {r['h']}, {r['lq']}, {r['lk']})"
            if "error" in res:
                print(f"| {shape} | {r['impl']} | {res['error'][:80]} | |")
            else:
                print(f"| {shape} | {r['impl']} | {res['fwd_bwd_s'] * 1e3:.2f} ms | "
                      f"{res['peak_above_inputs'] / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
