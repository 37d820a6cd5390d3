"""rollout.mode=hybrid: the engine lives inside a Megatron rank's process (veRL's hybrid engine) and takes
the weights that rank exports in memory; the other ranks' buckets reach it through the rank's engine
calls. It must train exactly as an engine in a process of its own does."""

from __future__ import annotations

import pytest

from mgrpo.loop import Trainer
from tests.helpers.runs import read_metrics, small_config

STEPS = 3
COMPARED = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/rewards/mean",
            "response_length/mean", "rollout/logprob_abs_diff")


class Recording(Trainer):
    def _start(self, prepared):
        super()._start(prepared)
        self.hosts = [e._actor_id.hex() for e in self.parts.experiences.rollout.engines]
        self.ranks = [r._actor_id.hex() for r in self.parts.actor.group.ranks]
        self.shared = [i.get("engine_shared_bytes") for i in self.parts.actor.group.info]


def _run(run_dir: str, mode: str, **actor) -> tuple[Recording, list[dict]]:
    cfg = small_config(run_dir, rollout={"engine": "hf", "mode": mode}, actor=actor,
                       trainer={"total_training_steps": STEPS})
    t = Recording(cfg)
    t.fit()
    return t, read_metrics(run_dir)


@pytest.mark.system
def test_hybrid_engine_trains_exactly_like_an_engine_of_its_own(tmp_path):
    own, m_own = _run(str(tmp_path / "colocated"), "colocated")
    hyb, m_hyb = _run(str(tmp_path / "hybrid"), "hybrid")
    assert not set(own.hosts) & set(own.ranks)  # colocated: an engine process of its own
    assert hyb.hosts == hyb.ranks[:1]  # hybrid: the engine's host is Megatron rank 0
    # hybrid: the engine uses the rank's parameters that export as they are (embedding, norms) in place of copies
    assert own.shared == [None] and hyb.shared[0] > 0
    assert [x["step"] for x in m_hyb] == list(range(1, STEPS + 1))
    for a, b in zip(m_own, m_hyb):  # same seeds, same engine code: the same samples and updates
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["step"], key)
    for x in m_hyb:  # after every in-memory sync the engine samples from exactly the trainer's weights
        assert x["rollout/logprob_abs_diff"] <= 1e-5, x["step"]
        assert x["perf/update_weights_bytes"] > 0


@pytest.mark.system
def test_hybrid_engine_takes_every_pipeline_stage(tmp_path):
    """actor.pp=2: rank 0 hands its stage to its own engine in memory while rank 1's stage arrives through
    rank 0's engine calls (their own concurrency group: rank 0 is busy streaming meanwhile). A missing
    tensor fails the sync; a stale one shows as a rollout-vs-trainer log-prob gap."""
    t, m = _run(str(tmp_path), "hybrid", pp=2)
    assert t.hosts == t.ranks[:1]
    assert [x["rollout/weight_version"] for x in m] == [float(s) for s in range(1, STEPS + 1)]
    for x in m:
        assert x["rollout/logprob_abs_diff"] <= 1e-5, x["step"]


class Ordered(Trainer):
    """Records, in order, when the driver asks the Megatron ranks for log-probs, starts judging and
    collects the log-probs, and what the reference forward returned."""

    def _start(self, prepared):
        super()._start(prepared)
        self.events: list[tuple[str, str]] = []
        self.kept: list[tuple[str, bool]] = []
        group, judger = self.parts.actor.group, self.parts.experiences.rubric
        send, score = group.compute_logprobs, judger.score

        def compute_logprobs(shards, which, keep=False):
            self.events.append(("started", which))
            self.kept.append((which, keep))
            wait = send(shards, which, keep=keep)
            return lambda: (self.events.append(("collected", which)), wait())[1]

        def judged(requests):
            self.events.append(("judging", ""))
            return score(requests)

        group.compute_logprobs, judger.score = compute_logprobs, judged


@pytest.mark.system
@pytest.mark.parametrize("recompute", [False, True], ids=["one-update", "old-forward"])
def test_log_prob_forwards_run_while_the_driver_judges(tmp_path, recompute):
    """Generation done, the step's log-prob forwards (reference; old policy when the update needs it) are
    sent to the ranks before judging starts and collected after it: the ranks compute while the driver
    scores. Each forward runs once per step, and the run still matches the engine's log-probs. With one
    update per rollout the reference log-probs stay on the ranks (kept for the update, never sent back)."""
    cfg = small_config(str(tmp_path), rollout={"engine": "hf", "mode": "hybrid"},
                       algorithm={"use_kl_loss": True}, actor={"recompute_old_logprob": recompute},
                       trainer={"total_training_steps": 2})
    t = Ordered(cfg)
    t.fit()
    forwards = ["actor", "ref"] if recompute else ["ref"]
    step = ([("started", w) for w in forwards] + [("judging", "")] + [("collected", w) for w in forwards])
    assert t.events == step * 2
    assert t.kept == [(w, w == "ref" and not recompute) for w in forwards] * 2
    m = read_metrics(str(tmp_path))
    for x in m:
        assert x["rollout/logprob_abs_diff"] <= 1e-5
    # the reference the update read (kept on the ranks, or sent back) is the frozen initial policy: zero KL
    # at step 1, where the actor still equals it, and a positive KL once the first update moved the actor
    assert abs(m[0]["actor/kl_loss"]) < 1e-7 < m[1]["actor/kl_loss"]
