"""The payloads SGLang deserialises and the senders' pure parts, without a server.

SGLang's own unpickler (sglang/srt/utils/common.py, read from the installed wheel by
mgrpo/rollout/sglang/cpu/receive.py) decodes what we serialise. Transfers into a real server process,
over both transports, are in test_sglang_sync.py."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from mgrpo.rollout.sglang.cpu.receive import deserialize as deserialize_payload
from mgrpo.rollout.sglang.http import SGLangUnavailableError
from mgrpo.rollout.sglang.protocol.buckets import dtype_name, flatten_bucket
from mgrpo.rollout.sglang.protocol.tables import PAYLOAD_GLOBALS
from mgrpo.rollout.sglang.protocol.wheel import common as sglang_common
from mgrpo.rollout.sglang.weights_distributed import DistributedWeightSender, default_backend
from mgrpo.rollout.sglang.weights_tensor import IPCWeightSender, TensorWeightSender, tensor_payloads


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


def test_senders_travel_pickled():
    ipc = pickle.loads(pickle.dumps(IPCWeightSender(["http://10.0.0.5:30000"], [2])))
    assert ipc.clients[0].url == "http://10.0.0.5:30000" and ipc.tp_sizes == [2]
    d = DistributedWeightSender(["http://10.0.0.5:30000"], 4)
    assert pickle.loads(pickle.dumps(d)) is d and d.world_size == 5
    # an identical sender built again (as the rollout group may do every sync) resolves to the live one
    again = DistributedWeightSender(["http://10.0.0.5:30000"], 4)
    assert pickle.loads(pickle.dumps(again)) is d
    bumped = DistributedWeightSender(["http://10.0.0.5:30000"], 4, generation=1)  # after a restart: a new one
    assert pickle.loads(pickle.dumps(bumped)) is not d


def test_distributed_sender_needs_cuda_for_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sender = DistributedWeightSender(["http://127.0.0.1:9"], 1, master_address="127.0.0.1", backend="nccl")
    with pytest.raises(SGLangUnavailableError, match=r"rollout\.engine=sglang"):
        sender.update_weights(_bucket())
    with pytest.raises(ValueError, match="cluster address"):
        DistributedWeightSender(["http://127.0.0.1:9"], 1, master_address="0.0.0.0")


def test_cpu_payloads_travel_as_named_shared_memory_and_leave_the_source_alone():
    bucket = _bucket(3)
    for load_format in ("flattened_bucket", None):
        payloads, keep = tensor_payloads(bucket, 1, load_format)
        rec = _Recorder(base64.b64decode(payloads[0]))
        rec.load()
        # by name (any process of this user can open it), never by file descriptor (same process family only)
        assert ("torch.multiprocessing.reductions", "rebuild_storage_filename") in rec.seen
        assert ("multiprocessing.resource_sharer", "DupFd") not in rec.seen
        assert not any(t.is_shared() for _, t in bucket)  # the trainer's own tensors were copied, not moved
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # the global strategy is untouched


def test_backend_follows_capability(monkeypatch):
    assert default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"
    with pytest.raises(ValueError, match="backend must be one of"):
        DistributedWeightSender(["http://127.0.0.1:9"], 1, backend="mpi")
    assert IPCWeightSender is TensorWeightSender
