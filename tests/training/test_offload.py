"""actor.offload: the actor's parameters, gradients and optimizer states, and the reference's parameters, in host
memory while the engines generate (mgrpo/training/offload.py). On CPU the same code runs with unpinned host
buffers: the storages really are released (0 bytes) and restored, so a run with every offload on must give
bit for bit what one without gives."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from mgrpo.training.offload import HostOffload, unique_storages
from tests.helpers.distributed import run_ranks


def test_storages_are_released_and_come_back_bit_for_bit():
    flat = torch.randn(64, generator=torch.Generator().manual_seed(0))
    views = [flat[:10], flat[10:40].view(5, 6), flat[40:]]  # megatron's params: views into one buffer
    grad = torch.randn(64)
    frozen = [torch.randn(8), torch.randn(3, 3)]
    before = [v.clone() for v in views], [f.clone() for f in frozen]
    host = HostOffload(pinned=False)
    assert len(unique_storages(views)) == 1 and len(unique_storages([*views, grad], skip={flat.data_ptr()})) == 1

    host.offload("params", unique_storages(views))
    host.offload("grads", unique_storages([grad]), copy=False)
    host.offload("ref", unique_storages(frozen), frozen=True)
    assert all(v.untyped_storage().nbytes() == 0 for v in [*views, grad, *frozen])
    first = host.take()
    assert first["perf/offload_bytes"] == 64 * 4 + (8 + 9) * 4  # the gradients are not copied
    host.restore("params"), host.restore("grads"), host.restore("ref")
    assert all(torch.equal(a, b) for a, b in zip(views, before[0]))
    assert all(torch.equal(a, b) for a, b in zip(frozen, before[1]))
    assert torch.count_nonzero(grad) == 0  # released without a copy: back as zeros
    assert host.take()["perf/offload_bytes"] == 64 * 4 + (8 + 9) * 4

    # A frozen group is copied out once: offloading it again moves nothing, restoring it moves its bytes in.
    host.offload("ref", unique_storages(frozen), frozen=True)
    assert host.take()["perf/offload_bytes"] == 0 and frozen[0].untyped_storage().nbytes() == 0
    host.restore("ref")
    assert host.take()["perf/offload_bytes"] == (8 + 9) * 4
    assert all(torch.equal(a, b) for a, b in zip(frozen, before[1]))
    # A group that changed between steps is copied again (not a stale host copy).
    views[0].add_(1.0)
    host.offload("params", unique_storages(views))
    host.restore("params")
    assert torch.equal(views[0], before[0][0] + 1.0)


def _steps(rank, world, port, hf_dir, offload: bool, dtype: str):
    from mgrpo.config import MGRPOConfig
    from mgrpo.config.offload import OffloadConfig
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch

    cfg = MGRPOConfig()
    cfg.actor.dtype = dtype
    cfg.actor.offload = OffloadConfig(params=offload, grads=offload, optimizer=offload, ref_params=offload)
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=3, need_ref=True)
    resp, out, probes = 3, [], []
    for step in range(3):
        batch = RankBatch(input_ids=[[1, 2, 3, 4 + step, 5], [2, 3, 4, 5, 6 - step]], prompt_lens=[2, 2],
                          advantages=[[1.0] * resp, [-1.0] * resp], old_logprobs=[[-2.0] * resp] * 2,
                          token_weight=[[1 / (2 * resp)] * resp] * 2, metric_weight=1 / (2 * resp))
        moved = actor.offload()  # as before generation
        probes.append(actor.offloaded_bytes())
        moved_back = actor.restore()
        ref = actor.compute_logprobs(batch, "ref")["logprobs"]
        probes.append(actor.offloaded_bytes())  # the reference is out again after its forward
        metrics = actor.train_mini_batch(dataclasses.replace(batch, ref_logprobs=ref))
        out.append({"ref": [torch.tensor(r).tolist() for r in ref], "moved": moved, "moved_back": moved_back,
                    **{k: v for k, v in metrics.items() if not k.startswith("timing_s/")}})
    params = [p.detach().float().flatten().tolist() for p in actor.gpt.parameters()]
    actor.shutdown()
    return out, params, probes


@pytest.mark.integration
def test_every_offload_on_trains_bit_for_bit_as_none(tmp_path):
    """Three updates of the CPU actor (megatron's DDP buffers and its optimizer over torch's fused AdamW), each
    after an offload and a restore, and a reference forward between them: the same losses, gradient norms,
    reference log-probs and final weights, to the bit, as without offload; while offloaded every group's
    storages hold 0 bytes. (bf16 with fp32 master weights: megatron's Float16 optimizer wraps CUDA tensors only;
    the master weights are found as the torch optimizer's own parameters, the same code path.)"""
    dtype = "fp32"
    from mgrpo.config import MGRPOConfig
    from mgrpo.models import init_hf_checkpoint

    init_hf_checkpoint(str(tmp_path / "init"), MGRPOConfig().model, seed=1)
    on, params_on, probes = run_ranks(_steps, 1, str(tmp_path / "init"), True, dtype)[0]
    off, params_off, none = run_ranks(_steps, 1, str(tmp_path / "init"), False, dtype)[0]
    for a, b in zip(on, off):
        a, b = dict(a), dict(b)
        moved, back = a.pop("moved"), a.pop("moved_back")
        b.pop("moved"), b.pop("moved_back")
        assert a == b  # every metric and reference log-prob, exactly
        assert moved["perf/offload_bytes"] > 0 and back["perf/offload_bytes"] > 0
    assert params_on == params_off
    assert none == [{}] * 6
    n_params = sum(len(p) for p in params_on)
    # before generation: params, grads and optimizer out (the optimizer's states exist from the first step on),
    # the reference out since start-up; after the reference's forward only the reference is out
    for step in range(3):
        out, after_ref = probes[2 * step], probes[2 * step + 1]
        assert set(out) == {"params", "grads", "optimizer", "ref"} and set(after_ref) == {"ref"}
        assert all(g["resident"] == 0 for g in out.values()), out
        assert out["params"]["released"] >= n_params * 4
        assert out["grads"]["released"] >= n_params * 4 and out["ref"]["released"] == out["params"]["released"]
        # before the first step an fp32 actor's optimizer holds nothing of its own (Adam's state comes with the
        # first step; its parameters are the model's); from then on Adam's two moments per parameter
        assert out["optimizer"]["released"] == 0 if step == 0 else out["optimizer"]["released"] >= n_params * 8
        assert after_ref["ref"]["resident"] == 0
    # bytes moved per step: params and optimizer copied out and in, the reference in (out once, at start-up)
    assert on[1]["moved"]["perf/offload_bytes"] == out["params"]["released"] + out["optimizer"]["released"]
    assert on[1]["moved_back"]["perf/offload_bytes"] == (out["params"]["released"] + out["optimizer"]["released"]
                                                         + out["ref"]["released"])


@pytest.mark.system
def test_colocated_run_with_every_offload_matches_one_without(tmp_path):
    """Two training steps with SGLang-protocol CPU engines colocated: every offload on gives the same metrics and
    the same HF export as no offload, with the seconds and bytes moved in each step's metrics; while the engines
    generate, every offloaded storage of every rank holds 0 bytes."""
    from safetensors.torch import load_file

    from mgrpo.loop import Trainer
    from tests.helpers.runs import read_metrics, small_config

    seen = []

    class Probed(Trainer):
        def _start(self, prepared):
            super()._start(prepared)
            nxt = self.parts.experiences.next

            def next_probed(*args, **kwargs):
                seen.append(self.parts.actor.group.offloaded_bytes())
                return nxt(*args, **kwargs)

            self.parts.experiences.next = next_probed

    every = {"params": True, "grads": True, "optimizer": True, "ref_params": True}
    runs = {}
    for name, offload in (("on", every), ("off", {})):
        run_dir = str(tmp_path / name)
        cfg = small_config(run_dir, trainer={"save_hf": True})
        cfg.actor.offload = dataclasses.replace(cfg.actor.offload, **offload)
        (Probed if offload else Trainer)(cfg).fit()
        runs[name] = read_metrics(run_dir), load_file(os.path.join(run_dir, "hf", "model.safetensors"))
    (on, export_on), (off, export_off) = runs["on"], runs["off"]
    varying = ("timing_s/", "perf/", "time", "memory/", "system/")
    for a, b in zip(on, off):
        assert {k: v for k, v in a.items() if not k.startswith(varying)} == \
               {k: v for k, v in b.items() if not k.startswith(varying)}
        assert a["perf/offload_bytes"] > 0 and a["perf/offload_s"] > 0
        assert "perf/offload_bytes" not in b
    assert export_on.keys() == export_off.keys()
    assert all(torch.equal(export_on[k], export_off[k]) for k in export_on)
    assert len(seen) == 2
    for step, ranks in enumerate(seen):
        for groups in ranks:
            assert groups.keys() == {"params", "grads", "optimizer", "ref"}
            assert all(g["resident"] == 0 for g in groups.values()), groups
            # an fp32 actor's optimizer holds nothing of its own before its first step (Adam's state comes with it)
            assert all(g["released"] > 0 for k, g in groups.items() if k != "optimizer" or step), groups


def test_offload_keys_are_result_neutral_so_a_checkpoint_without_them_resumes(tmp_path):
    """actor.offload.* changes no number a run computes (the bit-exact tests above): a run may resume with
    offload turned on or off; a result-changing key still refuses."""
    from mgrpo.components.run_folder import RunFolder, fingerprint
    from mgrpo.config import ConfigError, MGRPOConfig
    from mgrpo.config.offload import OffloadConfig

    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(tmp_path)))
    saved_fp = fingerprint(cfg)
    assert not any(k.startswith("actor.offload") for k in saved_fp)
    on = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, offload=OffloadConfig(True, True, True, True)))
    got = RunFolder(str(tmp_path), on).decide("ckpt", {"step": 3, "config": saved_fp, "total_steps": 10}, 10)
    assert got.resume_dir == "ckpt" and not got.finished
    other = dataclasses.replace(on, actor=dataclasses.replace(on.actor, lr=on.actor.lr * 2))
    with pytest.raises(ConfigError, match=r"actor\.lr"):
        RunFolder(str(tmp_path), other).decide("ckpt", {"step": 3, "config": saved_fp, "total_steps": 10}, 10)


def test_actor_offload_needs_engines_on_the_actors_accelerators():
    from mgrpo.config import ConfigError, MGRPOConfig, validate
    from mgrpo.config.offload import OffloadConfig

    cfg = MGRPOConfig()
    cfg.rollout.mode = "disaggregated"
    cfg.trainer.n_gpus_per_node = 2
    cfg.actor.offload = OffloadConfig(ref_params=True)  # frees memory for the update too: allowed
    validate(cfg, check_files=False)
    cfg.actor.offload = OffloadConfig(params=True, optimizer=True)
    with pytest.raises(ConfigError, match=r"actor\.offload\.params, actor\.offload\.optimizer: the actor hands its "
                                          r"memory to engines on its accelerators .*rollout\.mode=disaggregated"):
        validate(cfg, check_files=False)


def test_plan_shows_each_offload_and_suggests_it_when_it_makes_the_run_fit():
    """Qwen3-30B-A3B on two nodes of 8 x 80 GiB (tp 4, ep 16) does not fit while the engines generate; the plan
    names actor.offload.optimizer as the cheapest change that fits, and its table takes exactly the offloaded terms
    out of the generation phase (and the reference out of every phase but its forward)."""
    from mgrpo.plan import offload as plan_offload
    from mgrpo.plan.memory import ALLOCATOR_SLACK
    from mgrpo.plan.memory import estimate, verdict
    from mgrpo_launchers.plan import compose_config

    cfg = compose_config(["recipe=qwen3-8b-gsm8k-grpo", "model=qwen3-30b-a3b", "actor.tp=4", "actor.ep=16",
                   "trainer.nnodes=2"])
    v = verdict(cfg)
    assert not v.fits and v.memory.peak_phase == "generation"
    assert v.suggestion == ["actor.offload.optimizer=true"] and v.suggested.fits
    base = v.memory.phases
    t = plan_offload.table(cfg, estimate, slack=ALLOCATOR_SLACK)
    rows = t["choices"]
    for key, term in plan_offload.OFFLOADED_TERM.items():
        gen = rows[key]["trainer_by_phase"]["generation"]
        assert gen == rows["none"]["trainer_by_phase"]["generation"] - base["generation"][term], key
    assert rows["ref_params"]["trainer_by_phase"]["training"] == \
        rows["none"]["trainer_by_phase"]["training"] - base["training"]["reference_weights"]
    assert rows["ref_params"]["trainer_by_phase"]["log-probs"] == rows["none"]["trainer_by_phase"]["log-probs"]
    # KV tokens: Qwen3-30B-A3B keeps 4 key/value heads of 128 over 48 layers; at rollout.tp 2, 2 heads per GPU
    assert t["kv_bytes_per_token"] == 2 * 48 * 2 * 128 * 2
    assert all(rows[k]["kv_tokens_more_than_none"] > 0 for k in plan_offload.ORDER)
    assert rows["all"]["kv_tokens_at_largest_share"] > rows["optimizer"]["kv_tokens_at_largest_share"]
    assert not rows["none"]["fits"] and rows["optimizer"]["fits"] and rows["all"]["fits"]
