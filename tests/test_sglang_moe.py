"""A Qwen3-MoE checkpoint (transformers' own Qwen3MoeForCausalLM, tiny: 8 experts, top-2, 2 layers) served by
the CPU server: routed experts returned as SGLang 0.5.23 returns them (issue 19 item 6, engine side),
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
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.sglang_cpu import launch, post, tiny_checkpoint

LAYERS, EXPERTS, TOP_K = 2, 8, 2
REQS = [GenerateRequest(uid=i, prompt_ids=[1, 3 + i, 5, 7, 2][: 2 + i % 4]) for i in range(5)]


def moe_checkpoint(out_dir: str, seed: int = 0) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=15, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers far from uniform, so no top-k choice is a near tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    return out_dir


def recomputed_routes(ckpt: str, ids: list[int]) -> np.ndarray:
    """The router's top-k for every position of `ids`, from the checkpoint's own `mlp.gate.weight` tensors:
    softmax(x W^T) then top-k, where x is each layer's router input (its post-attention RMSNorm output) from
    a plain full-sequence transformers forward."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    gates = {k: v for k, v in tensors.items() if k.endswith("mlp.gate.weight")}
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, out, i=i: inputs.__setitem__(i, out[0])) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    rows = []
    for i in range(LAYERS):
        probs = torch.softmax(inputs[i] @ gates[f"model.layers.{i}.mlp.gate.weight"].T, dim=-1)
        rows.append(torch.topk(probs, TOP_K, dim=-1).indices)
    return torch.stack(rows, dim=1).numpy().astype(np.int32)  # [seq, layers, top_k]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return moe_checkpoint(str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def moe_engine(moe_ckpt, tmp_path_factory):
    eng = launch(moe_ckpt, str(tmp_path_factory.mktemp("logs")), return_routed_experts=True)
    yield eng
    eng.shutdown()


def _reference(ckpt):
    from tests.sglang_cpu import Reference

    return Reference(ckpt)


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


def test_the_flag_on_a_dense_model_is_refused_at_start(tmp_path):
    dense = tiny_checkpoint(str(tmp_path / "dense"))
    with pytest.raises(RuntimeError, match="returns routed experts for MoE models"):
        launch(dense, str(tmp_path / "logs"), return_routed_experts=True)


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


def test_connect_reads_the_moe_shape(moe_engine, moe_ckpt):
    eng = SGLangEngine.connect(moe_engine.url, hf_dir=moe_ckpt)
    assert eng.moe_shape == (LAYERS, TOP_K)
    out = eng.generate(REQS[:1], SamplingParams(temperature=0.0, max_new_tokens=3, return_routed_experts=True))
    assert out[0].routed_experts.shape == (len(REQS[0].prompt_ids) + 2, LAYERS, TOP_K)
