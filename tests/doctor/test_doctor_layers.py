"""mgrpo-doctor layers on injected faults, on CPU: the doctor names the place each fault was put.

One random Qwen3 checkpoint (4 layers, GQA, every tensor random) is the trainer's side throughout: megatron-core's
GPTModel loaded by the trainer's loader on one gloo rank, traced once. The engine's side is that checkpoint,
then copies of it with one fault each (the faults are the references: the test knows where it put them):
  - none: every hidden site agrees bit for bit (same torch kernels on CPU), the log-probs to < 1e-6;
  - one weight of one layer perturbed by 1% (a stale or wrongly converted layer): named, that layer;
  - the RoPE theta of config.json wrong: the first attention (the embeddings still agree exactly);
  - the engine in bf16 against the fp32 trainer: a gradual growth, no single place;
  - the engine's log-probs over its top-k / top-p support against the trainer's over the whole vocabulary (a
    support mismatch): every layer agrees, the log-probs part, and the doctor says why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from mgrpo.doctor import DoctorError
from mgrpo.doctor.compare import compare, verdict_line
from mgrpo.doctor.engine_side import Support, engine_trace, sites
from mgrpo.doctor.layers import layers, support_hint
from mgrpo.doctor.trainer_side import resolve_trainer, trainer_trace
from tests.helpers.convert import make_hf_checkpoint, tiny_cfg

PROMPT = 8


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(checkpoint dir, token ids, the trainer's trace of them)."""
    cfg = tiny_cfg()
    hf_dir = make_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "clean"), cfg, seed=11)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    return hf_dir, ids, trainer_trace(resolve_trainer(hf_dir), ids, PROMPT)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _perturb(hf_dir: str, name: str, scale: float = 0.01) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf_dir, "model.safetensors")
    state = load_file(path)
    w = state[name]
    state[name] = w + scale * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    save_file(state, path, metadata={"format": "pt"})


def _doctor(engine_dir, ids, trainer, dtype="float32"):
    return compare(engine_trace(engine_dir, ids, PROMPT, dtype=dtype), trainer, engine_dtype=dtype,
                   trainer_dtype="float32")


def _rel(c, site):
    return next(s["rel"] for s in c["sites"] if s["name"] == site)


@pytest.mark.integration
def test_same_weights_agree(clean):
    hf_dir, ids, trainer = clean
    assert list(trainer) == sites(4)
    c = _doctor(hf_dir, ids, trainer)
    assert c["kind"] == "agree" and c["parts_at"] is None and c["tolerance"] == 1e-5
    assert all(s["rel"] == 0.0 for s in c["sites"][:-1])  # every hidden site and the logits, bit for bit
    assert 0 < _rel(c, "log-probs") < 1e-6  # the trainer's chunked kernel against a full log_softmax


@pytest.mark.integration
@pytest.mark.parametrize("tensor, site", [
    ("model.layers.2.mlp.down_proj.weight", "layer 2 mlp"),
    ("model.layers.1.self_attn.k_proj.weight", "layer 1 attention"),
    ("model.layers.3.input_layernorm.weight", "layer 3 attention"),
])
def test_a_perturbed_layer_is_named(clean, tmp_path, tensor, site):
    hf_dir, ids, trainer = clean
    engine = _copy(hf_dir, str(tmp_path / "engine"))
    _perturb(engine, tensor)
    c = _doctor(engine, ids, trainer)
    assert c["kind"] == "parts" and c["parts_at"] == site
    i = [s["name"] for s in c["sites"]].index(site)
    assert all(s["rel"] == 0.0 for s in c["sites"][:i])  # untouched before it
    assert c["sites"][i]["rel"] > 1e-4
    assert verdict_line(c, ids, PROMPT).startswith(f"PARTS AT {site.upper()}")


@pytest.mark.integration
def test_a_wrong_rope_theta_parts_at_the_first_attention(clean, tmp_path):
    hf_dir, ids, trainer = clean
    engine = _copy(hf_dir, str(tmp_path / "engine"))
    path = os.path.join(engine, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["rope_parameters"]["rope_theta"] = 1000.0  # the trainer's is 10000
    with open(path, "w") as f:
        json.dump(raw, f)
    c = _doctor(engine, ids, trainer)
    assert c["parts_at"] == "layer 0 attention" and _rel(c, "embeddings") == 0.0
    worst = c["sites"][1]["worst_position"]
    assert worst > 0  # position 0 is not rotated: a RoPE fault shows from position 1 on


@pytest.mark.integration
def test_a_bf16_engine_grows_gradually_with_no_single_place(clean):
    hf_dir, ids, trainer = clean
    c = _doctor(hf_dir, ids, trainer, dtype="bfloat16")
    assert c["dtype"] == "bfloat16" and c["tolerance"] == 1e-2
    assert c["parts_at"] is None and c["kind"] == "gradual"  # above 1e-2 somewhere in 4 layers, never a step
    rel = [s["rel"] for s in c["sites"]]
    assert 1e-4 < rel[0] < 4e-3  # the embedding table rounded once to bf16 (relative error <= 2^-9 per entry)
    hidden = rel[1:-3]
    assert max(hidden) > 3 * rel[0] and 1e-3 < max(rel) < 0.1  # it grows through the layers, at bf16's scale
    assert verdict_line(c).startswith("NO SINGLE PLACE: the difference grows gradually")


SAMPLED = Support("sampled", top_k=5, top_p=0.9)


@pytest.fixture(scope="module")
def sampled_ids(clean):
    """A prompt and 24 tokens the in-process engine sampled from its top-k / top-p support (seeded): every
    response token lies in its support, as in a run."""
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.types import GenerateRequest, SamplingParams

    hf_dir, ids, _ = clean
    engine = HFRolloutEngine(hf_dir, eos_token_ids=[], pad_token_id=0)
    got = engine.generate([GenerateRequest(uid=0, prompt_ids=ids[:PROMPT])],
                          SamplingParams(top_k=SAMPLED.top_k, top_p=SAMPLED.top_p, max_new_tokens=24, seed=5))[0]
    assert len(got.token_ids) == 24
    return ids[:PROMPT] + got.token_ids


def _support_reference(logits: torch.Tensor, tokens: list[int], k: int, p: float) -> torch.Tensor:
    """By hand, as SGLang's torch sampler cuts: of the k most probable tokens, those whose preceding mass in the
    whole distribution is at most p; the token's log-prob renormalised over what is kept."""
    out = []
    for z, y in zip(logits.double(), tokens):
        probs, idx = torch.softmax(z, 0).sort(descending=True)
        keep = idx[:k][((probs.cumsum(0) - probs) <= p)[:k]]
        assert y in keep.tolist()
        out.append(z[y] - torch.logsumexp(z[keep], 0))
    return torch.stack(out)


@pytest.mark.integration
def test_a_support_mismatch_parts_at_the_log_probs_and_is_named(clean, sampled_ids):
    hf_dir, _, _ = clean
    ids = sampled_ids
    full = trainer_trace(resolve_trainer(hf_dir), ids, PROMPT)
    sampled = trainer_trace(resolve_trainer(hf_dir), ids, PROMPT, support=SAMPLED)
    engine = engine_trace(hf_dir, ids, PROMPT, support=SAMPLED)
    reference = _support_reference(torch.from_numpy(engine["logits"][PROMPT - 1:-1]), ids[PROMPT:], 5, 0.9)
    # same support on both sides: they agree, and both equal the hand-computed renormalised log-probs
    same = compare(engine, sampled, engine_dtype="float32", trainer_dtype="float32")
    assert same["kind"] == "agree" and support_hint(same, SAMPLED, SAMPLED) == ""
    assert abs(engine["log-probs"] - reference.numpy()).max() < 1e-6
    assert abs(sampled["log-probs"] - reference.numpy()).max() < 1e-5  # the trainer's kernel over the supports
    assert (reference < 0).sum() > 0 and (engine["log-probs"] > full["log-probs"] + 1e-3).all()  # renormalised up
    # the engine over its support, the trainer over the whole vocabulary: only the log-probs part
    c = compare(engine, full, engine_dtype="float32", trainer_dtype="float32")
    assert c["kind"] == "parts" and c["parts_at"] == "log-probs"
    assert all(s["rel"] == 0.0 for s in c["sites"][:-1])
    hint = support_hint(c, SAMPLED, Support())
    assert hint.startswith("\nSUPPORT MISMATCH") and "sampled (top_k=5, top_p=0.9)" in hint and "over full" in hint


@pytest.mark.integration
def test_the_command_names_the_layer_and_refuses_bad_input(clean, tmp_path):
    """The whole path once through `mgrpo-doctor layers` (its own rank process), then its refusals."""
    hf_dir, ids, _ = clean
    engine = _copy(hf_dir, str(tmp_path / "engine"))
    _perturb(engine, "model.layers.0.mlp.up_proj.weight")
    traj = tmp_path / "trajectories.jsonl"
    with open(traj, "w") as f:
        f.write(json.dumps({"step": 1, "prompt": "p"}) + "\n")
        f.write(json.dumps({"step": 3, "engine": 0, "prompt_ids": ids[:PROMPT], "response_ids": ids[PROMPT:],
                            "rollout_logprobs": [-1.0] * (len(ids) - PROMPT),
                            "trainer_logprobs": [-1.0] * (len(ids) - PROMPT)}) + "\n")
    cmd = [sys.executable, "-m", "mgrpo_launchers.doctor", "layers"]
    out = subprocess.run(cmd + ["--engine", engine, "--trainer", hf_dir, "--trajectory", str(traj), "--line", "2",
                                "--json", str(tmp_path / "c.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PARTS AT LAYER 0 MLP" in out.stdout and "engine (run)" in out.stdout
    with open(tmp_path / "c.json") as f:
        assert json.load(f)["comparison"]["parts_at"] == "layer 0 mlp"

    bad = [
        (["--engine", str(tmp_path / "nowhere"), "--tokens", "1,2", "--prompt-len", "1"], "not an HF directory"),
        (["--engine", hf_dir, "--tokens", "1,2,300", "--prompt-len", "1"], "outside the model's vocabulary"),
        (["--engine", hf_dir, "--tokens", "1,2", "--prompt-len", "2"], "one response token at least"),
        (["--engine", hf_dir, "--trajectory", str(traj), "--line", "1"], "has no token ids"),
        (["--engine", hf_dir, "--trajectory", str(traj), "--line", "9"], "fewer than 9 lines"),
        (["--engine", hf_dir], "either as --trajectory"),
        (["--engine", hf_dir, "--trainer", str(tmp_path), "--tokens", "1,2", "--prompt-len", "1"], "neither an HF"),
        (["--engine", hf_dir, "--tokens", "1,2", "--prompt-len", "1", "--engine-dtype", "int8"], "not one of"),
        (["--engine", hf_dir, "--tokens", "1,2", "--prompt-len", "1", "--engine-support", "sampled"],
         "support 'sampled' needs --top-k K"),
        (["--engine", hf_dir, "--tokens", "1,2", "--prompt-len", "1", "--trainer-support", "top"],
         "support 'top' is not one of ['full', 'sampled']"),
    ]
    for args, message in bad:
        out = subprocess.run(cmd + args, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2


@pytest.mark.integration
def test_other_layer_counts_are_refused_before_any_model_runs(clean, tmp_path):
    hf_dir, ids, _ = clean
    other = make_hf_checkpoint(str(tmp_path / "two"), tiny_cfg(num_layers=2), seed=1)
    with pytest.raises(DoctorError, match="the engine has 2 layers"):
        layers(other, trainer=hf_dir, tokens=",".join(map(str, ids)), prompt_len=PROMPT)
