"""Padding work and training-step time of padded vs packed (THD) micro-batches on GSM8K-like lengths.

    python -m benchmarks.measure.packing_bench [--samples 64] [--budget 4096] [--steps 3] [--threads 1]

Lengths: a seeded random draw of `--samples` GSM8K training records (../shared/data/gsm8k), the
question rendered with the real Qwen3 tokenizer's chat template as the prompt (what
mgrpo.data.PromptDataset feeds the rollout), the reference answer plus EOS as the response.

1. Padding fraction (no model): the micro-batches the trainer builds for one rank's mini-batch under
   `--budget` tokens (actor.max_tokens_per_gpu), for every layout: padded [b, s] rows (the packer sorts
   by length first) and packed THD, each also with context parallelism (cp=2: every sample rounded up
   to a multiple of 4) and with FP8 slot multiples (16 per sequence and per micro-batch). Reported:
   micro-batches, slots processed, real tokens, padding fraction = 1 - real / slots.
2. Step time (megatron-core on CPU, one rank, fp32): a Qwen3-shaped model with a small body
   (`--hidden`, `--layers`) and a `--vocab` vocabulary (the Qwen3 token ids folded into it: the
   vocabulary projection of the response tokens is the same work in both layouts, and at 151,936
   entries it would take most of a CPU step) runs, for padded and for packed, the same
   work the trainer does per mini-batch: the old-policy forward (compute_logprobs) and one
   train_mini_batch (forward, backward, optimizer step). `--steps` timed repetitions after one
   warm-up, the two layouts alternating so the shared machine's load hits both alike; the median and
   the minimum are reported, with the log-prob agreement of the two layouts as a sanity check.

Results: benchmarks/results/packing_cpu.{csv,json}. A benchmark reports numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import time

from benchmarks import REPO, add_output_args, output_path

DATA = os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k", "train.jsonl")


def gsm8k_lengths(n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + response token ids, prompt length) of n random GSM8K training records."""
    from mgrpo.config import ModelConfig
    from mgrpo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelConfig(tokenizer="qwen3"))
    with open(DATA) as f:
        records = [json.loads(line) for line in f]
    out = []
    for rec in random.Random(seed).sample(records, n):
        prompt = tok.apply_chat_template([{"role": "user", "content": rec["question"]}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(rec["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((p + r, len(p)))
    return out


def padding_table(samples, budget: int) -> list[dict]:
    """Micro-batches, slots and padding of every layout, from the trainer's own packers and builder."""
    from mgrpo.data.packing import pack_by_tokens, pack_micro_batches
    from mgrpo.training.batch import RankBatch, batch_layout, build_micro_batch

    batch = RankBatch(input_ids=[ids for ids, _ in samples], prompt_lens=[p for _, p in samples])
    real = sum(batch.lengths())
    rows = []
    for packed in (False, True):
        for cp, fp8 in ((1, None), (2, None), (1, "delayed")):
            lay = batch_layout(packed=packed, cp=cp, fp8_recipe=fp8)
            slots = [lay.slots(n) for n in batch.lengths()]
            groups = (pack_by_tokens if packed else pack_micro_batches)(slots, budget * cp)
            total = sum(build_micro_batch(batch.select(g), batch_layout(packed=packed, cp=cp, cp_rank=r,
                                                                         fp8_recipe=fp8)).slots
                        for g in groups for r in range(cp))
            rows.append({"layout": ("packed" if packed else "padded") + (f"+cp{cp}" if cp > 1 else "")
                         + ("+fp8" if fp8 else ""), "micro_batches": len(groups), "slots": total,
                         "real_tokens": real, "padding_fraction": round(1 - real / total, 4)})
    return rows


def _model(hidden: int, layers: int, vocab: int):
    from mgrpo.config import ModelConfig

    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_attention_heads=4,
                       num_query_groups=2, head_dim=hidden // 4, ffn_hidden_size=3 * hidden, tie_word_embeddings=True,
                       max_position_embeddings=2048)


def _rank_timing(rank, world, port, hf_dir, samples, args_dict):
    """Both actors in this process; one warm-up then alternating timed steps."""
    import dataclasses

    from mgrpo.config import MGRPOConfig
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch

    a = argparse.Namespace(**args_dict)
    base = MGRPOConfig()
    batch = RankBatch(input_ids=[[t % a.vocab for t in ids] for ids, _ in samples], prompt_lens=[p for _, p in samples])
    resp = [len(ids) - p for ids, p in samples]
    total = sum(resp)
    actors = {}
    for packed in (False, True):
        cfg = dataclasses.replace(
            base, model=_model(a.hidden, a.layers, a.vocab),
            algorithm=dataclasses.replace(base.algorithm, use_kl_loss=False),  # no reference model here
            actor=dataclasses.replace(base.actor, pack_sequences=packed, max_tokens_per_gpu=a.budget),
            trainer=dataclasses.replace(base.trainer, device="cpu"))
        # the second actor finds megatron's parallel state initialised (TP=PP=CP=1) and shares its groups
        actors[packed] = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                       init_hf_dir=hf_dir, total_steps=a.steps + 2, need_ref=False,
                                       num_threads=a.threads)
    import torch

    g = torch.Generator().manual_seed(0)

    times = {False: {"logprobs": [], "train": []}, True: {"logprobs": [], "train": []}}
    lps = {}
    for step in range(a.steps + 1):
        for packed in ((False, True) if step % 2 == 0 else (True, False)):
            actor = actors[packed]
            t0 = time.perf_counter()
            out = actor.compute_logprobs(batch, "actor")
            t1 = time.perf_counter()
            lps.setdefault(packed, out["logprobs"])
            train = dataclasses.replace(
                batch, old_logprobs=out["logprobs"], advantages=[torch.randn(r, generator=g).tolist() for r in resp],
                token_weight=[[1.0 / total] * r for r in resp], metric_weight=1.0 / total)
            t2 = time.perf_counter()
            actor.train_mini_batch(train)
            t3 = time.perf_counter()
            if step > 0:
                times[packed]["logprobs"].append(t1 - t0)
                times[packed]["train"].append(t3 - t2)
    diff = max(abs(x - y) for a_, b_ in zip(lps[False], lps[True]) for x, y in zip(a_, b_))
    return {"times": {("packed" if k else "padded"): v for k, v in times.items()}, "logprob_max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64, help="samples in one rank's mini-batch")
    ap.add_argument("--budget", type=int, default=4096, help="actor.max_tokens_per_gpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192, help="model vocabulary (token ids are folded into it)")
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap, "packing_cpu")
    args = ap.parse_args()
    args.out = output_path(args, "packing_cpu")

    from benchmarks.measure.convert_bench import machine
    from mgrpo.models import init_hf_checkpoint
    from mgrpo.training.spawn import spawn_ranks

    samples = gsm8k_lengths(args.samples, args.seed)
    lengths = [len(ids) for ids, _ in samples]
    table = padding_table(samples, args.budget)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = init_hf_checkpoint(os.path.join(tmp, "hf"), _model(args.hidden, args.layers, args.vocab), seed=1)
        (timing,) = spawn_ranks(_rank_timing, 1, hf_dir, samples, vars(args), threads=args.threads)
    for row in table:
        t = timing["times"].get(row["layout"])
        if t:
            row.update({f"{k}_s_median": round(statistics.median(v), 3) for k, v in t.items()})
            row.update({f"{k}_s_min": round(min(v), 3) for k, v in t.items()})
    result = {
        "machine": machine(),
        "workload": {"data": "gsm8k train (question via the Qwen3 chat template -> prompt, answer + EOS -> response)",
                     "tokenizer": "qwen3", "samples": args.samples, "seed": args.seed, "budget": args.budget,
                     "lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                                 "mean": round(statistics.mean(lengths), 1),
                                 "prompt_mean": round(statistics.mean(p for _, p in samples), 1)},
                     "model": vars(_model(args.hidden, args.layers, args.vocab)), "threads": args.threads,
                     "steps": args.steps, "dtype": "fp32", "device": "cpu"},
        "rows": table,
        "logprob_max_diff_padded_vs_packed": timing["logprob_max_diff"],
        "raw_times_s": timing["times"],
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out + ".csv", "w", newline="") as f:
        keys = sorted({k for row in table for k in row}, key=lambda k: list(table[0]).index(k) if k in table[0] else 99)
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(table)
    for row in table:
        print(row)
    print("log-prob max |padded - packed|:", timing["logprob_max_diff"])


if __name__ == "__main__":
    main()
