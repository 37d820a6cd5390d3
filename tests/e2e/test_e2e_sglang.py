"""The production rollout path end to end on CPU: `rollout.engine=sglang` launches the server speaking
SGLang's HTTP protocol exactly as it launches SGLang, the same client generates through it, and weights
reach it through the same transports (shared-memory tensors for colocated engines, a gloo process group
for disaggregated ones). Only the GPU leaf (SGLang's CUDA server) is swapped."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from mgrpo.cluster.rollout_group import NodeLocalDelivery
from mgrpo.loop import Trainer
from mgrpo.rollout.sglang.weights_distributed import DistributedWeightSender
from tests.helpers.procs import pids_where
from tests.helpers.runs import read_metrics, small_config

STEPS = 5


class Recording(Trainer):
    """Keeps what the driver built for weight sync while Ray is up."""

    def _start(self, prepared):
        super()._start(prepared)
        self.receivers = self.parts.experiences.rollout.receivers()


@pytest.mark.system
@pytest.mark.parametrize("mode, tp", [("colocated", 1), ("disaggregated", 1), ("colocated", 2),
                                      ("disaggregated", 2), ("hybrid", 1)])
def test_sglang_path_syncs_exactly_every_step(tmp_path, mode, tp, caplog):
    """>= 5 consecutive weight syncs in one run; after every sync the engine samples from exactly the
    trainer's weights: rollout and trainer log-probs of the same tokens agree at every step. Every server
    requires the run's key (the hybrid run turns it off, and says so), and no request was refused."""
    keyless = mode == "hybrid"
    rollout = {"engine": "sglang", "mode": mode, **({"api_key": "none"} if keyless else {})}
    cfg = small_config(str(tmp_path), rollout=rollout,
                       actor={"tp": tp}, trainer={"total_training_steps": STEPS,
                                                  "n_gpus_per_node": tp + (1 if mode == "disaggregated" else 0)})
    t = Recording(cfg)
    t.fit()
    logs = [open(os.path.join(tmp_path, "logs", "sglang", f)).read()
            for f in os.listdir(os.path.join(tmp_path, "logs", "sglang"))]
    assert logs and all(("API key: NONE" if keyless else "API key: required") in text for text in logs)
    assert ("rollout.api_key=none: the rollout servers and the router accept requests without a key"
            in caplog.text) == keyless
    (receiver,) = t.receivers
    assert isinstance(receiver, NodeLocalDelivery if mode in ("colocated", "hybrid") else DistributedWeightSender)
    m = read_metrics(str(tmp_path))
    assert [x["step"] for x in m] == list(range(1, STEPS + 1))
    assert [x["rollout/weight_version"] for x in m] == [float(s) for s in range(1, STEPS + 1)]
    for x in m:
        assert x["rollout/logprob_abs_diff"] <= 1e-5, (x["step"], x["rollout/logprob_abs_diff"])
        assert x["perf/update_weights_bytes"] > 0 and x["perf/update_weights_s"] > 0
        assert x["rollout/auth_refused"] == 0
    assert m[0]["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    with open(os.path.join(str(tmp_path), "trajectories.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # every sample records the weight version that produced it: step s was sampled by version s-1
    assert {(r["step"], r["weight_version"]) for r in rows} == {(s, s - 1) for s in range(1, STEPS + 1)}


def _server_pids(model_dir: str) -> list[int]:
    """The CPU servers serving `model_dir` (each run's initial weights have their own folder)."""
    return pids_where(f"mgrpo.rollout.sglang.cpu.server\0--model-path\0{model_dir}\0")


def _fault_during_run(run_dir: str, sig: int, at_step: int, hits: list, limit: int = 1) -> threading.Thread:
    """From a thread: once `at_step` is logged, send `sig` to (at most `limit` of) the engines' servers while
    the next rollout is in flight (a server is found by its command line)."""
    model_dir = os.path.join(run_dir, "init_hf")

    def go():
        path = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.time() + 600
        while time.time() < deadline:
            if os.path.isfile(path) and sum(1 for _ in open(path)) >= at_step:
                break
            time.sleep(0.01)
        for pid in _server_pids(model_dir)[:limit]:
            os.kill(pid, sig)
            hits.append(pid)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


@pytest.mark.system
@pytest.mark.parametrize("sig, mode", [(signal.SIGKILL, "colocated"), (signal.SIGSTOP, "colocated"),
                                       (signal.SIGKILL, "hybrid")], ids=["killed", "hung", "killed-hybrid"])
def test_engine_fault_mid_run_is_recovered(tmp_path, sig, mode):
    """A server killed (SIGKILL) or hung (SIGSTOP) during the run is found by the health checks, restarted,
    re-synced to the current weights, and its requests resent: the run finishes, every prompt has its n
    samples exactly once per step, and the restart and retry counters say what happened. A hybrid engine
    (its client inside a Megatron rank) is restarted inside that rank, which lives on."""
    run_dir = str(tmp_path)
    cfg = small_config(run_dir, rollout={"engine": "sglang", "mode": mode, "health_check_interval_s": 1.0,
                                         "health_check_timeout_s": 2.0, "request_timeout_s": 30.0},
                       trainer={"total_training_steps": 4})
    hits: list = []
    th = _fault_during_run(run_dir, sig, at_step=2, hits=hits)
    Trainer(cfg).fit()
    th.join(timeout=5)
    assert hits, "the fault was never injected"
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert m[-1]["rollout/restarts_total"] >= 1
    assert m[-1]["rollout/retries_total"] + m[-1]["rollout/restarts_total"] >= 1
    with open(os.path.join(run_dir, "trajectories.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for step in range(1, 5):
        groups = [r["group"] for r in rows if r["step"] == step]
        assert sorted(groups) == sorted(g for g in range(8) for _ in range(4)), step  # 8 prompts x n=4, once each
    # after the restart the engine was re-synced: its samples match the trainer again
    assert all(x["rollout/logprob_abs_diff"] <= 1e-5 for x in m)
    deadline = time.time() + 30  # the faulty server is gone (a stopped one is killed by the restart's watchdog)
    while time.time() < deadline and any(_running(pid) for pid in hits):
        time.sleep(0.5)
    assert not any(_running(pid) for pid in hits)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.system
def test_two_engines_behind_the_router_survive_a_killed_engine(tmp_path):
    """rollout.num_engines=2: SGLang's router (the real sglang-router) fronts both engines and every
    generation request goes through it; one engine killed mid-run is restarted and re-registered."""
    pytest.importorskip("sglang_router")
    run_dir = str(tmp_path)
    cfg = small_config(run_dir, rollout={"engine": "sglang", "num_engines": 2, "health_check_interval_s": 1.0,
                                         "health_check_timeout_s": 2.0, "request_timeout_s": 30.0},
                       trainer={"total_training_steps": 4, "n_gpus_per_node": 2})

    class Routed(Trainer):
        def _start(self, prepared):
            super()._start(prepared)
            rollout = self.parts.experiences.rollout
            self.router_workers_at_start = set(rollout.front.router.workers())
            # the run's key guards both engines and the router: a request without it is refused and counted
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            self.probes = [requests.post(u + "/generate", json=body, timeout=30).status_code
                           for u in [*rollout.urls, rollout.front.router.url]]

        def _close(self):
            if self.parts is not None and self.parts.experiences.rollout.front is not None:
                self.router_workers_at_end = set(self.parts.experiences.rollout.front.router.workers())
                self.urls_at_end = list(self.parts.experiences.rollout.urls)
            super()._close()

    hits: list = []
    th = _fault_during_run(run_dir, signal.SIGKILL, at_step=2, hits=hits)
    t = Routed(cfg)
    t.fit()
    th.join(timeout=5)
    assert len(t.router_workers_at_start) == 2
    assert t.router_workers_at_end == set(t.urls_at_end)  # the restarted engine's new URL replaced the old one
    assert len(hits) == 1 and len(t.router_workers_at_start & t.router_workers_at_end) == 1  # one replaced
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert m[-1]["rollout/restarts_total"] >= 1
    assert all(x["rollout/logprob_abs_diff"] <= 1e-5 for x in m)
    assert t.probes == [401, 401, 401] and all(u.startswith("http://127.0.0.1:") for u in t.urls_at_end)
    # counted once; reported at step 2 (a step reports what was refused up to the previous generation)
    assert [x["rollout/auth_refused"] for x in m[:2]] == [0, 3] and sum(x["rollout/auth_refused"] for x in m) == 3
