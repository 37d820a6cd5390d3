"""One token per row from [rows x vocab] probabilities on CPU: what a decode step's draw costs.

    python -m benchmarks.measure.sampler                   # 16 and 64 rows of Qwen3's 151,936-token vocabulary
    python -m benchmarks.measure.sampler --update-results  # benchmarks/results/sampler_cpu.json

Draws compared (one thread, as the engine's rank in the CPU benchmarks):
- torch.multinomial(probs, 1): what transformers' generate and SGLang's torch sampler call; for one sample
  it is the exponential race, argmax(probs / Exp(1) noise), with one exponential per entry;
- the same race with the noise from torch.rand (Exp(1) = -log U, float64 uniforms: float32 ones put 2**-24 of
  the mass at one value, which a 151,936-entry row meets every few draws);
- mgrpo.rollout.categorical.sample_categorical: inversion on two levels, one uniform per row (what the
  in-process engine draws with).
Median of --repeats calls after 3 warm-up calls, and the transformers decode step it sits in for scale: the
forward and LM head of the Qwen3-vocabulary benchmark model (benchmarks/peers/grpo_workloads.py) with a KV cache
of 150 prompt tokens. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks import add_output_args, output_path


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def _decode_step_ms(rows: int, repeats: int) -> float:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, intermediate_size=768, tie_word_embeddings=True,
                      max_position_embeddings=2048)
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 150_000, (rows, 150))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        nxt = torch.randint(0, 150_000, (rows, 1))

        def step():
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the token just added: the same cache length every call

        return _median_ms(step, repeats)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    add_output_args(ap, "sampler_cpu.json")
    a = ap.parse_args(argv)
    a.out = output_path(a, "sampler_cpu.json")
    import torch

    from mgrpo.rollout.categorical import sample_categorical

    torch.set_num_threads(1)
    load0 = os.getloadavg()
    vocab = 151_936
    results = []
    for rows in a.rows:
        probs = torch.softmax(torch.randn(rows, vocab) * 3, dim=-1)

        def race_rand():
            q = torch.rand(probs.shape, dtype=torch.float64).log_().neg_()
            return (probs / q).argmax(-1, keepdim=True)

        row = {"rows": rows, "vocab": vocab,
               "torch_multinomial_ms": _median_ms(lambda: torch.multinomial(probs, 1), a.repeats),
               "race_rand_float64_ms": _median_ms(race_rand, a.repeats),
               "sample_categorical_ms": _median_ms(lambda: sample_categorical(probs), a.repeats),
               "transformers_decode_step_ms": _decode_step_ms(rows, max(5, a.repeats // 3))}
        results.append(row)
        print(f"{rows:3d} rows x {vocab}: torch.multinomial {row['torch_multinomial_ms']:.2f} ms, race with rand "
              f"{row['race_rand_float64_ms']:.2f} ms, sample_categorical {row['sample_categorical_ms']:.2f} ms; "
              f"the decode step's forward {row['transformers_decode_step_ms']:.2f} ms")
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(["python", "-m", "benchmarks.measure.sampler",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "threads": 1, "repeats": a.repeats, "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
                   "torch_version": torch.__version__, "results": results}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
