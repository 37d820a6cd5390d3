"""Part 1: the log-prob kernels against the reference twin, in bf16 and fp32.

For each case, dtype and implementation (fused = Triton, chunked = torch, naive = full logits) two
calls are compared with the oracle, `mgrpo_kernels.reference` evaluated in fp32 on the *same* input
values (bf16 inputs are upcast, so the oracle is the exact answer for those inputs and the errors are
the implementation's own precision, not the rounding of its inputs):
  logprobs  linear_logprobs, then a backward through a mix of log-prob and entropy
  loss      fused_linear_loss with the GRPO token loss (PPO clip, dual-clip, k3 KL, entropy bonus)
Measured: max |logprob error|, max |entropy error|, |loss error|, max |metric error| (clip fractions
apart: they count tokens, so one token crossing a clip boundary moves them by 1/T; reported, unchecked),
and the norm-wise relative error of dHidden and dWeight. Rows go to kernel_correctness.csv; the naive
rows are unchecked (in bf16 they show what full bf16 logits cost).

GPU: Qwen3-8B's output layer (H=4096, V=151,936 rows of which 151,669 real) and a ragged case whose
sizes are not multiples of any tile. Dry run (CPU): tiny shapes; Triton only under TRITON_INTERPRET=1
and only in fp32 when the interpreter gets bf16 dot products wrong (it does in triton 3.9.0).
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.gpu.common import Skip, bootstrap, check, part, part_args, write_csv

bootstrap()

import torch  # noqa: E402

import mgrpo_kernels as K  # noqa: E402
from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn  # noqa: E402
from mgrpo.config import AlgorithmConfig  # noqa: E402

# Tolerances by input dtype. fp32: the kernel's contract (tests/kernels/test_kernels.py), loosened 10x for
# H=4096 sums. bf16: GEMM inputs are bf16 but statistics fp32; the chunked path also rounds each logit
# tile to bf16 (|z| ~ 2 -> ~8e-3) and both round dLogits to bf16 before the gradient GEMMs (2^-8).
TOL = {
    "fp32": dict(lp=1e-4, ent=1e-3, loss=1e-5, metrics=1e-4, grad=1e-4),
    "bf16": dict(lp=5e-2, ent=5e-2, loss=5e-3, metrics=5e-3, grad=3e-2),
}
GPU_CASES = [
    # name, T, H, V (rows of the weight), vocab_size (real rows), temperature
    ("qwen3-8b-head", 1000, 4096, 151936, 151669, 1.0),
    ("ragged", 333, 1000, 32003, 32000, 0.7),
]
DRY_CASES = [("tiny", 50, 32, 96, 83, 1.0), ("tiny-ragged", 37, 24, 61, 61, 0.7)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_problem(T, H, V, vocab_size, device, seed=0):
    """Inputs with logits of std ~2, padding rows that would swamp the softmax if they leaked in,
    masked positions with an ignore label, and old/ref log-probs that engage every clip branch."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (2.0 / math.sqrt(H))
    weight[vocab_size:] = 5.0 / math.sqrt(H) * 8
    labels = torch.randint(0, vocab_size, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.2
    mask[:4] = True
    labels[~mask] = -100
    adv = torch.randn(T, generator=g)
    noise_old, noise_ref = 0.6 * torch.randn(T, generator=g), 0.6 * torch.randn(T, generator=g)
    to = dict(device=device)
    return dict(hidden=hidden.to(**to), weight=weight.to(**to), labels=labels.to(**to), adv=adv.to(**to),
                noise_old=noise_old.to(**to), noise_ref=noise_ref.to(**to), mask=mask.to(**to))


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_logprobs(hidden, weight, labels, impl, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = K.linear_logprobs(h, w, labels, impl=impl, **kw)
    c = torch.linspace(-1.0, 1.0, lp.shape[0], device=lp.device)
    (c * lp + 0.5 * c.flip(0) * ent).sum().backward()
    return dict(lp=lp.detach().float(), ent=ent.detach().float(), gh=h.grad.float(), gw=w.grad.float())


def run_loss(hidden, weight, labels, impl, fn, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics, lp, ent = K.fused_linear_loss(h, w, labels, fn, impl=impl, **kw)
    (2.0 * loss).backward()  # a grad_output other than 1 exercises the scaling of the stored grads
    return dict(loss=loss.detach().float(), metrics={k: v.float() for k, v in metrics.items()},
                lp=lp.float(), ent=ent.float(), gh=h.grad.float(), gw=w.grad.float())


def errors(got, want) -> dict:
    e = {"lp_err": (got["lp"] - want["lp"]).abs().max().item(),
         "ent_err": (got["ent"] - want["ent"]).abs().max().item(),
         "gh_rel": rel_err(got["gh"], want["gh"]), "gw_rel": rel_err(got["gw"], want["gw"])}
    if "loss" in want:
        e["loss_err"] = abs(got["loss"].item() - want["loss"].item())
        if set(got["metrics"]) != set(want["metrics"]):
            e["metrics_err"] = math.inf
        else:  # clip fractions count tokens: one token crossing a clip boundary moves them by 1/T
            diff = {k: abs(got["metrics"][k].item() - v.item()) for k, v in want["metrics"].items()}
            e["metrics_err"] = max(v for k, v in diff.items() if "clipfrac" not in k)
            e["clipfrac_err"] = max((v for k, v in diff.items() if "clipfrac" in k), default=0.0)
    return e


def interpreter_bf16_dot_ok() -> bool:
    """Does this Triton's interpreter multiply bf16 tiles correctly? (triton 3.9.0's does not.)"""
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(X, W, Z, N: tl.constexpr):
        o = tl.arange(0, N)
        x = tl.load(X + o[:, None] * N + o[None, :])
        w = tl.load(W + o[:, None] * N + o[None, :])
        tl.store(Z + o[:, None] * N + o[None, :], tl.dot(x, w))

    x, w = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    z = torch.empty(16, 16)
    _dot[(1,)](x, w, z, N=16)
    return bool(torch.allclose(z, x.float() @ w.float(), atol=1e-3, rtol=1e-3))


def main(argv=None):
    args = part_args(__doc__.split("\n\n")[0]).parse_args(argv)
    out = Path(args.out)
    with part("kernels", out) as rec:
        gpu = args.mode == "gpu"
        device = torch.device("cuda" if gpu else "cpu")
        if gpu and not torch.cuda.is_available():
            raise Skip("mode gpu but no CUDA device")
        caps = K.capabilities()
        rec["result"]["capabilities"] = caps
        impls = ["naive", "chunked"] + (["fused"] if caps["fused"] else [])
        skipped = {} if caps["fused"] else {"fused": "Triton cannot run here: " + (
            "triton not importable" if caps["triton"] is None else "no CUDA and TRITON_INTERPRET is not 1")}
        bf16_fused = gpu or (caps["fused"] and interpreter_bf16_dot_ok())
        if caps["fused"] and not bf16_fused:
            skipped["fused/bf16"] = (f"the Triton {caps['triton']} interpreter computes bf16 dot products wrongly, "
                                     "so fused bf16 is checked on a GPU only")
        rec["result"]["skipped"] = skipped
        rows = []
        device_name = torch.cuda.get_device_name(0) if gpu else "cpu"
        for name, T, H, V, vocab_size, temp in (GPU_CASES if gpu else DRY_CASES):
            p = make_problem(T, H, V, vocab_size, device)
            for dname, dtype in DTYPES.items():
                hidden, weight = p["hidden"].to(dtype), p["weight"].to(dtype)
                h32, w32 = hidden.float(), weight.float()  # the oracle sees exactly the same values
                kw = dict(temperature=temp, vocab_size=vocab_size)
                want_lp = run_logprobs(h32, w32, p["labels"], "naive", **kw)
                lp0 = want_lp["lp"]
                weights = p["mask"].float() / p["mask"].sum()
                old = (lp0 + p["noise_old"]).clone()
                old[:4] = lp0[:4] - 2.0  # ratio e^2 > clip_ratio_c with A < 0: dual-clip territory
                adv = p["adv"].clone()
                adv[:4] = -1.0
                fn = make_token_loss_fn(  # the production loss
                    TokenLossInputs(old_logprob=old, advantages=adv, token_weight=weights, metric_weight=weights,
                                    ref_logprob=lp0 + p["noise_ref"]),
                    AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=True,
                                    kl_loss_type="k3", kl_coef=0.1, entropy_coeff=0.01))
                want_loss = run_loss(h32, w32, p["labels"], "naive", fn, **kw)
                del h32, w32
                for impl in impls:
                    if impl == "fused" and dname == "bf16" and not bf16_fused:
                        continue
                    for api, run, want in (("logprobs", run_logprobs, want_lp), ("loss", run_loss, want_loss)):
                        extra = (fn,) if api == "loss" else ()
                        got = run(hidden, weight, p["labels"], impl, *extra, **kw)
                        e = errors(got, want)
                        tol = TOL[dname]
                        row = dict(case=name, T=T, H=H, V=V, vocab_size=vocab_size, temperature=temp, dtype=dname,
                                   impl=impl, api=api, device=device_name,
                                   **{k: float(f"{v:.3e}") for k, v in e.items()})
                        limits = {"lp_err": tol["lp"], "ent_err": tol["ent"], "gh_rel": tol["grad"],
                                  "gw_rel": tol["grad"], "loss_err": tol["loss"], "metrics_err": tol["metrics"]}
                        # naive is the textbook path, not ours: its bf16 row shows what full bf16 logits
                        # cost in accuracy, unchecked.
                        row["ok"] = None if impl == "naive" else all(
                            check(rec, f"{name}/{dname}/{impl}/{api}/{k}", v, limits[k])
                            for k, v in e.items() if k in limits)
                        rows.append(row)
                        print(f"  {name:14s} {dname} {impl:8s} {api:8s} "
                              + " ".join(f"{k}={v:.2e}" for k, v in e.items())
                              + ("  OUT OF TOL" if row["ok"] is False else ""),
                              flush=True)
                        del got
                if gpu:
                    torch.cuda.empty_cache()
        write_csv(out / "kernel_correctness.csv", rows)
        rec["files"].append("kernel_correctness.csv")
        rec["result"].update(tolerances=TOL, rows=len(rows),
                             max_errors={f"{d}/{i}": {k: max(r[k] for r in rows if r["dtype"] == d and r["impl"] == i
                                                             and k in r)
                                                      for k in ("lp_err", "ent_err", "gh_rel", "gw_rel")}
                                         for d in DTYPES for i in impls
                                         if any(r["dtype"] == d and r["impl"] == i for r in rows)})


if __name__ == "__main__":
    main()
