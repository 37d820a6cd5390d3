"""Weight syncs into the real CPU rollout server, many in a row, over both transports:
- colocated: `update_weights_from_tensor` with the bucket in named shared memory, read by the
  server process with SGLang's own unpickler;
- disaggregated: a gloo group between this process (rank 0, the trainer's source rank) and the
  server (rank 1, joined with SGLang's own init_custom_process_group), one broadcast per bucket.
After every sync the server's log-probs are checked against a reference model holding the same
weights, and the version it reports is checked. One server per module."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle

import pytest

from mgrpo.rollout.sglang import DistributedWeightSender, TensorWeightSender
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import perturbed, post, torch_shm_segments

SYNCS = 5


REQS = [GenerateRequest(uid=i, prompt_ids=[1, 3 + i, 5][: 2 + i % 2]) for i in range(4)]


def _check_serves(engine, ref, version: int) -> None:
    assert engine.client.get("/model_info").json()["weight_version"] == str(version)
    for sp in (SamplingParams(temperature=0.0, max_new_tokens=5), SamplingParams(temperature=0.8, max_new_tokens=5,
                                                                                  seed=version)):
        out = engine.generate(REQS, sp)
        assert all(r.weight_version == version for r in out)
        assert max(ref.max_diff(q.prompt_ids, r, sp.temperature) for q, r in zip(REQS, out)) < 1e-5


def _split(named):  # two buckets per sync, as the trainer sends them
    return [named[: len(named) // 2], named[len(named) // 2:]]


@pytest.mark.integration
def test_tensor_transport_many_syncs(engine, ref):
    base, before = ref.state(), torch_shm_segments()
    senders = {"flattened_bucket": TensorWeightSender([engine.url], 1),
               None: TensorWeightSender([engine.url], 1, load_format=None)}
    start = engine.weight_version
    for k in range(1, SYNCS + 1):
        version = start + k
        new = perturbed(base, version)
        sender = senders["flattened_bucket" if k % 2 else None]
        for bucket in _split(new):
            sender.update_weights(bucket)
        engine.finish_weight_update(version)
        ref.load(new)
        _check_serves(engine, ref, version)
    assert sum(s.buckets_sent for s in senders.values()) == 2 * SYNCS
    assert len(torch_shm_segments() - before) <= 1  # the flattening sender's staging buffer, reused by every sync
    del senders, sender
    gc.collect()
    assert torch_shm_segments() <= before  # every shared segment was released by both sides


@pytest.mark.integration
def test_distributed_transport_many_syncs(engine, ref):
    """Syncs 1-3 flattened (one broadcast per bucket), 4-5 one broadcast per tensor through a second
    sender, which supersedes the first: its group is destroyed here and on the engine."""
    base = ref.state()
    flat = DistributedWeightSender([engine.url], [1], master_address="127.0.0.1", timeout_s=60)
    per_tensor = DistributedWeightSender([engine.url], [1], master_address="127.0.0.1", timeout_s=60, load_format=None)
    start = engine.weight_version
    try:
        for k in range(1, SYNCS + 1):
            version = start + k
            sender = flat if k <= 3 else per_tensor
            new = perturbed(base, version)
            for bucket in _split(new):
                sender.update_weights(bucket)
            engine.finish_weight_update(version)
            ref.load(new)
            _check_serves(engine, ref, version)
        assert flat.backend == per_tensor.backend == "gloo"  # no CUDA here: gloo by capability
        assert (flat.buckets_sent, per_tensor.buckets_sent) == (6, 4)
        assert flat.group is None and per_tensor.group_name != flat.group_name
    finally:
        per_tensor.close()
    for name in (flat.group_name, per_tensor.group_name):  # closed on both sides: the server no longer knows them
        r = post(engine.url, "/destroy_weights_update_group", {"group_name": name})
        assert r.status_code == 400 and "no group" in r.text


def _child(payloads, versions, base, q_out, q_in):
    """The trainer's source rank in its own process: senders arrive pickled, as Ray delivers them."""
    try:
        for data, version in zip(payloads, versions):
            sender = pickle.loads(data)
            for bucket in _split(perturbed(base, version)):
                sender.update_weights(bucket)
            q_out.put(("synced", (version, sender.group_name)))
            q_in.get(timeout=60)  # the driver finished the sync on the engine
        q_out.put(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        q_out.put(("error", repr(e)))


@pytest.mark.integration
def test_sender_rebuilt_every_sync_keeps_one_group_until_restart(engine, ref, ckpt, tmp_path):
    """The rollout group ships a sender per sync; the trainer keeps one group. After an
    engine restart (generation bumped) a new group is made and the old one is destroyed."""
    base = ref.state()
    start = engine.weight_version
    versions = [start + k for k in range(1, 5)]

    def sender(generation):
        return pickle.dumps(DistributedWeightSender([engine.url], [1], master_address="127.0.0.1", timeout_s=60,
                                                    generation=generation))

    payloads = [sender(0), sender(0), sender(0), sender(1)]  # a new (identical) object per sync, then a restart
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child, args=(payloads, versions, base, q_out, q_in))
    proc.start()
    groups = []
    try:
        while True:
            status, detail = q_out.get(timeout=90)
            if status != "synced":
                break
            version, group = detail
            groups.append(group)
            engine.finish_weight_update(version)
            ref.load(perturbed(base, version))
            _check_serves(engine, ref, version)
            q_in.put("next")
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", detail
    assert groups[0] == groups[1] == groups[2] != groups[3]  # one group for three syncs, a new one after
    r = post(engine.url, "/destroy_weights_update_group", {"group_name": groups[0]})
    assert r.status_code == 400 and "no group" in r.text  # the superseded group was destroyed on the engine


@pytest.mark.integration
def test_session_rules_are_sglangs(engine):
    r = post(engine.url, "/update_weights_from_tensor", {"serialized_named_tensors": [""], "flush_cache": False})
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    assert post(engine.url, "/begin_weight_update", {"selector": "all"}).status_code == 200
    r = post(engine.url, "/begin_weight_update", {"selector": "all"})
    assert r.status_code == 400 and "already open" in r.json()["message"]
    assert post(engine.url, "/end_weight_update", {}).status_code == 200
    with pytest.raises(RuntimeError, match="no bucket reached"):
        engine.finish_weight_update(99)


@pytest.mark.integration
def test_incomplete_sync_is_an_error_and_closes_the_session(engine, ref):
    named = sorted(ref.state().items())
    engine.update_weights(named[:-2])
    with pytest.raises(RuntimeError, match=r"incomplete: 2 tensors never arrived"):
        engine.finish_weight_update(engine.weight_version + 1)
    assert post(engine.url, "/begin_weight_update", {"selector": "all"}).status_code == 200  # it was closed
    assert post(engine.url, "/end_weight_update", {}).status_code == 200


@pytest.mark.integration
def test_two_pipeline_stages_share_one_session(engine, ref):
    """Each stage's source rank sends its own layers; the second finds the session already open."""
    named = sorted(ref.state().items())
    version = engine.weight_version + 1
    stage0, stage1 = TensorWeightSender([engine.url], 1), TensorWeightSender([engine.url], 1)
    stage0.update_weights(named[: len(named) // 2])
    stage1.update_weights(named[len(named) // 2:])
    engine.finish_weight_update(version)
    _check_serves(engine, ref, version)


@pytest.mark.integration
def test_one_payload_per_tp_rank_is_checked(engine, ref):
    from mgrpo.rollout.sglang import SGLangRequestError

    sender = TensorWeightSender([engine.url], 2)  # as if the engine had 2 TP ranks
    with pytest.raises(SGLangRequestError, match="2 entries for --tp-size 1"):
        sender.update_weights(sorted(ref.state().items())[:1])
    assert post(engine.url, "/end_weight_update", {}).status_code == 200
