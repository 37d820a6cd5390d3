"""The reward models' engines in the plan (reward.models), and on-policy distillation's SGLang teacher engines
(teacher.mode=sglang: engines x tp accelerators of their own, like placement=own): accelerators, memory, FITS / DOES
NOT FIT.

- placement=own: engines x tp accelerators of their own, which must be left over beside the trainer's (and a
  disaggregated rollout's).
- placement=shared: the engines sit on the rollout engines' accelerators (at most one engine of each model per
  card: engines x tp <= the rollout's accelerators), each holding gpu_memory_utilization of its card for the whole
  run (a reward engine is frozen: it never releases memory). The card that holds one engine of every shared model
  must hold, at once: the rollout engine's share and the reward shares while generating (their sum at most
  SHARE_LIMIT, the rest is CUDA contexts and the allocator); the trainer's peak plus the reward shares while
  training, where the rollout shares the trainer's cards (colocated, hybrid); and each reward engine's weights
  (checkpoint bytes / tp) inside its share.
An engine at a url (or a judge at an OpenAI-compatible endpoint) takes nothing of the cluster.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

from mgrpo.config import Layout, MGRPOConfig
from mgrpo.config.reward import engine_share

SHARE_LIMIT = 0.95
"""Most of a card the SGLang servers on it may claim together (--mem-fraction-static summed)."""


def weights_bytes(path: str) -> Optional[int]:
    files = glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")) if path else []
    return sum(os.path.getsize(f) for f in files) if files else None


def reward_model_plan(cfg: MGRPOConfig, lay: Layout, memory: Optional[dict] = None) -> dict:
    """`memory`: the trainer's memory plan (capacity and peak per accelerator), for placement=shared."""
    r = cfg.rollout
    models, problems = [], []
    cuda = cfg.trainer.device == "cuda"
    capacity = memory["capacity"] if memory and cuda else None
    for name, m in cfg.reward.models.items():
        remote = bool(m.url or (m.kind == "generative" and m.judge.openai_url))
        engines = 0 if remote else m.engines
        shared = m.placement == "shared"
        share = engine_share(m)
        size = weights_bytes(m.hf_path)
        x = {"name": name, "kind": str(m.kind), "engines": engines, "tp": m.tp, "placement": str(m.placement),
             "accelerators": 0 if remote or shared else engines * m.tp, "shared_accelerators":
             engines * m.tp if shared else 0, "gpu_memory_utilization": share,
             "url": m.url or (m.judge.openai_url if m.kind == "generative" else None), "weights_bytes": size}
        models.append(x)
        if not cuda or not engines:
            continue
        if shared and engines * m.tp > lay.rollout_devices:
            problems.append(f"{name}: {engines} engine(s) x tp {m.tp} = {engines * m.tp} accelerator(s) to share, "
                            f"but the rollout has {lay.rollout_devices}")
        if size is not None and capacity and size / m.tp > share * capacity:
            problems.append(f"{name}: weights {size / m.tp / 2**30:.2f} GiB per accelerator exceed its share "
                            f"{share} x {capacity / 2**30:.0f} GiB (raise reward.models.{name}.gpu_memory_utilization)")
    t = cfg.teacher
    if t.hf_path and t.mode == "sglang":  # on-policy distillation's teacher engines: accelerators of their own
        size = weights_bytes(t.hf_path)
        models.append({"name": "teacher", "kind": "teacher", "engines": t.num_engines, "tp": t.tp, "placement": "own",
                       "accelerators": t.num_engines * t.tp, "shared_accelerators": 0,
                       "gpu_memory_utilization": t.gpu_memory_utilization, "url": None, "weights_bytes": size})
        if cuda and size is not None and capacity and size / t.tp > t.gpu_memory_utilization * capacity:
            problems.append(f"teacher: weights {size / t.tp / 2**30:.2f} GiB per accelerator exceed its share "
                            f"{t.gpu_memory_utilization} x {capacity / 2**30:.0f} GiB (raise "
                            "teacher.gpu_memory_utilization or teacher.tp)")
    own = sum(x["accelerators"] for x in models)
    used = lay.megatron_world + (lay.rollout_devices if r.mode == "disaggregated" else 0)
    free = lay.total - used
    if cuda and own > free:
        who = "placement=own and the teacher need" if t.hf_path and t.mode == "sglang" else "placement=own needs"
        problems.append(f"{who} {own} accelerator(s); {free} are left beside the trainer's and the rollout's")
    on_card = sum(x["gpu_memory_utilization"] for x in models if x["shared_accelerators"])
    out = {"models": models, "accelerators": own, "cluster_free_accelerators": free,
           "shared_share_per_card": round(on_card, 4)}
    if cuda and on_card:
        if r.gpu_memory_utilization + on_card > SHARE_LIMIT:
            problems.append(f"generation: rollout.gpu_memory_utilization {r.gpu_memory_utilization} + the shared "
                            f"reward engines' {on_card:.2f} = {r.gpu_memory_utilization + on_card:.2f} of a card, "
                            f"past {SHARE_LIMIT}")
        if r.shares_actor_devices and capacity and memory:
            # the trainer's phases (the generation phase is the rollout's share, counted above)
            peak = max(t["total"] for name, t in memory["phases"].items() if name != "generation")
            need = peak + on_card * capacity
            out["training_peak_with_rewards"] = int(need)
            if need > capacity:
                problems.append(f"training: the trainer's peak {peak / 2**30:.1f} GiB + the shared reward "
                                f"engines' {on_card * capacity / 2**30:.1f} GiB = {need / 2**30:.1f} GiB, past the "
                                f"card's {capacity / 2**30:.0f} GiB")
    out["fits"] = not problems
    out["problems"] = problems
    return out


def render_reward_models(rm: dict, device: str) -> list[str]:
    out = []
    for x in rm["models"]:
        size = f"{x['weights_bytes'] / 2**20:.2f} MiB" if x["weights_bytes"] is not None else \
            "size unknown (no checkpoint here)"
        if x["url"]:
            where = f"at {x['url']} (not launched)"
        elif x["placement"] == "shared":
            where = (f"{x['engines']} engine(s) x tp {x['tp']} on the rollout's accelerators "
                     f"({x['gpu_memory_utilization']} of each card)")
        else:
            where = f"{x['engines']} engine(s) x tp {x['tp']} = {x['accelerators']} accelerator(s)"
        if x["kind"] == "teacher":
            out.append(f"teacher   on-policy distillation teacher (SGLang, log-probs of the student's tokens), {where}, "
                       f"weights {size} per engine, frozen")
            continue
        what = "judge (chat model)" if x["kind"] == "generative" else "reward model (SGLang --is-embedding)"
        out.append(f"reward    {x['name']}: {x['kind']} {what}, {where}, weights {size} per engine, frozen")
    if not rm["models"]:
        return out
    if device != "cuda":
        if rm["accelerators"] or any(x["shared_accelerators"] for x in rm["models"]):
            out.append("          on CPU each reward engine is one more server process: placement=own in a CPU "
                       "bundle of its own in the run's placement group mgrpo-reward-<name>, shared in a rollout "
                       "engine's bundle")
        return out
    verdict = "FITS" if rm["fits"] else "DOES NOT FIT"
    out.append(f"          {verdict}: own accelerators {rm['accelerators']} of {rm['cluster_free_accelerators']} left; "
               f"shared {rm['shared_share_per_card']} of each rollout card"
               + "".join(f"\n          - {p}" for p in rm["problems"]))
    out.append("          (placed in the run's Ray placement groups: own -> mgrpo-reward-<name>, one bundle of tp "
               "accelerators per engine; shared -> the rollout engines' bundles, on their accelerators"
               + ("; the teacher's engines: where Ray has room, in no placement group)"
                  if any(x["kind"] == "teacher" for x in rm["models"]) else ")"))
    return out
