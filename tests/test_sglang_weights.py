"""Trainer-side weight senders and the payloads SGLang deserialises.

The stand-in server and the pieces of SGLang's own code come from test_sglang_engine.py (see its
docstring for the SGLang files each shape was read from)."""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
import base64

import pytest
import torch

from mgrpo.rollout.sglang.buckets import dtype_name, flatten_bucket
from mgrpo.rollout.sglang.http import SGLangUnavailableError
from mgrpo.rollout.sglang.server import free_port
from mgrpo.rollout.sglang.weights_distributed import DistributedWeightSender
from mgrpo.rollout.sglang.weights_tensor import PAYLOAD_GLOBALS, IPCWeightSender, tensor_payloads
from tests.test_sglang_engine import FakeSGLang, deserialize_payload, sglang_common


def _bucket(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.norm.weight", torch.randn(7, generator=g).bfloat16()),  # odd byte count before wider types
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 3, generator=g).half()),
        ("model.layers.0.step", torch.tensor([3], dtype=torch.int64)),
    ]


class _Recorder(pickle.Unpickler):
    def __init__(self, data):
        super().__init__(io.BytesIO(data))
        self.seen = set()

    def find_class(self, module, name):
        self.seen.add((module, name))
        return super().find_class(module, name)


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_payload_uses_only_globals_sglang_allows(load_format):
    payloads, keep = tensor_payloads(_bucket(), 1, load_format)
    rec = _Recorder(base64.b64decode(payloads[0]))
    rec.load()
    assert rec.seen and rec.seen <= PAYLOAD_GLOBALS, rec.seen - PAYLOAD_GLOBALS
    common = sglang_common()
    if common is not None:
        allowed = common.SafeUnpickler.ALLOWED_GLOBALS
        assert PAYLOAD_GLOBALS <= allowed, PAYLOAD_GLOBALS - allowed


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_sglang_deserialiser_gets_the_same_tensors_back(load_format):
    bucket = _bucket(1)
    payloads, keep = tensor_payloads(bucket, 3, load_format)
    assert len(payloads) == 3 and len(set(payloads)) >= 1
    for p in payloads:  # one independent serialisation per engine TP rank
        data = deserialize_payload(p)
        if load_format == "flattened_bucket":
            flat = data["flattened_tensor"]
            assert flat.dtype == torch.uint8
            named = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in data["metadata"]}
            assert all(m.numel == m.end_idx - m.start_idx for m in data["metadata"])
        else:
            named = dict(data)
        assert set(named) == {n for n, _ in bucket}
        for n, t in bucket:
            assert named[n].dtype == t.dtype and named[n].shape == t.shape and torch.equal(named[n], t), n


def test_sglang_safe_unpickler_blocks_what_it_should():
    common = sglang_common()
    if common is None:
        pytest.skip("sglang wheel not installed: its SafeUnpickler cannot be read")
    evil = base64.b64encode(pickle.dumps(pickle.loads)).decode()  # a global outside the allow-list
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        common.MultiprocessingSerializer.deserialize(evil)


def test_flatten_aligns_every_tensor_to_its_element_size():
    flat, meta = flatten_bucket(_bucket())
    assert flat.numel() == sum(t.numel() * t.element_size() for _, t in _bucket())
    for m in meta:
        assert m.start_idx % m.dtype.itemsize == 0, (m.name, m.start_idx)
    assert [m.dtype.itemsize for m in meta] == sorted((m.dtype.itemsize for m in meta), reverse=True)
    with pytest.raises(ValueError, match="empty bucket"):
        flatten_bucket([])


def test_dtype_names_resolve_in_torch():
    for dt in (torch.bfloat16, torch.float32, torch.float16, torch.int64):
        assert getattr(torch, dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"


def test_ipc_sender_posts_tensor_updates_with_sglang_fields():
    with FakeSGLang(tp=2) as a, FakeSGLang(tp=1) as b:
        sender = IPCWeightSender([a.url, b.url], [2, 1])
        sender.update_weights(_bucket(2)[:2])
        sender.update_weights(_bucket(2)[2:])
        for fake, tp in ((a, 2), (b, 1)):
            assert [p for p, _ in fake.calls] == ["/begin_weight_update", "/update_weights_from_tensor"] * 2
            body = fake.bodies("/update_weights_from_tensor")[0]
            assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests"}
            assert len(body["serialized_named_tensors"]) == tp and body["flush_cache"] is False
            for n, t in _bucket(2):
                assert torch.equal(fake.weights[n], t), n
            assert fake.session_open and not fake.errors
        assert sender.bytes_sent == sum(t.numel() * t.element_size() for _, t in _bucket(2))


def test_ipc_sender_tolerates_a_session_another_sender_opened():
    with FakeSGLang() as fake:
        s1, s2 = IPCWeightSender([fake.url]), IPCWeightSender([fake.url])
        s1.update_weights(_bucket()[:1])
        s2.update_weights(_bucket()[1:2])  # pipeline stage 2: begin answers "already open"
        assert len(fake.weights) == 2 and not fake.errors


def test_ipc_sender_across_syncs_closed_by_the_driver():
    from mgrpo.rollout.sglang.client import SGLangEngine

    with FakeSGLang() as fake:
        sender = IPCWeightSender([fake.url])
        driver_side = SGLangEngine.connect(fake.url)  # what EngineHost runs: finish_weight_update
        for version in (1, 2):
            bucket = [(n, t + version) for n, t in _bucket()]
            sender.update_weights(bucket)
            driver_side.finish_weight_update(version)
            assert not fake.session_open and fake.weight_version == str(version)
            for n, t in bucket:
                assert torch.equal(fake.weights[n], t), n
        assert not fake.errors


def test_senders_travel_pickled():
    ipc = pickle.loads(pickle.dumps(IPCWeightSender(["http://10.0.0.5:30000"], [2])))
    assert ipc.clients[0].url == "http://10.0.0.5:30000" and ipc.tp_sizes == [2]
    d = DistributedWeightSender(["http://10.0.0.5:30000"], 4)
    assert pickle.loads(pickle.dumps(d)) is d and d.world_size == 5


def test_distributed_sender_needs_cuda_for_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sender = DistributedWeightSender(["http://127.0.0.1:9"], 1, master_address="127.0.0.1", backend="nccl")
    with pytest.raises(SGLangUnavailableError, match=r"rollout\.engine=sglang"):
        sender.update_weights(_bucket())
    with pytest.raises(ValueError, match="cluster address"):
        DistributedWeightSender(["http://127.0.0.1:9"], 1, master_address="0.0.0.0")


def _trainer_rank(sender: DistributedWeightSender, out) -> None:
    """The trainer's source rank, in its own process: it got the sender the way a Ray task gets its
    arguments (pickled); join as rank 0, send two buckets, leave."""
    try:
        assert pickle.loads(pickle.dumps(sender)) is sender  # one live sender per spec in a process
        b = _bucket(5)
        sender.update_weights(b[:3])
        sender.update_weights(b[3:])
        name = sender.group_name
        sender.close()
        out.put(("ok", (sender.bytes_sent, name)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(e)))


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_distributed_sender_broadcasts_over_a_group_sglang_joins(load_format):
    """Real torch.distributed (gloo) between a trainer process and the stand-in engine, whose side
    of the group is made by SGLang's own init_custom_process_group where the wheel is present."""
    ctx = mp.get_context("spawn")
    with FakeSGLang(lifetime_s=90) as fake:
        # group_name left to the sender in one case: it is then named after the sending process
        group = f"mgrpo-test-{load_format}" if load_format else None
        sender = DistributedWeightSender([fake.url], [1], master_address="127.0.0.1",
                                         master_port=free_port("127.0.0.1"), group_name=group, backend="gloo",
                                         load_format=load_format, timeout_s=60)
        out = ctx.Queue()
        proc = ctx.Process(target=_trainer_rank, args=(sender, out))
        proc.start()
        try:
            status, detail = out.get(timeout=80)
        finally:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        assert status == "ok", detail
        assert not fake.errors, fake.errors
        sent_bytes, group = detail
        assert group.startswith("mgrpo-test-" if load_format else "mgrpo-weights-pid")
        (init,) = fake.bodies("/init_weights_update_group")
        assert init["rank_offset"] == 1 and init["world_size"] == 2
        assert init["group_name"] == group and init["backend"] == "gloo"
        ups = fake.bodies("/update_weights_from_distributed")
        assert len(ups) == 2 and all(u["flush_cache"] is False and u["load_format"] == load_format for u in ups)
        names = [n for n, _ in _bucket(5)]
        assert sorted(ups[0]["names"] + ups[1]["names"]) == sorted(names)
        first = dict(zip(ups[0]["names"], zip(ups[0]["dtypes"], ups[0]["shapes"])))
        assert first["model.norm.weight"] == ("bfloat16", [7])
        assert first["model.embed_tokens.weight"] == ("float32", [5, 3])
        for n, t in _bucket(5):
            assert fake.weights[n].dtype == t.dtype and torch.equal(fake.weights[n], t), n
        assert fake.bodies("/destroy_weights_update_group") == [{"group_name": group}]
        assert sent_bytes == sum(t.numel() * t.element_size() for _, t in _bucket(5))
