"""LoRA on the real MegatronActor (megatron-core over gloo): adapters on the dense and MoE linears, the base
frozen, the reference = the base with the adapters off, the merged export equal to transformers' forward of
the exported checkpoint, and every parallel layout reproducing the one-rank run.

Each layout runs: the actor's and the reference's log-probs, one optimizer step (lr 1e-2, so the adapters,
which start with B = 0, move), then again the actor's and the reference's log-probs, a merged weight sync
and an HF export. The independent reference for the merged weights is transformers' Qwen3 forward of the
exported checkpoint; for the layouts it is the one-rank run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.packing import PROMPTS, Receiver, make_batch, max_diff

pytestmark = pytest.mark.integration

LORA = dict(rank=4, alpha=8.0, target_modules=["all-linear"])
KEYS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


def _config(moe: bool, layout: dict):
    from mgrpo.config.schema import LoraConfig

    if moe:
        from tests.helpers.moe import run_config
    else:
        from tests.helpers.packing import run_config
    layout = dict(layout)
    saved = layout.pop("modules_to_save", [])
    tied = layout.pop("tied", False)
    cfg = run_config(**layout)
    if tied:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_word_embeddings=True))
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, lora=LoraConfig(**LORA,
                                                                                       modules_to_save=saved)))


def _resumed(rank, world, port, hf_dir, moe: bool, layout: dict, ckpt: str):
    """A fresh actor from `ckpt`: its log-probs (adapters and base as saved) and the reference's."""
    from mgrpo.training.actor import MegatronActor

    cfg = _config(moe, layout)
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=1, need_ref=True)
    actor.load_checkpoint(ckpt)
    c = actor.ctx
    full = make_batch(cfg.model.vocab_size)
    batch = full.select([i for i in range(len(full)) if i % c.dp == c.dp_rank])
    return dict(after=actor.compute_logprobs(batch, "actor"), ref=actor.compute_logprobs(batch, "ref"))


def _one_run(rank, world, port, hf_dir, moe: bool, layout: dict, out_dir: str):
    from mgrpo.plan.lora import adapter_counts
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.optim import torch_optimizers

    cfg = _config(moe, layout)
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=1, need_ref=True)
    c = actor.ctx
    full = make_batch(cfg.model.vocab_size)
    mine = [i for i in range(len(full)) if i % c.dp == c.dp_rank]
    batch = full.select(mine)
    base = {n: p.detach().clone() for n, p in actor.gpt.named_parameters() if "lora_" not in n}
    optimized = {id(p) for o in torch_optimizers(actor.optimizer) for g in o.param_groups for p in g["params"]}
    trainable = {n for n, p in actor.gpt.named_parameters() if p.requires_grad}
    in_optimizer = {n for n, p in actor.gpt.named_parameters() if id(p) in optimized}
    before = actor.compute_logprobs(batch, "actor")
    ref = actor.compute_logprobs(batch, "ref")
    metrics = actor.train_mini_batch(batch)
    after = actor.compute_logprobs(batch, "actor")
    ref_after = actor.compute_logprobs(batch, "ref")
    base_moved = [n for n, p in actor.gpt.named_parameters() if n in base and not torch.equal(base[n], p.detach())]
    receiver = Receiver()
    actor.sync_weights([receiver], bucket_bytes=1 << 14)
    unmerged = [n for n, p in actor.gpt.named_parameters() if n in base and not torch.equal(base[n], p.detach())]
    actor.save_hf(out_dir, None)
    actor.save_checkpoint(out_dir + "-ckpt")
    planned = adapter_counts(cfg.model, cfg.actor.lora, c.tp, c.pp, c.ep)[0][c.pp_rank]
    return dict(samples=mine, before=before, planned=planned,
                adapter_numel=sum(p.numel() for n, p in actor.gpt.named_parameters() if "lora_" in n),
                ref=ref, after=after, ref_after=ref_after, metrics=metrics,
                trainable=trainable, in_optimizer=in_optimizer, base_moved=base_moved, unmerged=unmerged,
                synced=receiver.sums, has_ref_model=actor.ref is not None)


def _runs(rank, world, port, hf_dir, moe, layouts, out_dirs):
    from megatron.core import parallel_state as ps

    out = []
    for layout, d in zip(layouts, out_dirs):
        out.append(_one_run(rank, world, port, hf_dir, moe, layout, d))
        ps.destroy_model_parallel()
        out[-1]["resumed"] = _resumed(rank, world, port, hf_dir, moe, layout, d + "-ckpt")
        ps.destroy_model_parallel()
    return out


def _merged(results: list) -> dict:
    n = len(PROMPTS)
    out = {key: [None] * n for key in ("before", "ref", "after", "ref_after")}
    for r in results:
        if r["before"] is None:
            continue
        for key in out:
            for i, v in zip(r["samples"], r[key]["logprobs"]):
                out[key][i] = v
    synced = {k: v for r in results for k, v in r["synced"].items()}
    for r in results:  # a checkpoint brings the adapters back exactly, and the base as it was
        if r["before"] is not None:
            assert r["resumed"]["after"]["logprobs"] == r["after"]["logprobs"]
            assert r["resumed"]["ref"]["logprobs"] == r["ref"]["logprobs"]
    for r in results:  # the planner's count of adapter parameters per rank is what the rank holds
        assert r["adapter_numel"] == r["planned"], (r["adapter_numel"], r["planned"])
    return dict(out, metrics=results[0]["metrics"], synced=synced, first=results[0])


def _hf_logprobs(hf_dir: str, batch, adapter: str | None = None) -> list:
    """transformers' per-response-token log-probs of `batch` under the checkpoint in `hf_dir` (with PEFT's
    LoRA adapter from `adapter` loaded onto it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            logits = model(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append(lp[p - 1:].tolist())
    return out


def _check_one_rank(got: dict, hf_dir: str, export_dir: str, vocab: int) -> None:
    r = got["first"]
    assert not r["has_ref_model"]  # the reference is the actor's base, not a second model
    assert r["trainable"] and all("lora_" in n for n in r["trainable"]), r["trainable"]
    assert r["in_optimizer"] == r["trainable"]  # the optimizer (and its clipping) sees the adapters only
    assert not r["base_moved"] and not r["unmerged"], (r["base_moved"], r["unmerged"])
    # B = 0 at the start: the actor is the base; after the step the reference still is, the actor is not
    assert max_diff(got["before"], got["ref"]) == 0.0
    assert max_diff(got["ref_after"], got["ref"]) == 0.0
    moved = max_diff(got["after"], got["before"])
    assert moved > 1e-3, moved
    batch = make_batch(vocab)
    d_base = max_diff(_hf_logprobs(hf_dir, batch), got["ref"])
    d_merged = max_diff(_hf_logprobs(export_dir, batch), got["after"])
    assert d_base < 1e-5 and d_merged < 1e-5, (d_base, d_merged)
    print(f"one rank: base vs transformers {d_base:.2e}, merged export vs transformers {d_merged:.2e}")


def _check_peft(got: dict, hf_dir: str, export_dir: str, vocab: int, label: str) -> None:
    """PEFT's LoRA on the base, from the exported adapter, gives the trained actor's log-probs."""
    d = max_diff(_hf_logprobs(hf_dir, make_batch(vocab), adapter=export_dir + "/lora_adapter"), got["after"])
    assert d < 1e-5, f"{label}: PEFT adapter on the base differs by {d}"
    print(f"{label}: PEFT adapter on the base vs the actor {d:.2e}")


def _check_same(got: dict, want: dict, label: str) -> None:
    for key in ("before", "ref", "after", "ref_after"):
        d = max_diff(got[key], want[key])
        assert d < 1e-5, f"{label}: {key} log-probs differ by {d}"
    for k in KEYS:
        a, b = got["metrics"][k], want["metrics"][k]
        assert math.isfinite(a) and abs(a - b) < 1e-5, f"{label}: {k} {a} vs {b}"
    assert set(got["synced"]) == set(want["synced"]), label
    diff = max(abs(got["synced"][n] - want["synced"][n]) for n in want["synced"])
    assert diff < 1e-3, f"{label}: merged synced weights differ by {diff}"


def test_dense_lora_one_rank_and_tp_pp_cp_layouts(tmp_path):
    from mgrpo.models import init_hf_checkpoint
    from tests.helpers.convert import tiny_cfg

    hf_dir = init_hf_checkpoint(str(tmp_path / "hf"), tiny_cfg(max_position_embeddings=128), seed=3)
    (one,) = run_ranks(_runs, 1, hf_dir, False, [dict(packed=True)], [str(tmp_path / "one")], timeout_s=600)[0]
    want = _merged([one])
    _check_one_rank(want, hf_dir, str(tmp_path / "one"), 100)
    _check_peft(want, hf_dir, str(tmp_path / "one"), 100, "one rank")
    layouts = [dict(tp=2, packed=True), dict(pp=2, packed=True), dict(cp=2, packed=True), dict(packed=True)]
    two = run_ranks(_runs, 2, hf_dir, False, layouts, [str(tmp_path / f"l{i}") for i in range(len(layouts))],
                    timeout_s=900)
    for i, layout in enumerate(layouts):
        got = _merged([r[i] for r in two])
        _check_same(got, want, str(layout))
        _check_peft(got, hf_dir, str(tmp_path / f"l{i}"), 100, str(layout))


def test_moe_lora_on_experts_at_ep2_and_tp2_ep2(tmp_path):
    from mgrpo.models import init_hf_checkpoint
    from tests.helpers.moe import moe_cfg

    hf_dir = init_hf_checkpoint(str(tmp_path / "hf"), moe_cfg(), seed=3)
    (one,) = run_ranks(_runs, 1, hf_dir, True, [dict()], [str(tmp_path / "one")], timeout_s=600)[0]
    want = _merged([one])
    assert any("local_experts" in n for n in one["trainable"])
    _check_one_rank(want, hf_dir, str(tmp_path / "one"), moe_cfg().vocab_size)
    layouts = [dict(ep=2), dict(tp=2, ep=2)]
    two = run_ranks(_runs, 2, hf_dir, True, layouts, [str(tmp_path / f"l{i}") for i in range(len(layouts))],
                    timeout_s=900)
    for i, layout in enumerate(layouts):
        _check_same(_merged([r[i] for r in two]), want, str(layout))


def test_modules_to_save_trains_the_embedding_whole_and_the_reference_keeps_it(tmp_path):
    """PEFT's modules_to_save=[embed_tokens] on the tied tiny model: the shared embedding trains beside the
    adapters (in the optimizer), the reference keeps its initial values, the merged export and PEFT's adapter
    (the embedding saved whole, tied to lm_head) give the actor's log-probs."""
    from mgrpo.models import init_hf_checkpoint
    from tests.helpers.convert import tiny_cfg

    hf_dir = init_hf_checkpoint(str(tmp_path / "hf"), tiny_cfg(max_position_embeddings=128,
                                                               tie_word_embeddings=True), seed=3)
    layout = dict(packed=True, modules_to_save=["embed_tokens"], tied=True)
    (one,) = run_ranks(_runs, 1, hf_dir, False, [layout], [str(tmp_path / "one")], timeout_s=600)[0]
    got = _merged([one])
    emb = "embedding.word_embeddings.weight"
    assert one["trainable"] == {n for n in one["trainable"] if "lora_" in n} | {emb}, one["trainable"]
    assert one["in_optimizer"] == one["trainable"]
    assert one["base_moved"] == [emb] and one["unmerged"] == [emb]
    assert max_diff(got["before"], got["ref"]) == 0.0 and max_diff(got["ref_after"], got["ref"]) == 0.0
    batch = make_batch(100)
    d_base = max_diff(_hf_logprobs(hf_dir, batch), got["ref"])
    d_merged = max_diff(_hf_logprobs(str(tmp_path / "one"), batch), got["after"])
    assert d_base < 1e-5 and d_merged < 1e-5, (d_base, d_merged)
    _check_peft(got, hf_dir, str(tmp_path / "one"), 100, "modules_to_save")
