#!/usr/bin/env python3
"""Parity fixtures for t5-ft, made with torch + transformers (run by hand, results committed).

    pip install torch "transformers==4.57.1" safetensors   # 5.x always ties lm_head to shared
    python scripts/t5_parity.py make            # writes tests/fixtures/t5_tiny/
    python scripts/t5_parity.py check-saved DIR  # loads a t5-ft checkpoint, compares logits

`make` builds a tiny FLAN-style T5 (gated-gelu, untied head) and a tied relu variant from a
fixed seed, tokenizes a small dataset with the bundled word-level tokenizer, and records:
  - model.safetensors, config.json, tokenizer.json, train.jsonl (the inputs t5-ft reads),
  - logits.safetensors: teacher-forced logits of the whole batch before training,
  - grads.safetensors: step-0 gradient of every parameter (mean token loss over the batch),
  - expected.json: per-step losses of 5 AdamW steps at batch 8, and of 5 steps as 2 x 4
    accumulation normalised by the step's label-token count (the two must agree).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file, load_file
from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "configs", "demo", "t5", "tokenizer.json")
OUT = os.path.join(ROOT, "tests", "fixtures", "t5_tiny")

EXAMPLES = [
    ("reverse: 3 1 4", "4 1 3"),
    ("reverse: 1 5 9 2 6", "6 2 9 5 1"),
    ("sort: 5 3 5", "3 5 5"),
    ("reverse: 8 9", "9 8"),
    ("sort: 9 7 9 3 2 3", "2 3 3 7 9 9"),
    ("reverse: a b c d", "d c b a"),
    ("sort: 4 6", "4 6"),
    ("reverse: 2 6 4 3 3 8 3", "3 8 3 3 4 6 2"),
]

LR, WD, STEPS = 1e-3, 0.01, 5


def config(variant):
    base = dict(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                dropout_rate=0.0, layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0)
    if variant == "flan":
        base.update(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    else:
        base.update(feed_forward_proj="relu", tie_word_embeddings=True)
    return T5Config(**base)


def batch(tok, examples):
    enc = tok([e[0] for e in examples], padding="longest", return_tensors="pt")
    lab = tok([e[1] for e in examples], padding="longest", return_tensors="pt")
    labels = lab.input_ids.masked_fill(lab.attention_mask == 0, -100)
    return enc.input_ids, enc.attention_mask, labels


def summed_loss(model, ids, mask, labels):
    logits = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=-100, reduction="sum")


def train(model, tok, micro_batches):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for _ in range(STEPS):
        batches = [batch(tok, mb) for mb in micro_batches]
        total = sum(int((b[2] != -100).sum()) for b in batches)
        opt.zero_grad()
        step_loss = 0.0
        for ids, mask, labels in batches:
            loss = summed_loss(model, ids, mask, labels) / total
            loss.backward()
            step_loss += loss.item()
        opt.step()
        losses.append(step_loss)
    return losses


def make():
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER, pad_token="<pad>", eos_token="</s>",
                                  unk_token="<unk>")
    for variant in ["flan", "relu_tied"]:
        out = os.path.join(OUT, variant)
        os.makedirs(out, exist_ok=True)
        torch.manual_seed(1)
        model = T5ForConditionalGeneration(config(variant)).float()
        model.eval()  # dropout is 0 anyway; eval() keeps it deterministic
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        with open(os.path.join(out, "train.jsonl"), "w") as f:
            for i, t in EXAMPLES:
                f.write(json.dumps({"input": i, "target": t}) + "\n")
        state = {k: v.clone() for k, v in model.state_dict().items()}

        ids, mask, labels = batch(tok, EXAMPLES)
        logits = model(input_ids=ids, attention_mask=mask, labels=labels).logits
        save_file({"logits": logits.detach().contiguous()}, os.path.join(out, "logits.safetensors"))
        n = int((labels != -100).sum())
        (summed_loss(model, ids, mask, labels) / n).backward()
        grads = {k: p.grad.detach().clone().contiguous() for k, p in model.named_parameters()
                 if p.grad is not None}
        save_file(grads, os.path.join(out, "grads.safetensors"))
        model.zero_grad()

        big = train(model, tok, [EXAMPLES])
        model.load_state_dict(state)
        accum = train(model, tok, [EXAMPLES[:4], EXAMPLES[4:]])
        assert max(abs(a - b) for a, b in zip(big, accum)) < 1e-5, (big, accum)
        expected = {"lr": LR, "weight_decay": WD, "steps": STEPS, "label_tokens": n,
                    "losses_batch8": big, "losses_accum_2x4": accum,
                    "torch": torch.__version__}
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump(expected, f, indent=1)
        print(variant, "losses", big)


def check_saved(path):
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                  pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    model = T5ForConditionalGeneration.from_pretrained(path).float().eval()
    ids, mask, labels = batch(tok, EXAMPLES)
    logits = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    ours = load_file(os.path.join(path, "logits.safetensors"))["logits"]
    diff = (logits - ours).abs().max().item()
    scale = ours.abs().max().item()
    print(json.dumps({"max_abs_diff": diff, "max_abs_logit": scale, "rel": diff / scale}))
    return diff / scale < 1e-4


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "make":
        make()
    elif len(sys.argv) >= 3 and sys.argv[1] == "check-saved":
        sys.exit(0 if check_saved(sys.argv[2]) else 1)
    else:
        print(__doc__)
        sys.exit(2)
