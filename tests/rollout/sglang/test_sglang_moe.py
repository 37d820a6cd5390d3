"""A Qwen3-MoE checkpoint (transformers' own Qwen3MoeForCausalLM, tiny: 8 experts, top-2, 2 layers) served by
the CPU server: routed experts returned as SGLang 0.5.23 returns them (engine side),
checked against the router's choice recomputed here from the checkpoint's tensors; weight updates under
SGLang's Qwen3-MoE names (one tensor per expert) into transformers' fused experts."""

from __future__ import annotations

import base64
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mgrpo.rollout.sglang import SGLangEngine, SGLangRequestError
from mgrpo.rollout.sglang.generate_io import checkpoint_tensor_names
from mgrpo.rollout.types import SamplingParams
from tests.helpers.sglang_cpu import launch, post, tiny_checkpoint
from tests.helpers.moe import LAYERS, REQS, TOP_K, moe_checkpoint, recomputed_routes



@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return moe_checkpoint(str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def moe_engine(moe_ckpt, tmp_path_factory):
    eng = launch(moe_ckpt, str(tmp_path_factory.mktemp("logs")), return_routed_experts=True)
    yield eng
    eng.shutdown()


def _reference(ckpt):
    from tests.helpers.sglang_cpu import Reference

    return Reference(ckpt)


@pytest.mark.integration
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=6),
                                      SamplingParams(temperature=1.0, top_k=6, max_new_tokens=7, seed=2)],
                         ids=["greedy", "sampled"])
def test_routes_are_the_routers_choice(moe_engine, moe_ckpt, sampling):
    sampling = SamplingParams(**{**sampling.__dict__, "return_routed_experts": True})
    out = moe_engine.generate(REQS, sampling)  # one padded batch: the routes are cut per request
    ref = _reference(moe_ckpt)
    for req, res in zip(REQS, out):
        seq = req.prompt_ids + res.token_ids
        assert res.routed_experts.dtype == np.int32
        assert res.routed_experts.shape == (len(seq) - 1, LAYERS, TOP_K)  # the last token has no row
        np.testing.assert_array_equal(res.routed_experts, recomputed_routes(moe_ckpt, seq[:-1]))
        assert ref.max_diff(req.prompt_ids, res, sampling.temperature) < 1e-5  # those routes made these tokens
    plain = moe_engine.generate(REQS[:2], SamplingParams(max_new_tokens=2))
    assert all(r.routed_experts is None for r in plain)


@pytest.mark.integration
def test_start_len_and_its_bounds(moe_engine, moe_ckpt):
    body = {"input_ids": [1, 4, 6, 8], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
            "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 2}
    meta = post(moe_engine.url, "/generate", body).json()["meta_info"]
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, LAYERS, TOP_K)
    out = [e[1] for e in meta["output_token_logprobs"]]
    full = recomputed_routes(moe_ckpt, [1, 4, 6, 8] + out[:-1])
    np.testing.assert_array_equal(rows, full[2:])  # SGLang: positions [start, prompt + output - 1)
    r = post(moe_engine.url, "/generate", {**body, "routed_experts_start_len": 5})
    assert r.status_code == 400 and "is higher than the number of input tokens" in r.json()["error"]["message"]
    r = post(moe_engine.url, "/generate", {**body, "routed_experts_start_len": -1})
    assert r.status_code == 400 and "is lower than 0" in r.json()["error"]["message"]


def test_the_start_is_sent_only_when_set_in_sglangs_own_field():
    """GenerateRequest.routes_from -> the top-level routed_experts_start_len of a batched /generate, which SGLang's
    wire contract (api/v1/api_types.py GenerateRequest) reads back as sent; absent at 0 (SGLang's default)."""
    import dataclasses

    from mgrpo.rollout.sglang.generate_io import build_generate_payload
    from mgrpo.rollout.sglang.protocol import wheel

    routed = SamplingParams(max_new_tokens=4, return_routed_experts=True)
    plain = build_generate_payload(REQS[:2], routed, rids=["a", "b"])
    assert plain["return_routed_experts"] is True and "routed_experts_start_len" not in plain
    body = build_generate_payload([dataclasses.replace(r, routes_from=2) for r in REQS[1:3]], routed, rids=["a", "b"])
    assert body["routed_experts_start_len"] == 2
    api = wheel.contract()
    if api is not None:
        # (this contract has no return_routed_experts; io_struct.GenerateReqInput, which /generate takes, does)
        assert api.GenerateRequest.from_json_value(body).routed_experts_start_len == 2
        assert api.GenerateRequest.from_json_value(plain).routed_experts_start_len == 0


@pytest.mark.integration
def test_the_client_asks_each_request_for_its_own_start(moe_engine, tmp_path):
    """GenerateRequest.routes_from goes out as routed_experts_start_len, only when set; one batched POST carries
    one value (GenerateReqInput's), so the client sends one batch per value and reads back [start, seqlen - 1)
    per request: the rows of the whole routes from there. Through SGLang's router nothing comes back:
    sglang-router 0.3.2 drops return_routed_experts (and routed_experts_start_len) from /generate, so the client
    refuses to send it there and the rollout group sends routed calls to the engines directly."""
    import dataclasses

    from mgrpo.rollout.sglang.generate_io import build_generate_payload
    from mgrpo.rollout.sglang.router import RoutedClient

    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, return_routed_experts=True)
    whole = moe_engine.generate(REQS, greedy)
    starts = [0, 2, len(REQS[2].prompt_ids), 2, 1]
    sent = []
    post_was = moe_engine.client.post

    def spy(path, body, **kw):
        sent.append(body.get("routed_experts_start_len"))
        return post_was(path, body, **kw)

    moe_engine.client.post = spy
    try:
        part = moe_engine.generate([dataclasses.replace(r, routes_from=s) for r, s in zip(REQS, starts)], greedy)
    finally:
        moe_engine.client.post = post_was
    assert sorted(sent, key=str) == [1, 2, 4, None]  # one POST per value; 0 (SGLang's default) not sent
    for w, p, s in zip(whole, part, starts):
        assert p.token_ids == w.token_ids
        np.testing.assert_array_equal(p.routed_experts, w.routed_experts[s:])
    with pytest.raises(ValueError, match="one routed_experts_start_len; this batch asks for \\[0, 2\\]"):
        build_generate_payload([REQS[0], dataclasses.replace(REQS[1], routes_from=2)], greedy, rids=["a", "b"])
    with pytest.raises(ValueError, match="sglang-router 0.3.2 drops the field"):
        build_generate_payload(REQS[:1], greedy, rids=["a"], single=True)

    front = RoutedClient([moe_engine.url], host="127.0.0.1", log_dir=str(tmp_path / "router"), policy="manual")
    try:
        body = {"input_ids": [1, 4, 6, 8], "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
                "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 9}
        direct = post(moe_engine.url, "/generate", body)
        assert direct.status_code == 400 and "is higher than the number of input tokens" in direct.text
        routed = post(front.router.url, "/generate", body)  # neither field reaches the server
        assert routed.status_code == 200 and "routed_experts" not in routed.json()["meta_info"], routed.text
    finally:
        front.shutdown()


@pytest.mark.integration
def test_without_the_server_flag_the_field_is_absent(moe_ckpt, tmp_path):
    eng = launch(moe_ckpt, str(tmp_path))
    try:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                "return_routed_experts": True, "routed_experts_start_len": 99}  # not even checked, as in SGLang
        meta = post(eng.url, "/generate", body).json()["meta_info"]
        assert "routed_experts" not in meta
        with pytest.raises(SGLangRequestError, match="started without --enable-return-routed-experts"):
            eng.generate(REQS[:1], SamplingParams(max_new_tokens=2, return_routed_experts=True))
    finally:
        eng.shutdown()


@pytest.mark.integration
def test_the_flag_on_a_dense_model_is_refused_at_start(tmp_path):
    dense = tiny_checkpoint(str(tmp_path / "dense"))
    with pytest.raises(RuntimeError, match="returns routed experts for MoE models"):
        launch(dense, str(tmp_path / "logs"), return_routed_experts=True)


@pytest.mark.integration
def test_weight_updates_under_sglangs_expert_names(moe_engine, moe_ckpt, tmp_path):
    """The trainer sends per-expert tensors (SGLang's qwen3_moe.py load_weights names, as on disk); the server
    writes them into transformers' fused [E, 2I, H] / [E, H, I] experts. Checked against a model that
    transformers loads from a checkpoint holding the same per-expert tensors."""
    disk = load_file(os.path.join(moe_ckpt, "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in disk and checkpoint_tensor_names(moe_ckpt) == set(disk)
    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in disk.items()}
    names = sorted(new)
    moe_engine.update_weights([(k, new[k]) for k in names[: len(names) // 2]])
    moe_engine.update_weights([(k, new[k]) for k in names[len(names) // 2:]])
    moe_engine.finish_weight_update(3)  # every checkpoint name arrived
    ref_dir = tmp_path / "ref"
    shutil.copytree(moe_ckpt, ref_dir)
    save_file(new, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref = _reference(str(ref_dir))
    out = moe_engine.generate(REQS, SamplingParams(temperature=0.0, max_new_tokens=5, return_routed_experts=True))
    for req, res in zip(REQS, out):
        assert res.weight_version == 3 and ref.max_diff(req.prompt_ids, res, 0.0) < 1e-5
        np.testing.assert_array_equal(res.routed_experts,
                                      recomputed_routes(str(ref_dir), req.prompt_ids + res.token_ids[:-1]))
    with pytest.raises(SGLangRequestError, match=r"experts.2.down_proj.weight has shape \(24, 32\), the model expects "
                                                 r"\(32, 24\)"):
        moe_engine.update_weights([("model.layers.1.mlp.experts.2.down_proj.weight", torch.zeros(24, 32))])
    moe_engine.session.end()


@pytest.mark.integration
def test_connect_reads_the_moe_shape(moe_engine, moe_ckpt):
    eng = SGLangEngine.connect(moe_engine.url, hf_dir=moe_ckpt)
    assert eng.moe_shape == (LAYERS, TOP_K)
    out = eng.generate(REQS[:1], SamplingParams(temperature=0.0, max_new_tokens=3, return_routed_experts=True))
    assert out[0].routed_experts.shape == (len(REQS[0].prompt_ids) + 2, LAYERS, TOP_K)
