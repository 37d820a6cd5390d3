"""Are the tiny model's logits on CPU batch-invariant? One row decoded alone against the same row inside a batch
of 8 (the other rows longer and shorter, left-padded as both CPU engines pad them).

    python -m benchmarks.measure.batch_invariance      # writes outputs/benchmarks/batch_invariance_cpu.json

Per-request seeds (rollout/seeded.py) make a row's *random draw* independent of its batch; the draw is then
a function of the row's logits, so a trajectory regenerated in another batch is bit-exact only if its logits
are. For each vocabulary (the default 16-token tiny model, the printable tokenizer's 107 rows of the tool
task) it measures the max abs difference of the last position's logits over `--rows` prompts (prefill, the
way the CPU server's first step sees them, and the in-process engine's transformers forward), and whether the
seeded draw of the first token ever differs.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile

from benchmarks import add_output_args, output_path
from benchmarks.tools.proctree import machine


def measure(vocab_name: str, vocab: int, rows: int, seed: int) -> dict:
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from mgrpo.config.schema import ModelConfig
    from mgrpo.models.hf_io import init_hf_checkpoint
    from mgrpo.rollout.seeded import multinomial_with_seed

    with tempfile.TemporaryDirectory() as d:
        hf = init_hf_checkpoint(d, dataclasses.replace(ModelConfig(), vocab_size=vocab), seed=seed)
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    rng = random.Random(seed)

    def last_logits(prompts: list[list[int]]) -> torch.Tensor:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1, :].float()

    diffs, exact, draws_differ = [], 0, 0
    for _ in range(rows):
        row = [rng.randrange(1, vocab) for _ in range(rng.randrange(8, 40))]
        others = [[rng.randrange(1, vocab) for _ in range(rng.randrange(4, 64))] for _ in range(7)]
        alone = last_logits([row])[0]
        batched = last_logits([others[0], others[1], others[2], row, *others[3:]])[3]
        d = float((alone - batched).abs().max())
        diffs.append(d)
        exact += d == 0.0
        s, p = torch.tensor([rng.randrange(2 ** 62)]), torch.tensor([len(row) - 1])
        draws_differ += int(multinomial_with_seed(torch.log_softmax(alone, -1)[None], s, p)) != \
            int(multinomial_with_seed(torch.log_softmax(batched, -1)[None], s, p))
    return {"vocab": vocab_name, "vocab_size": vocab, "rows": rows, "max_abs_diff": max(diffs),
            "mean_abs_diff": sum(diffs) / len(diffs), "rows_bit_exact": exact, "seeded_draws_differ": draws_differ}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    add_output_args(ap, "batch_invariance_cpu.json")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out = {"machine": machine(), "torch": torch.__version__, "batch": 8,
           "cases": [measure("tiny", 16, a.rows, a.seed), measure("printable", 107, a.rows, a.seed)]}
    for c in out["cases"]:
        print(f"{c['vocab']:>9} vocab={c['vocab_size']:>3}: max |logit alone - logit in a batch of 8| = "
              f"{c['max_abs_diff']:.3g} (mean {c['mean_abs_diff']:.3g}), {c['rows_bit_exact']}/{c['rows']} rows "
              f"bit-exact, seeded first draw differs in {c['seeded_draws_differ']}")
    path = output_path(a, "batch_invariance_cpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
