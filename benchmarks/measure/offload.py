"""actor.offload on a CPU Megatron rank: seconds and bytes moved per step, and the same numbers as without it.

    python -m benchmarks.measure.offload                    # the tiny model, 3 steps
    python -m benchmarks.measure.offload --vocab 151936 --hidden 256 --update-results   # Qwen3's vocabulary

One rank (gloo) runs `--steps` steps as the loop does with colocated engines: offload (before generation), restore
(after it), the reference's forward, one update. Once with every offload on (params, grads, optimizer, ref_params)
and once with none, each in a fresh process. Writes per step the seconds and bytes of the offload and of the
restore, the bytes each group released (its storages held 0 bytes meanwhile), and whether every metric, the
reference log-probs and the final weights are equal to the bit. On CPU the copies are memcpy (host to host);
on CUDA they cross PCIe to pinned buffers, which this machine cannot measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

from benchmarks import add_output_args, write_json


def _run(rank, world, port, hf_dir, model: dict, offload: bool, steps: int):
    import torch

    from mgrpo.config import MGRPOConfig
    from mgrpo.config.offload import OffloadConfig
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch

    cfg = MGRPOConfig()
    cfg.model = dataclasses.replace(cfg.model, **model)
    cfg.actor.offload = OffloadConfig(params=offload, grads=offload, optimizer=offload, ref_params=offload)
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=steps, need_ref=True)
    resp, rows = 8, []
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = torch.randint(1, min(model.get("vocab_size", 16), 1000), (4, 24), generator=g).tolist()
        batch = RankBatch(input_ids=ids, prompt_lens=[16] * 4, advantages=[[1.0] * resp, [-1.0] * resp] * 2,
                          old_logprobs=[[-2.0] * resp] * 4, token_weight=[[1 / (4 * resp)] * resp] * 4,
                          metric_weight=1 / (4 * resp))
        out = actor.offload()
        held = actor.offloaded_bytes()
        back = actor.restore()
        ref = actor.compute_logprobs(batch, "ref")["logprobs"]
        m = actor.train_mini_batch(dataclasses.replace(batch, ref_logprobs=ref))
        rows.append({"offload": out, "restore": back, "groups": held,
                     "metrics": {k: v for k, v in m.items() if not k.startswith("timing_s/")},
                     "ref": [torch.tensor(r).tolist() for r in ref]})
    weights = [p.detach().flatten().tolist() for p in actor.gpt.parameters()]
    n = sum(p.numel() for p in actor.gpt.parameters())
    actor.shutdown()
    return rows, weights, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=None, help="model.vocab_size (default: the tiny model's)")
    ap.add_argument("--hidden", type=int, default=None, help="model.hidden_size (default: the tiny model's)")
    add_output_args(ap, "offload_cpu")
    a = ap.parse_args(argv)

    from mgrpo.config import MGRPOConfig
    from mgrpo.models import init_hf_checkpoint
    from mgrpo.training.spawn import spawn_ranks

    model = {k: v for k, v in (("vocab_size", a.vocab), ("hidden_size", a.hidden)) if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        init_hf_checkpoint(tmp, dataclasses.replace(MGRPOConfig().model, **model), seed=1)
        on, w_on, n = spawn_ranks(_run, 1, tmp, model, True, a.steps, timeout_s=1800, threads=2)[0]
        off, w_off, _ = spawn_ranks(_run, 1, tmp, model, False, a.steps, timeout_s=1800, threads=2)[0]
    equal = (w_on == w_off and all(x["metrics"] == y["metrics"] and x["ref"] == y["ref"] for x, y in zip(on, off)))
    result = {"model": model or "qwen3-tiny", "params": n, "steps": a.steps, "bit_exact": equal,
              "per_step": [{"step": i + 1, "offload_s": r["offload"]["perf/offload_s"],
                            "offload_bytes": r["offload"]["perf/offload_bytes"],
                            "restore_s": r["restore"]["perf/offload_s"],
                            "restore_bytes": r["restore"]["perf/offload_bytes"],
                            "released_bytes": {k: g["released"] for k, g in r["groups"].items()},
                            "resident_while_offloaded": {k: g["resident"] for k, g in r["groups"].items()}}
                           for i, r in enumerate(on)]}
    for row in result["per_step"]:
        print(f"step {row['step']}: offload {row['offload_s'] * 1e3:.1f} ms {row['offload_bytes'] / 2**20:.1f} MiB, "
              f"restore {row['restore_s'] * 1e3:.1f} ms {row['restore_bytes'] / 2**20:.1f} MiB, released "
              f"{ {k: round(v / 2**20, 1) for k, v in row['released_bytes'].items()} } MiB, resident "
              f"{row['resident_while_offloaded']}")
    print("bit-exact with no offload:", equal)
    write_json(a, "offload_cpu", result)


if __name__ == "__main__":
    main()
