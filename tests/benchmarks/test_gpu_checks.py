"""The GPU check command (`python -m benchmarks.gpu.run`) end to end in its dry run on this CPU machine:
every part runs in its tiny CPU form and writes the files a GPU run writes, with real numbers in them.

One subprocess runs the whole command (as a user would, with CUDA hidden so the dry run is what runs
on any machine); the tests below read its files. What they pin: the kernels agree with the reference
twin within the kernel's fp32 contract, the benchmark has a row for every implementation with equal
losses, the megatron step on the "device" (Triton under the interpreter) reproduces the fp32 CPU
reference and the rollout's log-probs, and part te says plainly why it could not run.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT


if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
HAVE_TRITON = importlib.util.find_spec("triton") is not None
HAVE_LIGER = importlib.util.find_spec("liger_kernel") is not None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry-run")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return out, proc.stdout, seconds


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def part(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.integration
def test_says_it_is_a_dry_run_and_summarises(dry_run):
    out, stdout, _ = dry_run
    assert "no CUDA device found" in stdout and "DRY RUN" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry-run" and summary["machine"]["cuda"] is False
    assert {k: v["status"] for k, v in summary["parts"].items()} == {
        "kernels": "ok", "bench": "ok", "train": "ok", "te": "skipped"}
    for name in ("kernels", "bench", "train", "te"):
        rec = part(out, name)
        assert rec["machine"]["torch"] and "triton" in rec["machine"] and rec["machine"]["mode"] == "dry-run"
        # The device machine has no Hydra, Ray, ...: no process of the checks may import them.
        assert rec["not_on_device_imported"] == [], (name, rec["not_on_device_imported"])
        assert (out / "logs" / f"{name}.log").stat().st_size > 0


@pytest.mark.integration
def test_kernel_correctness_rows(dry_run):
    out, _, _ = dry_run
    rows = read_csv(out / "kernel_correctness.csv")
    have = {(r["case"], r["dtype"], r["impl"], r["api"]) for r in rows}
    fused = ["fused"] if HAVE_TRITON else []
    for case in ("tiny", "tiny-ragged"):
        for impl in ["chunked", *fused]:
            for api in ("logprobs", "loss"):
                assert (case, "fp32", impl, api) in have
        assert (case, "bf16", "chunked", "loss") in have
    for r in rows:
        if r["impl"] == "naive":
            continue
        assert r["ok"] == "True", r
        if r["dtype"] == "fp32":  # the kernel's fp32 contract (tests/kernels/test_kernels.py)
            assert float(r["lp_err"]) < 1e-5 and float(r["ent_err"]) < 1e-4, r
            assert float(r["gh_rel"]) < 1e-4 and float(r["gw_rel"]) < 1e-4, r
        else:  # bf16 logits tiles: visibly less exact, still within the bf16 tolerance
            assert 1e-4 < float(r["lp_err"]) < 5e-2, r
    if fused and "fused/bf16" in part(out, "kernels")["result"]["skipped"]:
        assert "interpreter" in part(out, "kernels")["result"]["skipped"]["fused/bf16"]


@pytest.mark.integration
def test_kernel_bench_rows(dry_run):
    out, _, _ = dry_run
    rows = read_csv(out / "kernel_bench.csv")
    impls = {"naive", "chunked", "gemm"} | ({"fused"} if HAVE_TRITON else set()) | (
        {"liger_eager"} if HAVE_LIGER else set())
    for T, purpose in (("32", "timing"), ("64", "timing"), ("128", "memory_only")):
        at = {r["impl"]: r for r in rows if r["T"] == T}
        assert impls <= set(at), (T, set(at))
        assert all(r["purpose"] == purpose and r["median_s"] != "" and r["peak_extra_mib"] != "" for r in at.values())
        base = float(at["naive"]["loss"])
        for impl in impls - {"naive", "gemm"}:  # the same loss on the same inputs
            assert float(at[impl]["loss"]) == pytest.approx(base, rel=1e-4, abs=1e-5), impl
        assert at["gemm"]["loss"] == ""
    res = part(out, "bench")["result"]
    assert {"chunked/gemm"} | ({"fused/gemm"} if HAVE_TRITON else set()) <= set(res["time_ratios_at_ratio_T"])
    assert all(v > 0 for v in res["time_ratios_at_ratio_T"].values())


@pytest.mark.integration
def test_training_step_matches_cpu_reference(dry_run):
    out, _, _ = dry_run
    res = part(out, "train")["result"]
    assert res["device_run"]["logprob_impl"] == ("fused" if HAVE_TRITON else "chunked")
    assert res["cpu_fp32_run"]["logprob_impl"] == "chunked"
    assert res["shims"] == [] and res["samples"] == 16 and res["response_tokens"] >= 16
    assert res["rank_not_on_device_imported"] == []  # the megatron rank processes too
    assert res["step0_logprobs_rollout_vs_trainer"]["max_abs"] < 1e-4
    assert res["step0_logprobs_device_vs_cpu_fp32"]["max_abs"] < 1e-4
    m = res["metrics"]
    assert m["step1/actor/grad_norm"]["cpu_fp32"] > 1e-3  # a real gradient to compare
    assert abs(m["step2/actor/ppo_kl"]["cpu_fp32"]) > 1e-4  # the first update moved the policy
    for k, v in m.items():
        assert v["abs_diff"] <= 1e-5 + 1e-5 * abs(v["cpu_fp32"]), k
    assert res["update"]["cosine"] > 0.9999 and res["update"]["cpu_fp32_mean_abs_change"] > 1e-3
    batch = json.loads((out / "train_batch.json").read_text())
    assert len(batch["responses"]) == 16


@pytest.mark.integration
def test_te_part_says_why_it_did_not_run(dry_run):
    out, _, _ = dry_run
    rec = part(out, "te")
    assert rec["status"] == "skipped" and rec["reason"].startswith("TE not available")

