#!/usr/bin/env python3
"""PyTorch side of `scripts/gpu-bench.sh`: the same train steps and attention calls as
`trainer/examples/gpu_bench.rs`, on the GPU, one JSON line per measurement.

    gpu_bench_torch.py sdxl <px>[,<px>...] [ck]      diffusers UNet2DConditionModel from
                                                     configs/sdxl/unet_config.json, batch 1
    gpu_bench_torch.py t5 <batch> <src> <tgt> [ck]   transformers T5ForConditionalGeneration with
                                                     FLAN-T5-XL's config
    gpu_bench_torch.py attention                     torch.nn.functional.scaled_dot_product_attention
    gpu_bench_torch.py fused-check                   on the CPU: `bf16-adafactor-fused` gives the
                                                     plain Adafactor's weights on a tiny T5

Model runs use the settings of the Rust side as PyTorch users run them: `amp` is fp32 weights
with bf16 autocast (diffusers' and HF Trainer's `--mixed_precision bf16`: the fp32 weights are the
masters), AdamW (torch's default foreach implementation); `bf16` is the model cast to bf16 with
AdamW on bf16 state (kohya's `--full_bf16`), a lower bound without master weights;
`bf16-adafactor` the same model with transformers' Adafactor as HF Trainer builds it (kohya's
low-memory SDXL recipe; the Rust side's `FT_FULL_BF16=1 FT_OPTIM=adafactor`);
`bf16-adafactor-fused` that recipe with kohya's fused backward pass (each parameter stepped by
its own Adafactor from a post-accumulate-grad hook and its gradient freed at once; the Rust
side's `FT_FUSED=1`). `TORCH_MODES` (default "amp bf16") picks the modes. Memory is
`torch.cuda.memory_allocated` between steps (`base`) and `max_memory_allocated` during the
measured steps (`peak`): the same pool counters the Rust side reads.
"""
import json
import os
import sys
import time

import torch

WARMUP = 1
STEPS = 3
HERE = os.path.dirname(os.path.abspath(__file__))


def modes():
    return os.environ.get("TORCH_MODES", "amp bf16").split()


class FusedAdafactor:
    """kohya's fused backward pass in PyTorch: one transformers Adafactor per parameter (its
    update is per parameter anyway, step count included), stepped by a post-accumulate-grad hook
    as soon as the parameter's gradient is final, which is then freed, so the model's gradients
    never exist at once. `step` and `zero_grad` have nothing left to do."""

    def __init__(self, params):
        from transformers.optimization import Adafactor
        self.opts = {}
        for p in params:
            if p.requires_grad:
                self.opts[p] = Adafactor([p], lr=1e-5, scale_parameter=False,
                                         relative_step=False, warmup_init=False)
                p.register_post_accumulate_grad_hook(self.hook)

    def hook(self, p):
        self.opts[p].step()
        p.grad = None

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def optimizer(params, mode):
    if mode == "bf16-adafactor-fused":
        return FusedAdafactor(params)
    if mode == "bf16-adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=1e-5, scale_parameter=False, relative_step=False,
                         warmup_init=False)
    return torch.optim.AdamW(params, lr=1e-5)


def measure(step):
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / STEPS
    return secs, base, torch.cuda.max_memory_allocated()


PHASES = []


def train_step(model, opt, loss_fn, amp):
    """One step as forward, backward and optimizer, each ended by a sync and timed into
    PHASES (as the Rust side's `Phases`)."""
    def step():
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        PHASES.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return step


def phases():
    last = PHASES[-STEPS:]
    mean = lambda i: sum(r[i] for r in last) / max(len(last), 1)  # noqa: E731
    return {"forward_s": mean(0), "backward_s": mean(1), "optimizer_s": mean(2)}


def sdxl(pxs, ck):
    from diffusers import UNet2DConditionModel
    with open(os.path.join(HERE, "..", "configs", "sdxl", "unet_config.json")) as f:
        cfg = json.load(f)
    pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    for mode in modes():
        torch.manual_seed(0)
        with torch.device("cuda"):
            unet = UNet2DConditionModel.from_config(cfg)
        if mode != "amp":
            unet = unet.to(torch.bfloat16)
        unet.train()
        if ck:
            unet.enable_gradient_checkpointing()
        opt = optimizer(unet.parameters(), mode)
        dt = torch.float32 if mode == "amp" else torch.bfloat16
        for px in pxs:
            lat = px // 8
            x = torch.randn(1, 4, lat, lat, device="cuda", dtype=dt)
            target = torch.randn(1, 4, lat, lat, device="cuda")
            ctx = torch.randn(1, 77, cfg["cross_attention_dim"], device="cuda", dtype=dt)
            added = {"text_embeds": torch.randn(1, pooled, device="cuda", dtype=dt),
                     "time_ids": torch.tensor([[px, px, 0, 0, px, px]], device="cuda", dtype=dt)}
            t = torch.tensor([500], device="cuda")

            def loss_fn():
                pred = unet(x, t, ctx, added_cond_kwargs=added).sample
                return torch.nn.functional.mse_loss(pred.float(), target)
            try:
                secs, base, peak = measure(train_step(unet, opt, loss_fn, mode == "amp"))
                r = {"step_s": secs, "base": base, "peak": peak, "phases": phases()}
            except torch.cuda.OutOfMemoryError as e:
                r = {"error": "out of memory: " + str(e).splitlines()[0]}
            print(json.dumps({"bench": "sdxl", "impl": f"pytorch-{mode}", "px": px,
                              "checkpointing": ck, "torch": torch.__version__,
                              "params": sum(p.numel() for p in unet.parameters()), **r}),
                  flush=True)
        del unet, opt
        torch.cuda.empty_cache()


def t5(batch, src, tgt, ck):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24,
                   num_decoder_layers=24, num_heads=32, feed_forward_proj="gated-gelu",
                   tie_word_embeddings=False, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0)
    for mode in modes():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = T5ForConditionalGeneration(cfg)
        # FLAN-T5 has its own lm_head (2,849,757,184 parameters for XL); some transformers
        # versions tie it to the embedding regardless of the config, which hides 66M parameters.
        if model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr():
            model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
        if mode != "amp":
            model = model.to(torch.bfloat16)
        model.train()
        if ck:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        opt = optimizer(model.parameters(), mode)
        ids = torch.randint(2, 32128, (batch, src), device="cuda")
        labels = torch.randint(2, 32128, (batch, tgt), device="cuda")

        def loss_fn():
            return model(input_ids=ids, labels=labels, use_cache=False).loss
        try:
            secs, base, peak = measure(train_step(model, opt, loss_fn, mode == "amp"))
            r = {"step_s": secs, "base": base, "peak": peak, "phases": phases()}
        except torch.cuda.OutOfMemoryError as e:
            r = {"error": "out of memory: " + str(e).splitlines()[0]}
        print(json.dumps({"bench": "t5", "impl": f"pytorch-{mode}", "batch": batch, "src": src,
                          "tgt": tgt, "checkpointing": ck, "torch": torch.__version__,
                          "params": sum(p.numel() for p in model.parameters()), **r}), flush=True)
        del model, opt
        torch.cuda.empty_cache()


def attention():
    import torch.nn.functional as F
    shapes = [("sdxl-1024px-self", 1, 10, 4096, 4096), ("sdxl-1024px-cross", 1, 10, 4096, 77),
              ("sdxl-128px-self", 1, 10, 256, 256), ("t5-xl-b8-512", 8, 32, 512, 512)]
    for label, b, h, lq, lk in shapes:
        d = 64
        q = torch.randn(b, h, lq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, h, lk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, h, lk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(b, h, lq, d, device="cuda")

        def run():
            o = F.scaled_dot_product_attention(q, k, v)
            (o.float() * g).sum().backward()
            q.grad = k.grad = v.grad = None
        run()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        reps = 10
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
        secs = (time.perf_counter() - t0) / reps
        peak = torch.cuda.max_memory_allocated() - base
        print(json.dumps({"bench": "attention", "impl": "torch sdpa", "shape": label, "b": b,
                          "h": h, "lq": lq, "lk": lk, "d": d,
                          "result": {"fwd_bwd_s": secs, "peak_above_inputs": peak}}), flush=True)


def fused_check():
    """The fused mode against the plain one on a tiny bf16 T5 with checkpointing, on the CPU:
    the same weights bit for bit after three steps, and no gradient left after each backward."""
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)

    def run(mode):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(cfg).to(torch.bfloat16)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = optimizer(model.parameters(), mode)
        torch.manual_seed(1)
        ids, labels = torch.randint(2, 64, (2, 7)), torch.randint(2, 64, (2, 5))
        left = 0
        for _ in range(3):
            model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
            left = max(left, sum(p.grad is not None for p in model.parameters()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], left

    plain, left_plain = run("bf16-adafactor")
    fused, left_fused = run("bf16-adafactor-fused")
    same = all(torch.equal(a, b) for a, b in zip(plain, fused))
    print(json.dumps({"check": "fused-adafactor", "same_weights": same,
                      "grads_left_plain": left_plain, "grads_left_fused": left_fused}))
    if not same or left_fused != 0 or left_plain == 0:
        sys.exit(1)


def main():
    a = sys.argv[1:]
    ck = "ck" in a
    if a[0] == "sdxl":
        sdxl([int(p) for p in a[1].split(",")], ck)
    elif a[0] == "t5":
        t5(int(a[1]), int(a[2]), int(a[3]), ck)
    elif a[0] == "attention":
        attention()
    elif a[0] == "fused-check":
        fused_check()
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
