"""Parts 3 and 4: megatron-core training of a small Qwen3 with the Triton kernel inside, against the same
steps in fp32 on the CPU, and a transformers rollout against the trainer's step-0 log-probs. No Ray:
ranks are processes from `mgrpo.training.spawn`, each hosting `mgrpo.training.actor.MegatronActor`.

  python -m benchmarks.gpu.train_check --part train --mode gpu --out DIR
  python -m benchmarks.gpu.train_check --part te    --mode gpu --out DIR   # TE spec + FP8

What runs (one prompt batch, the same for every run):
  1. rollout   `HFRolloutEngine` generates 16 responses (8 prompts x 2) with per-token log-probs,
               on the device in the trainer's dtype (GPU: CUDA, bf16; dry run: CPU, fp32).
  2. reference one CPU rank in fp32, logprob_impl=chunked (CUDA hidden from it): actor and reference
               log-probs of the batch, two optimizer steps on it, log-probs again.
  3. device    the same on the device: GPU bf16 with logprob_impl=fused (Triton); part `te` with
               actor.fp8=hybrid (Transformer Engine spec, delayed scaling). Dry run: CPU fp32, fused
               under TRITON_INTERPRET=1.
Compared: step-0 log-probs rollout vs device trainer and device vs reference; each step's loss,
pg_loss, kl_loss, entropy, ppo_kl, grad_norm; and the change of log-probs the two updates made
(cosine and relative error, device vs reference: the same update, not just the same loss).

Where MegatronActor cannot run on CUDA as it is, the first device attempt's error is recorded and a
second attempt runs with named shims (see `GPU_SHIMS`), so the check still measures the numbers and
the JSON says what the trainer itself must fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.gpu.common import Skip, bootstrap, check, importable, not_on_device_imported, part, write_json

bootstrap()

import torch  # noqa: E402

PAD, EOS = 0, 1
N_PROMPTS, N_SAMPLES, TEMPERATURE, SEED = 8, 2, 1.0, 7
METRICS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm")
# (log-prob max, log-prob mean, metric rtol, metric atol, update cosine >=, update rel err <=) per run kind.
TOL = {
    "dry-run": dict(lp_max=1e-4, lp_mean=1e-5, rtol=1e-5, atol=1e-5, cos=0.9999, upd_rel=1e-3),
    "bf16": dict(lp_max=0.25, lp_mean=0.02, rtol=2e-2, atol=2e-3, cos=0.9, upd_rel=0.3),
    "fp8": dict(lp_max=1.0, lp_mean=0.1, rtol=0.1, atol=1e-2, cos=0.8, upd_rel=0.6),
}
GPU_SHIMS = {
    "process_group_cpu_gloo": "init the default group as 'cpu:gloo,cuda:nccl' before MegatronActor (its metric "
                              "and finite-check all-reduces use CPU tensors, which NCCL refuses)",
    "micro_batch_to_device": "move each MicroBatch to the rank's CUDA device (build_micro_batch makes CPU tensors)",
}


def model_config(gpu: bool):
    from mgrpo.config import ModelConfig

    if gpu:  # the real vocabulary through the kernel; a tiny body
        return ModelConfig(vocab_size=151936, hidden_size=256, num_layers=2, num_attention_heads=4,
                           num_query_groups=2, head_dim=64, ffn_hidden_size=512, max_position_embeddings=512,
                           tie_word_embeddings=False)
    return ModelConfig(vocab_size=64, tie_word_embeddings=False)


def run_config(model, *, dtype: str, impl: str, fp8=None):
    from mgrpo.config import MGRPOConfig

    cfg = MGRPOConfig()
    return replace(cfg, model=model,
                   algorithm=replace(cfg.algorithm, entropy_coeff=0.01, use_kl_loss=True, kl_coef=0.001),
                   actor=replace(cfg.actor, dtype=dtype, logprob_impl=impl, fp8=fp8, lr=5e-4,
                                 max_tokens_per_gpu=1 << 16))


def reference_config(model):
    return run_config(model, dtype="fp32", impl="chunked")


# --- rollout ------------------------------------------------------------------------------------------
class _InputsTo:
    """The HF engine builds its input ids on the CPU (it is the CPU engine; SGLang serves GPUs): this
    wrapper moves them to the model's device, nothing else."""

    def __init__(self, model, device):
        self._model, self._device = model, device

    def generate(self, **kw):
        return self._model.generate(**{k: v.to(self._device) if torch.is_tensor(v) else v for k, v in kw.items()})

    def __getattr__(self, name):
        return getattr(self._model, name)


def rollout(hf_dir: str, model, device: torch.device, dtype: torch.dtype, max_new_tokens: int) -> dict:
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(2, model.vocab_size, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(N_PROMPTS)]
    engine = HFRolloutEngine(hf_dir, eos_token_ids=[EOS], pad_token_id=PAD)
    if device.type == "cuda" or dtype != torch.float32:
        engine.model.to(device=device, dtype=dtype)
        engine.model = _InputsTo(engine.model, device)
    reqs = [GenerateRequest(uid=i, prompt_ids=prompts[i // N_SAMPLES]) for i in range(N_PROMPTS * N_SAMPLES)]
    res = engine.generate(reqs, SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new_tokens, seed=SEED))
    adv = torch.randn(len(res), generator=g).tolist()
    return {"prompts": [r.prompt_ids for r in reqs], "responses": [r.token_ids for r in res],
            "rollout_logprobs": [r.logprobs for r in res], "advantages": adv,
            "device": str(device), "dtype": str(dtype).replace("torch.", "")}


# --- one rank -----------------------------------------------------------------------------------------
def _apply_gpu_shims(rank: int, world: int, port: int) -> None:
    import datetime
    from dataclasses import replace as dc_replace

    import torch.distributed as dist

    import mgrpo.training.actor as actor_mod

    torch.cuda.set_device(rank)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    build = actor_mod.build_micro_batch

    def on_device(batch, *a, **k):
        mb = build(batch, *a, **k)
        dev = torch.device("cuda", torch.cuda.current_device())
        if hasattr(mb, "to"):  # newer trees have MicroBatch.to (and the actor may call it already: harmless)
            return mb.to(dev)
        names = ("tokens", "position_ids", "positions", "labels", "sample_of_token")
        moved = {f: getattr(mb, f).to(dev) for f in names}
        return dc_replace(mb, **moved, fields={k: v.to(dev) for k, v in mb.fields.items()})

    actor_mod.build_micro_batch = on_device


def _layer_spec(gpt) -> str:
    te = any(c.__module__.startswith("transformer_engine") for m in gpt.modules() for c in type(m).__mro__)
    return "transformer_engine" if te else "local"


def train_rank(rank: int, world: int, port: int, cfgs: list, hf_dir: str, data: dict, shims: bool) -> list[dict]:
    """For each config in turn (one megatron import for all): `one_run`, each on a fresh port."""
    from mgrpo.net import free_port

    return [one_run(rank, world, port if i == 0 else free_port(), cfg, hf_dir, data, shims)
            for i, cfg in enumerate(cfgs)]


def one_run(rank: int, world: int, port: int, cfg, hf_dir: str, data: dict, shims: bool) -> dict:
    """Build the actor, take step-0 log-probs, two optimizer steps on the batch, log-probs again."""
    import time

    if shims:
        _apply_gpu_shims(rank, world, port)
    from mgrpo.training.actor import MegatronActor
    from mgrpo.training.batch import RankBatch

    t0 = time.perf_counter()
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=4, need_ref=True)
    build_s = time.perf_counter() - t0
    ids = [p + r for p, r in zip(data["prompts"], data["responses"])]
    batch = RankBatch(input_ids=ids, prompt_lens=[len(p) for p in data["prompts"]],
                      seq_index=list(range(len(ids))))
    lp0 = actor.compute_logprobs(batch, "actor")
    ref = actor.compute_logprobs(batch, "ref")
    n_tok = sum(len(r) for r in data["responses"])
    train = replace(batch, advantages=[[a] * len(r) for a, r in zip(data["advantages"], data["responses"])],
                    old_logprobs=lp0["logprobs"], ref_logprobs=ref["logprobs"],
                    token_weight=[[1.0 / n_tok] * len(r) for r in data["responses"]], metric_weight=1.0 / n_tok)
    steps = [actor.train_mini_batch(train) for _ in range(2)]
    lp2 = actor.compute_logprobs(batch, "actor")
    out = dict(layer_spec=_layer_spec(actor.gpt), device=str(actor.ctx.device), build_s=round(build_s, 2),
               param_dtype=str(next(actor.gpt.parameters()).dtype).replace("torch.", ""),
               logprob_impl=cfg.actor.logprob_impl, fp8=cfg.actor.fp8,
               lp0=lp0["logprobs"], ent0=lp0["entropy"], lp2=lp2["logprobs"], steps=steps,
               not_on_device_imported=not_on_device_imported())
    actor.shutdown()
    return out


@contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: v for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(cfgs: list, hf_dir, data, *, shims=False, hide_cuda=False, timeout_s=300.0) -> list[dict]:
    """One rank process running `cfgs` in turn; returns one result per config."""
    from mgrpo.training.spawn import spawn_ranks

    with _env(**({"CUDA_VISIBLE_DEVICES": ""} if hide_cuda else {})):
        return spawn_ranks(train_rank, 1, cfgs, hf_dir, data, shims, timeout_s=timeout_s)[0]


# --- comparisons --------------------------------------------------------------------------------------
def flat(xs):
    return torch.tensor([v for x in xs for v in x], dtype=torch.float64)


def compare(rec: dict, got: dict, ref: dict, data: dict, tol: dict) -> None:
    def lp_check(name, a, b):
        d = (flat(a) - flat(b)).abs()
        rec["result"][name] = {"max_abs": d.max().item(), "mean_abs": d.mean().item()}
        check(rec, f"{name}/max_abs", d.max().item(), tol["lp_max"])
        check(rec, f"{name}/mean_abs", d.mean().item(), tol["lp_mean"])

    lp_check("step0_logprobs_rollout_vs_trainer", data["rollout_logprobs"], got["lp0"])
    lp_check("step0_logprobs_device_vs_cpu_fp32", got["lp0"], ref["lp0"])
    rec["result"]["step0_logprobs_rollout_vs_cpu_fp32"] = {
        "max_abs": (flat(data["rollout_logprobs"]) - flat(ref["lp0"])).abs().max().item()}
    rows = {}
    for i, (g, r) in enumerate(zip(got["steps"], ref["steps"]), start=1):
        for k in METRICS:
            if k in g and k in r:
                err = abs(g[k] - r[k])
                rows[f"step{i}/{k}"] = {"device": g[k], "cpu_fp32": r[k], "abs_diff": err}
                rtol = 2.5 * tol["rtol"] if k == "actor/grad_norm" else tol["rtol"]
                check(rec, f"step{i}/{k}", err if math.isfinite(err) else math.inf, tol["atol"] + rtol * abs(r[k]))
    rec["result"]["metrics"] = rows
    du, dr = flat(got["lp2"]) - flat(got["lp0"]), flat(ref["lp2"]) - flat(ref["lp0"])
    cos = (du @ dr / (du.norm() * dr.norm()).clamp_min(1e-30)).item()
    rel = ((du - dr).norm() / dr.norm().clamp_min(1e-30)).item()
    rec["result"]["update"] = {"cosine": cos, "rel_err": rel, "cpu_fp32_mean_abs_change": dr.abs().mean().item()}
    check(rec, "update/cosine", cos, tol["cos"], lower_is_better=False)
    check(rec, "update/rel_err", rel, tol["upd_rel"])


# --- the shared setup: model, rollout and CPU reference, cached for part te ----------------------------
def prepare(gpu: bool, rec: dict, work: Path) -> tuple:
    """The HF checkpoint, the rollout batch and (on GPU) the CPU fp32 reference run, made once per `work`
    folder (run.py gives parts train and te the same fresh one; big files stay out of the results
    folder). The dry run makes its reference in main(), in the same process as the device run."""
    from mgrpo.models import init_hf_checkpoint

    model = model_config(gpu)
    key = hashlib.sha1(json.dumps([asdict(model), gpu, N_PROMPTS, N_SAMPLES, SEED]).encode()).hexdigest()[:10]
    work = work / key
    hf_dir = work / "hf"
    if not (hf_dir / "config.json").exists():
        init_hf_checkpoint(str(hf_dir), model, seed=1)
    data_file, ref_file = work / "batch.json", work / "cpu_fp32.json"
    if data_file.exists():
        data = json.loads(data_file.read_text())
    else:
        device = torch.device("cuda" if gpu else "cpu")
        data = rollout(str(hf_dir), model, device, torch.bfloat16 if gpu else torch.float32, 16 if gpu else 8)
        write_json(data_file, data)
    ref = None
    if ref_file.exists():
        ref = json.loads(ref_file.read_text())
    elif gpu:
        ref = spawn([reference_config(model)], str(hf_dir), data, hide_cuda=True)[0]
        write_json(ref_file, ref)
    rec["result"].update(model=asdict(model), work_dir=str(work), samples=len(data["responses"]),
                         response_tokens=sum(len(r) for r in data["responses"]), rollout_device=data["device"],
                         rollout_dtype=data["dtype"])
    return model, str(hf_dir), data, ref


def _train_needed_shims(out: Path) -> bool:
    try:
        return bool(json.loads((out / "train.json").read_text())["result"].get("shims"))
    except (OSError, ValueError, KeyError):
        return False


def te_capability() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "TE not available: no CUDA device (Transformer Engine needs a GPU)"
    if not importable("transformer_engine"):
        return False, "TE not available: transformer_engine is not importable on this machine"
    try:
        from mgrpo.models.capability import fp8_support
    except ImportError as e:
        return False, f"FP8 capability check not importable: {e}"
    ok, reason = fp8_support("delayed")
    return ok, reason if ok else f"FP8 not available: {reason}"


def main(argv=None):
    from benchmarks.gpu.common import part_args

    ap = part_args(__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["train", "te"], required=True)
    ap.add_argument("--work", default=None,
                    help="scratch folder shared by parts train and te (default: a new temp dir)")
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mgrpo-gpu-check-"))
    out, gpu = Path(args.out), args.mode == "gpu"
    with part(args.part, out) as rec:
        if gpu and not torch.cuda.is_available():
            raise Skip("mode gpu but no CUDA device")
        if not importable("megatron.core"):
            raise Skip("megatron-core is not importable here: carry its wheel (see benchmarks/gpu/README.md)")
        if args.part == "te":
            ok, reason = te_capability()
            if not ok:
                raise Skip(reason)
        model, hf_dir, data, ref = prepare(gpu, rec, work)
        if args.part == "te":
            cfg, kind = run_config(model, dtype="bf16", impl="fused", fp8="hybrid"), "fp8"
        elif gpu:
            cfg, kind = run_config(model, dtype="bf16", impl="fused"), "bf16"
        else:
            from mgrpo_kernels import capabilities

            impl = "fused" if capabilities()["fused"] else "chunked"
            rec["result"]["device_logprob_impl_note"] = (
                "Triton under TRITON_INTERPRET=1" if impl == "fused" else "Triton cannot run here: chunked instead")
            cfg, kind = run_config(model, dtype="fp32", impl=impl), "dry-run"
        rec["result"]["shims"] = []
        if not gpu:  # CPU both: one process, one megatron import
            ref, got = spawn([reference_config(model), cfg], hf_dir, data)
        elif args.part == "te" and _train_needed_shims(out):  # known already: save the failing attempt's time
            got = spawn([cfg], hf_dir, data, shims=True)[0]
            rec["result"]["shims"] = GPU_SHIMS
            rec["result"]["first_attempt_error"] = "not tried: part train needed the shims on this machine"
        else:
            try:
                got = spawn([cfg], hf_dir, data, timeout_s=150.0)[0]
            except Exception as e:  # noqa: BLE001
                rec["result"]["first_attempt_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(f"  device run failed as is ({rec['result']['first_attempt_error'][:300]}); retrying with shims",
                      flush=True)
                got = spawn([cfg], hf_dir, data, shims=True)[0]
                rec["result"]["shims"] = GPU_SHIMS
        rec["result"].update(kind=kind, tolerances=TOL[kind], device_run={k: got[k] for k in (
            "layer_spec", "device", "param_dtype", "logprob_impl", "fp8", "build_s")},
            cpu_fp32_run={k: ref[k] for k in ("layer_spec", "device", "param_dtype", "logprob_impl")},
            rank_not_on_device_imported=sorted(set(got["not_on_device_imported"]) | set(ref["not_on_device_imported"])),
            fwd_bwd_s={"device": [s.get("timing_s/fwd_bwd") for s in got["steps"]],
                       "cpu_fp32": [s.get("timing_s/fwd_bwd") for s in ref["steps"]]})
        compare(rec, got, ref, data, TOL[kind])
        write_json(out / f"{args.part}_batch.json", {k: data[k] for k in ("prompts", "responses", "advantages")})
        rec["files"].append(f"{args.part}_batch.json")
        for k in ("step0_logprobs_rollout_vs_trainer", "step0_logprobs_device_vs_cpu_fp32", "update"):
            print(f"  {k}: {rec['result'][k]}", flush=True)


if __name__ == "__main__":
    main()
