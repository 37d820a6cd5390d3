"""mgrpo-convert: the HF -> Megatron -> HF round trip through the command line, and the errors it
gives before spawning anything."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mgrpo_launchers.convert import main
from tests.helpers.convert import hf_state, make_hf_checkpoint, tiny_cfg


@pytest.mark.integration
def test_round_trip_through_the_cli(tmp_path, capsys):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from tests.helpers.convert import _tokenizer

    cfg = tiny_cfg(tie_word_embeddings=True)
    hf = make_hf_checkpoint(str(tmp_path / "hf"), cfg, seed=11)
    _tokenizer(hf)  # the tokenizer travels with the checkpoint
    mc, back = str(tmp_path / "mcore"), str(tmp_path / "back")

    assert main(["hf-to-megatron", "--hf-dir", hf, "--out", mc, "--tp", "1", "--pp", "1"]) == 0
    meta = json.load(open(os.path.join(mc, "mgrpo_model.json")))
    assert meta["model"]["head_dim"] == 24 and (meta["tp"], meta["pp"], meta["dtype"]) == (1, 1, "float32")
    # loaded at another layout than it was written with; every stage writes its own shards
    assert main(["megatron-to-hf", "--ckpt", mc, "--out", back, "--pp", "2"]) == 0
    assert "loaded at tp=1 pp=2" in capsys.readouterr().out

    a, b = hf_state(hf), hf_state(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.exists(os.path.join(back, "model.safetensors.index.json"))
    assert Qwen3ForCausalLM.from_pretrained(back).config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(back).eos_token == "<eos>"


def test_errors_before_spawning(tmp_path, capsys):
    cfg = tiny_cfg()
    hf = make_hf_checkpoint(str(tmp_path / "hf"), cfg)

    def run(*argv) -> str:
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    assert "HF checkpoint directory: /nonexistent does not exist" in run(
        "hf-to-megatron", "--hf-dir", "/nonexistent", "--out", str(tmp_path / "o"))
    assert "--tp=3 does not divide model num_attention_heads=4" in run(
        "hf-to-megatron", "--hf-dir", hf, "--out", str(tmp_path / "o"), "--tp", "3")
    assert "--pp=3 does not divide model num_layers=4" in run(
        "hf-to-megatron", "--hf-dir", hf, "--out", str(tmp_path / "o"), "--pp", "3")
    os.makedirs(tmp_path / "full")
    (tmp_path / "full" / "x").write_text("x")
    assert "exists and is not empty (pass --force" in run(
        "hf-to-megatron", "--hf-dir", hf, "--out", str(tmp_path / "full"))

    # config.json says one thing, the tensors another
    wrong = str(tmp_path / "wrong")
    shutil.copytree(hf, wrong)
    with open(os.path.join(wrong, "config.json")) as f:
        raw = json.load(f)
    raw["intermediate_size"] = 128
    with open(os.path.join(wrong, "config.json"), "w") as f:
        json.dump(raw, f)
    err = run("hf-to-megatron", "--hf-dir", wrong, "--out", str(tmp_path / "o2"))
    assert "model.layers.0.mlp.gate_proj.weight has shape [96, 64]" in err and "expected [128, 64]" in err

    os.remove(os.path.join(wrong, "model.safetensors"))
    assert "has neither model.safetensors nor model.safetensors.index.json" in run(
        "hf-to-megatron", "--hf-dir", wrong, "--out", str(tmp_path / "o3"))
    assert "has no mgrpo_model.json: not written by `mgrpo-convert hf-to-megatron`" in run(
        "megatron-to-hf", "--ckpt", hf, "--out", str(tmp_path / "o4"))
    assert "--ckpt /nonexistent does not exist" in run("megatron-to-hf", "--ckpt", "/nonexistent", "--out", "x")
