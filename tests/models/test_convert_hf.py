"""HF checkpoint handling and the layout rules, in one process (no megatron process groups):
config.json <-> ModelConfig, the exact fused-QKV / gate-up / vocab-padding layouts at TP 1, 2, 4,
the Transformer Engine key set, buckets, sharded saves that transformers loads, seeded init."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from mgrpo.config import ModelConfig
from mgrpo.models import (bucketize, check_hf_config, init_hf_checkpoint, iter_megatron_to_hf, load_hf_into_megatron,
                          model_config_from_hf, save_hf_checkpoint)
from mgrpo.models.layout import hf_from_shards, shard_from_hf
from mgrpo.models.qwen3 import hf_config, hf_shapes, stage_weights
from mgrpo.models.shapes import Dims, local_shape, padded_vocab_size
from tests.helpers import ROOT
from tests.helpers.convert import hf_state, make_hf_checkpoint, tiny_cfg
from tests.helpers.convert import _tokenizer


def _reader(state):
    def read(name, dim, start, stop):
        t = state[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


def _random_state(cfg: ModelConfig, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_shapes(cfg).items()}


# ---------------------------------------------------------------------------------------------
# layout


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_layout_round_trip_at_every_tp(tp, tied):
    cfg = tiny_cfg(num_attention_heads=8, num_query_groups=4, tie_word_embeddings=tied, ffn_hidden_size=64)
    state = _random_state(cfg)
    d = Dims.of(cfg, tp, padded_vocab_size(cfg.vocab_size, tp))
    d.check_tp()
    out = {}
    for w in stage_weights(cfg, layers=range(cfg.num_layers), pre_process=True, post_process=True):
        shards = [shard_from_hf(w, _reader(state), d, r) for r in range(tp)]
        assert all(tuple(s.shape) == local_shape(w, d) for s in shards), w.megatron
        if w.kind == "vocab":  # padded rows are zero
            assert torch.equal(torch.cat(shards)[cfg.vocab_size:], torch.zeros(d.vocab_padded - cfg.vocab_size, 64))
        out.update(hf_from_shards(w, shards if w.kind != "replicated" else shards[:1], d))
    assert set(out) == set(state) and all(torch.equal(out[k], state[k]) for k in state)


def test_each_tp_rank_reads_only_its_slices():
    """Summed over TP ranks, every sharded element is read exactly once; replicated ones once per rank."""
    cfg = tiny_cfg(tie_word_embeddings=False)
    state = _random_state(cfg)
    tp = 2
    d = Dims.of(cfg, tp, 256)
    weights = stage_weights(cfg, layers=range(cfg.num_layers), pre_process=True, post_process=True)
    replicated = sum(state[w.hf[0]].numel() for w in weights if w.kind == "replicated")
    total = sum(t.numel() for t in state.values())
    read = [0] * tp
    for r in range(tp):
        def reader(name, dim, start, stop, r=r):
            t = _reader(state)(name, dim, start, stop)
            read[r] += t.numel()
            return t

        for w in weights:
            shard_from_hf(w, reader, d, r)
    assert sum(read) == total + (tp - 1) * replicated
    assert max(read) < 0.6 * total


def test_fused_qkv_is_grouped_by_query_group():
    """linear_qkv rows: for each kv group, its query heads, then its k head, then its v head."""
    cfg = tiny_cfg(hidden_size=1, num_attention_heads=4, num_query_groups=2, head_dim=1, ffn_hidden_size=2)
    state = {"model.layers.0.self_attn.q_proj.weight": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),  # q heads 0..3
             "model.layers.0.self_attn.k_proj.weight": torch.tensor([[10.0], [11.0]]),  # k heads 0, 1
             "model.layers.0.self_attn.v_proj.weight": torch.tensor([[20.0], [21.0]])}
    w = [w for w in stage_weights(cfg, layers=[0], pre_process=False, post_process=False) if w.kind == "qkv"][0]
    rows = lambda tp, r: shard_from_hf(w, _reader(state), Dims.of(cfg, tp), r).flatten().tolist()  # noqa: E731
    assert rows(1, 0) == [0, 1, 10, 20, 2, 3, 11, 21]
    assert rows(2, 0) == [0, 1, 10, 20] and rows(2, 1) == [2, 3, 11, 21]


def test_fc1_shards_hold_gate_then_up():
    cfg = tiny_cfg(hidden_size=1, ffn_hidden_size=4)
    state = {"model.layers.0.mlp.gate_proj.weight": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
             "model.layers.0.mlp.up_proj.weight": torch.tensor([[10.0], [11.0], [12.0], [13.0]])}
    w = [w for w in stage_weights(cfg, layers=[0], pre_process=False, post_process=False) if w.kind == "fc1"][0]
    rows = lambda tp, r: shard_from_hf(w, _reader(state), Dims.of(cfg, tp), r).flatten().tolist()  # noqa: E731
    assert rows(1, 0) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert rows(2, 0) == [0, 1, 10, 11] and rows(2, 1) == [2, 3, 12, 13]


def test_layers_use_global_indices_and_tied_output_is_not_exported():
    cfg = tiny_cfg(tie_word_embeddings=True)
    last = stage_weights(cfg, layers=[2, 3], pre_process=False, post_process=True)
    assert last[0].megatron == "decoder.layers.0.input_layernorm.weight"
    assert last[0].hf == ("model.layers.2.input_layernorm.weight",)
    out = [w for w in last if w.megatron == "output_layer.weight"]
    assert out and out[0].hf == ("model.embed_tokens.weight",) and not out[0].export
    assert not any(w.megatron == "output_layer.weight"
                   for w in stage_weights(cfg, layers=[0], pre_process=True, post_process=True))


# ---------------------------------------------------------------------------------------------
# the Transformer Engine key set, on a stand-in module with TE's parameter names

TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _stand_in(cfg: ModelConfig, *, te: bool, extra: str | None = None) -> torch.nn.Module:
    """A module with the parameter names and shapes of a whole-model GPTModel (TP=1)."""
    root = torch.nn.Module()
    root.pre_process = root.post_process = True
    root.decoder = torch.nn.Module()
    root.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(cfg.num_layers))
    for j, layer in enumerate(root.decoder.layers):
        layer.layer_number = j + 1
    d = Dims.of(cfg, 1, 128)
    weights = stage_weights(cfg, layers=range(cfg.num_layers), pre_process=True, post_process=True)
    shapes = {w.megatron: local_shape(w, d) for w in weights}
    if extra:
        shapes[extra] = (3,)
    for name, shape in shapes.items():
        if te:
            for local, fused in TE_NAMES.items():
                name = name.replace(local, fused)
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"))))
    return root


@pytest.mark.parametrize("te", [False, True])
def test_local_and_te_key_sets(tmp_path, te):
    cfg = tiny_cfg()
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg)
    model = _stand_in(cfg, te=te)
    load_hf_into_megatron(model, hf_dir, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    state = hf_state(hf_dir)
    params = dict(model.named_parameters())
    norm = "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" if te else \
        "decoder.layers.3.input_layernorm.weight"
    assert torch.equal(params[norm], state["model.layers.3.input_layernorm.weight"])
    assert not any(torch.isnan(p).any() for p in params.values())
    out = dict(iter_megatron_to_hf(model, cfg, tp_group=None, tp_size=1, pp_rank=0, pp_size=1))
    assert set(out) == set(state) and all(torch.equal(out[k], state[k]) for k in state)


def test_unknown_megatron_parameter_is_refused(tmp_path):
    cfg = tiny_cfg()
    hf_dir = make_hf_checkpoint(str(tmp_path / "hf"), cfg)
    model = _stand_in(cfg, te=False, extra="decoder.layers.1.mlp.router.weight")
    with pytest.raises(ValueError, match="megatron parameter decoder.layers.1.mlp.router.weight has no HF counterpart"):
        load_hf_into_megatron(model, hf_dir, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match="has no HF counterpart"):
        next(iter_megatron_to_hf(model, cfg, tp_group=None, tp_size=1, pp_rank=0, pp_size=1))


# ---------------------------------------------------------------------------------------------
# buckets


def test_bucketize():
    t = lambda n: torch.zeros(n, dtype=torch.float32)  # noqa: E731  (4 bytes per element)
    stream = [("a", t(10)), ("b", t(10)), ("c", t(30)), ("d", t(5)), ("e", t(5)), ("f", t(20))]
    buckets = list(bucketize(iter(stream), bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert all(sum(x.numel() * 4 for _, x in b) <= 80 for b in buckets if len(b) > 1)
    assert [[n for n, _ in b] for b in bucketize(stream, 1)] == [[n] for n, _ in stream]
    assert list(bucketize([], 10)) == []
    with pytest.raises(ValueError, match="bucket_bytes=0 must be positive"):
        list(bucketize(stream, 0))


# ---------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize("tied", [True, False])
def test_model_config_round_trip(tmp_path, tied):
    cfg = tiny_cfg(tie_word_embeddings=tied, head_dim=40, rms_norm_eps=1e-5, init_std=0.05)
    hf_config(cfg).save_pretrained(tmp_path)
    back = model_config_from_hf(str(tmp_path))
    same = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
            "ffn_hidden_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
            "init_std")
    assert {k: getattr(back, k) for k in same} == {k: getattr(cfg, k) for k in same}
    assert back.hf_path == str(tmp_path)
    check_hf_config(str(tmp_path), back)


def test_check_hf_config_names_every_mismatch(tmp_path):
    cfg = tiny_cfg()
    hf_config(cfg).save_pretrained(tmp_path)
    wrong = dataclasses.replace(cfg, num_query_groups=4, head_dim=32, tie_word_embeddings=True, rope_theta=1e6)
    with pytest.raises(ValueError) as e:
        check_hf_config(str(tmp_path), wrong)
    msg = str(e.value)
    for line in ("config.json num_key_value_heads=2 but model.num_query_groups=4",
                 "config.json head_dim=24 but model.head_dim=32",
                 "config.json tie_word_embeddings=False but model.tie_word_embeddings=True",
                 "config.json rope_theta=10000.0 but model.rope_theta=1000000.0"):
        assert line in msg
    assert "hidden_size" not in msg


def test_check_hf_config_names_a_missing_field_and_the_file(tmp_path):
    """config.json is read without transformers (the driver imports no torch): a field it leaves out that has
    no sensible default is named with the file, not a KeyError."""
    cfg = tiny_cfg()
    hf_config(cfg).save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        raw = json.load(f)
    del raw["vocab_size"]
    with open(path, "w") as f:
        json.dump(raw, f)
    from mgrpo.config import InputError  # the launchers print it in a line and exit 2

    with pytest.raises(InputError, match=r"config\.json: config\.json has no vocab_size \(") as e:
        check_hf_config(str(tmp_path), cfg)
    assert str(tmp_path) in str(e.value)


def _write_config(path, **fields):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(fields, f)
    return str(path)


RELEASED_STYLE = dict(  # transformers 4.51 style, as the released Qwen3 checkpoints ship it
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
    tie_word_embeddings=True, torch_dtype="bfloat16", hidden_act="silu", attention_bias=False,
    use_sliding_window=False, sliding_window=None, initializer_range=0.02)


def test_released_style_config_matches_the_preset(tmp_path):
    import yaml

    hf_dir = _write_config(tmp_path / "q", **RELEASED_STYLE)
    with open(os.path.join(ROOT, "configs", "model", "qwen3-0.6b.yaml")) as f:
        preset = ModelConfig(**yaml.safe_load(f))
    check_hf_config(hf_dir, preset)
    got = model_config_from_hf(hf_dir)
    assert got.tokenizer == "qwen3" and got.rope_theta == 1e6 and got.num_query_groups == 8


def test_unsupported_configs_are_named(tmp_path):
    yarn = _write_config(tmp_path / "yarn", **{**RELEASED_STYLE, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        model_config_from_hf(yarn)
    llama = _write_config(tmp_path / "llama", **{**RELEASED_STYLE, "model_type": "llama"})
    with pytest.raises(ValueError, match="model_type='llama', expected 'qwen3'"):
        model_config_from_hf(llama)
    with pytest.raises(FileNotFoundError, match="HF checkpoint has no config.json"):
        model_config_from_hf(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_hf_into_megatron(_stand_in(tiny_cfg(), te=False), _write_config(tmp_path / "w", **json.loads(
            hf_config(tiny_cfg()).to_json_string())), tiny_cfg(), tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


# ---------------------------------------------------------------------------------------------
# writing


def test_sharded_save_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    cfg = tiny_cfg()
    src = make_hf_checkpoint(str(tmp_path / "src"), cfg)
    state = hf_state(src)
    out = str(tmp_path / "out")
    tok = _tokenizer(str(tmp_path / "tok"))
    names = list(hf_shapes(cfg))
    save_hf_checkpoint(out, ((n, state[n]) for n in names), cfg, tokenizer=tok, max_shard_bytes=64 << 10)
    files = os.listdir(out)
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(names)
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], state[n]) for n in names)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<eos>"
    assert GenerationConfig.from_pretrained(out).eos_token_id == 1 and model.config.eos_token_id == 1

    # saving again, as one file, into the same directory leaves no stale shards behind
    save_hf_checkpoint(out, ((n, state[n]) for n in names), cfg, tokenizer_dir=str(tmp_path / "tok"))
    assert sorted(f for f in os.listdir(out) if f.startswith("model")) == ["model.safetensors"]
    assert Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32) is not None
    assert AutoTokenizer.from_pretrained(out).eos_token == "<eos>"


def test_save_refuses_an_incomplete_or_wrong_stream(tmp_path):
    cfg = tiny_cfg()
    state = _random_state(cfg)
    out = str(tmp_path / "out")
    missing = "model.layers.2.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"missing tensor {missing}"):
        save_hf_checkpoint(out, ((k, v) for k, v in state.items() if k != missing), cfg)
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    with pytest.raises(ValueError, match="tensor model.norm.weight has shape \\[3\\], expected \\[64\\]"):
        save_hf_checkpoint(out, {**state, "model.norm.weight": torch.zeros(3)}.items(), cfg)
    with pytest.raises(ValueError, match="appears twice"):
        save_hf_checkpoint(out, list(state.items()) + [("model.norm.weight", state["model.norm.weight"])], cfg)


@pytest.mark.parametrize("tied", [True, False])
def test_init_hf_checkpoint_is_seeded(tmp_path, tied):
    from transformers import Qwen3ForCausalLM

    cfg = tiny_cfg(tie_word_embeddings=tied)
    rng = torch.get_rng_state()
    a = init_hf_checkpoint(str(tmp_path / "a"), cfg, seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is left alone
    init_hf_checkpoint(str(tmp_path / "b"), cfg, seed=7)
    init_hf_checkpoint(str(tmp_path / "c"), cfg, seed=8)
    sa, sb, sc = (hf_state(str(tmp_path / x)) for x in "abc")
    assert set(sa) == set(hf_shapes(cfg)) and ("lm_head.weight" in sa) != tied
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    std = sa["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - cfg.init_std) < 0.2 * cfg.init_std  # transformers' normal init with initializer_range
    model = Qwen3ForCausalLM.from_pretrained(a)
    assert model.config.tie_word_embeddings == tied and model.config.head_dim == 24
