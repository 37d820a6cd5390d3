"""What the driver imports: no torch (`import torch` alone was ~136 MiB of the driver's memory at the tiny
job's peak). The run's parts (components/assemble.py::PART_MODULES) do their bookkeeping in numpy; torch lives in
the Megatron ranks and the engines, and what they return through Ray is lists and numpy, so unpickling it does not
import torch either. Only a run without model.hf_path imports it, to write its seeded initial weights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.helpers import ROOT


@pytest.mark.integration
def test_driver_checks_config_and_data_and_imports_the_parts_without_torch(tmp_path):
    code = ("import dataclasses, sys\n"
            "from mgrpo.config import MGRPOConfig\n"
            "from mgrpo.loop import Trainer\n"
            "from mgrpo.components.assemble import _import_parts, prepare\n"
            "cfg = MGRPOConfig()\n"
            f"cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir={str(tmp_path)!r}, "
            "device='cpu'))\n"
            "t = Trainer(cfg)\n"
            "p = prepare(t.cfg, t.run_dir)\n"
            "print(len(p.train_data) > 0, 'torch' in sys.modules)\n"
            "_import_parts()\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["True", "False", "False"], out.stdout


# The driver of a real run, as `mgrpo-train <overrides>` composes it; it says at its end whether torch was imported.
RUN = ("import sys\n"
       "from hydra import compose, initialize_config_dir\n"
       "from mgrpo_launchers.train import CONFIG_DIR, to_config\n"
       "from mgrpo.loop import Trainer\n"
       "with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base='1.3'):\n"
       "    cfg = to_config(compose(config_name='config', overrides=sys.argv[1:]))\n"
       "Trainer(cfg).fit()\n"
       "print('torch imported by the driver:', 'torch' in sys.modules)\n")


@pytest.mark.integration
def test_a_run_from_a_checkpoint_never_imports_torch_in_the_driver(tmp_path):
    """Two steps of the default job from a checkpoint (model.hf_path), with the in-process engine in the rank
    (rollout=hf_cpu, the lockstep benchmark's setup), TensorBoard and trajectories on: start-up, generation,
    judging, advantages, the update, the weight sync and logging, all without torch in the driver."""
    from mgrpo.config import ModelConfig
    from mgrpo.models.hf_io import init_hf_checkpoint

    ckpt = init_hf_checkpoint(str(tmp_path / "ckpt"), ModelConfig(), seed=1)
    run_dir = tmp_path / "run"
    ray_tmp = tempfile.mkdtemp(prefix="mgrpo-i35-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "TOKENIZERS_PARALLELISM": "false"}
    try:
        out = subprocess.run([sys.executable, "-c", RUN, f"model.hf_path={ckpt}", "rollout=hf_cpu", "rollout.n=2",
                              "data.train_batch_size=4", "trainer.total_training_steps=2", "trainer.save_hf=false",
                              "trainer.save_freq=0", "trainer.logger=[console,tensorboard]",
                              f"trainer.output_dir={run_dir}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "step 2/2" in out.stdout, out.stdout[-2000:]  # it really stepped
    assert out.stdout.strip().splitlines()[-1] == "torch imported by the driver: False", out.stdout[-2000:]
    assert list((run_dir / "tensorboard").glob("events.*"))


@pytest.mark.integration
def test_the_qwen3_tokenizer_loads_without_torch_and_encodes_as_autotokenizer_does():
    """model.tokenizer=qwen3 (and a tokenizer folder) is loaded by the class its tokenizer_config.json names:
    AutoTokenizer's module imports torch (transformers' config classes), the class alone does not. The same
    class, the same ids for GSM8K prompts through the chat template, as AutoTokenizer gives."""
    code = ("import dataclasses, json, sys\n"
            "from mgrpo.config import MGRPOConfig\n"
            "from mgrpo.data.tokenizer import load_tokenizer, qwen3_tokenizer_dir\n"
            "m = dataclasses.replace(MGRPOConfig().model, tokenizer='qwen3', vocab_size=151936)\n"
            "tok = load_tokenizer(m)\n"
            "print('torch', 'torch' in sys.modules)\n"
            "rows = [json.loads(l) for l, _ in zip(open(sys.argv[1]), range(20))]\n"
            "chats = [[{'role': 'user', 'content': r['question']}] for r in rows]\n"
            "mine = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]\n"
            "from transformers import AutoTokenizer\n"
            "auto = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())\n"
            "theirs = [auto.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]\n"
            "print('class', type(tok).__name__ == type(auto).__name__, 'ids', mine == theirs and len(mine) == 20,\n"
            "      'decode', tok.decode(mine[0]) == auto.decode(theirs[0]), 'eos', tok.eos_token_id == auto.eos_token_id)\n")
    gsm8k = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not gsm8k.is_file():
        pytest.skip(f"GSM8K is not at {gsm8k}")
    out = subprocess.run([sys.executable, "-c", code, str(gsm8k)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["torch", "False", "class", "True", "ids", "True", "decode", "True", "eos", "True"], \
        out.stdout
