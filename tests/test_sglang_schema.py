"""Our knowledge of SGLang's protocol (mgrpo/rollout/sglang/schema.py) against SGLang's own code,
read from the installed sglang wheel (the test extra installs it: requirements-sglang.txt), and
the fallbacks the CPU server uses where the wheel is missing."""

from __future__ import annotations

import pickle

import pytest
import torch

from mgrpo.rollout.sglang import schema
from mgrpo.rollout.sglang.schema import RequestError, check_generate, check_request
from mgrpo.rollout.sglang.weights_tensor import tensor_payloads


def _wheel():
    classes = schema.request_classes()
    if classes is None:
        pytest.skip("sglang wheel or msgspec not installed (pip install --no-deps -r requirements-sglang.txt)")
    return classes


def test_the_installed_wheel_is_the_version_the_shapes_were_read_from():
    _wheel()
    from importlib.metadata import version

    assert version("sglang") == schema.SGLANG_VERSION


def test_field_tables_match_sglangs_request_classes():
    import msgspec

    for path, cls in _wheel().items():
        real = {f.name for f in msgspec.structs.fields(cls)}
        assert real == schema.REQUESTS[path][1] | schema.BASE_FIELDS, path
    sampling = schema.contract().SamplingParams
    assert {f.name for f in msgspec.structs.fields(sampling)} == schema.SAMPLING_FIELDS


def test_sglangs_classes_check_types_and_required_fields():
    _wheel()
    check_request("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
                                                 "world_size": 2, "group_name": "g", "backend": "gloo"})
    with pytest.raises(RequestError, match=r"master_port: Field required") as e:
        check_request("/init_weights_update_group", {"master_address": "x", "rank_offset": 1, "world_size": 2})
    assert e.value.status == 400 and e.value.validation  # SGLang answers FastAPI's validation error 400
    with pytest.raises(RequestError, match=r"new_version: Input should be a valid string"):
        check_request("/update_weight_version", {"new_version": 3})
    with pytest.raises(RequestError, match=r"serialized_named_tensors.*base64"):
        check_request("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})


def test_fallbacks_without_the_wheel(monkeypatch):
    """What the CPU server does where the wheel is not installed: field tables, our unpickler."""
    monkeypatch.setattr(schema, "request_classes", lambda: None)
    monkeypatch.setattr(schema, "_adapter", lambda path: None)
    monkeypatch.setattr(schema, "contract", lambda: None)
    monkeypatch.setattr(schema, "common", lambda: None)
    check_request("/update_weight_version", {"new_version": "3"})
    with pytest.raises(RequestError, match=r"unknown fields \['new_versoin'\]"):
        check_request("/update_weight_version", {"new_versoin": "3"})
    with pytest.raises(RequestError, match=r"unknown sampling_params fields \['temprature'\]"):
        check_generate({"input_ids": [[1]], "sampling_params": [{"temprature": 1.0}]})
    t = torch.arange(6, dtype=torch.float32)
    payloads, keep = tensor_payloads([("w", t)], 1, None)
    (name, back), = schema.deserialize(payloads[0])
    assert name == "w" and torch.equal(back, t)
    evil = pickle.dumps(pickle.loads)  # a global outside the allow-list
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        schema.deserialize(evil)


def test_unknown_fields_are_refused_even_where_sglang_would_ignore_them():
    with pytest.raises(RequestError, match=r"unknown fields \['flush_cahce'\].*ignore them silently"):
        check_request("/update_weights_from_tensor", {"serialized_named_tensors": [], "flush_cahce": False})
