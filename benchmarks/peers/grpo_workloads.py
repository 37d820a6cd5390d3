"""What mgrpo and TRL's GRPOTrainer run in `grpo_vs_trl.py` (and each point of `scaling.py`): the model, the
prompts, the reward and the algorithm settings, as plain data that travels to both children in their spec.

Two workloads:
- `tiny`: the default job's (16-token vocabulary, the synthetic `sum` task, 32 prompts x 8 samples, 4 new tokens).
- `qwen3vocab`: GSM8K prompts through the real Qwen3 tokenizer and chat template, a Qwen3-shaped model with the
  full 151,936-token vocabulary and a small body, up to 128 response tokens: the `[tokens x vocab]` logits are
  what costs time and memory here.

`Workload.with_changes` makes the variants the scaling sweep needs (longer responses, another vocabulary size,
more prompts) without a copy of the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from dataclasses import dataclass, field

from benchmarks import REPO

GSM8K_RAW = os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k")
SEED = 1


@dataclass(frozen=True)
class Workload:
    name: str
    model: dict
    """ModelConfig fields; both sides start from one seeded random Qwen3ForCausalLM of this shape."""
    data: str
    """'sum' (mgrpo's synthetic task, synthetic tokenizer) or 'gsm8k' (GSM8K records, Qwen3 chat template)."""
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    reward: str
    """'module:function' with veRL's signature, called by both sides, or 'builtin': mgrpo's own judge for the
    data source (with `gsm8k_judge`'s options), which TRL's process calls through mgrpo's reward registry."""
    trl_micro_batch: int
    """TRL's per_device_train_batch_size (rows per forward/backward); gradient accumulation makes up the rest of
    the batch, so one generation still feeds exactly one optimizer step."""
    max_prompt_length: int = 256
    rollout: str = "hf_cpu"
    """mgrpo's rollout config group: hf_cpu (the in-process transformers engine inside the Megatron rank, its
    fastest rollout on CPU and the same HF generate TRL runs) or sglang_cpu (SGLang-protocol CPU servers)."""
    temperature: float = 1.0
    lr: float = 5e-4
    kl_coef: float = 0.001
    mgrpo_overrides: tuple = ()
    """Extra `mgrpo-train` overrides (engine, token budget, ...) beyond what the fields above imply."""
    gsm8k_judge: dict = field(default_factory=dict)
    """reward.gsm8k options (method, format_score) of mgrpo's GSM8K judge, the same on both sides."""
    describe: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def data_source(self) -> str:
        return {"gsm8k": "openai/gsm8k", "sum": "mgrpo/sum"}[self.data]

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def with_changes(self, **kw) -> "Workload":
        model = {**self.model, **kw.pop("model", {})}
        return dataclasses.replace(self, model=model, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Workload":
        return Workload(**{**d, "mgrpo_overrides": tuple(d.get("mgrpo_overrides", ()))})

    def model_label(self) -> str:
        m = self.model
        return (f"Qwen3ForCausalLM: vocab {m['vocab_size']}, hidden {m['hidden_size']}, {m['num_layers']} layers, "
                f"{m['num_attention_heads']} heads / {m['num_query_groups']} KV heads, head_dim {m['head_dim']}, "
                f"ffn {m['ffn_hidden_size']}, tied embeddings, fp32; seeded random init (mgrpo init_hf_checkpoint, "
                f"seed {SEED}), {parameter_count(m) / 1e6:.1f}M parameters")


def parameter_count(m: dict) -> int:
    h, q, kv, d, f, layers = (m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["head_dim"],
                              m["ffn_hidden_size"], m["num_layers"])
    per_layer = h * d * (q + 2 * kv) + q * d * h + 3 * h * f + 2 * h + 2 * d
    return m["vocab_size"] * h * (1 if m.get("tie_word_embeddings", True) else 2) + layers * per_layer + h


TINY_MODEL = {"tokenizer": "synthetic", "vocab_size": 16, "hidden_size": 128, "num_layers": 2,
              "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 32, "ffn_hidden_size": 256,
              "tie_word_embeddings": True, "max_position_embeddings": 256}
# 8 heads / 4 KV heads so that every trainer layout of the scaling sweep (TP 1, 2, 4) splits it; positions for
# the longest prompt (239 tokens) plus the longest response of the sweep (1024).
QWEN3VOCAB_MODEL = {"tokenizer": "qwen3", "vocab_size": 151936, "hidden_size": 256, "num_layers": 4,
                    "num_attention_heads": 8, "num_query_groups": 4, "head_dim": 32, "ffn_hidden_size": 768,
                    "tie_word_embeddings": True, "max_position_embeddings": 2048}

WORKLOADS = {
    "tiny": Workload(
        name="tiny", model=TINY_MODEL, data="sum", prompts_per_step=32, samples_per_prompt=8, max_new_tokens=4,
        reward="builtin", trl_micro_batch=256, max_prompt_length=32, lr=5e-4,
        describe="mgrpo synthetic 'sum' (a, b in 0..4), prompts in mgrpo's PromptDataset order (data.seed=1)"),
    "qwen3vocab": Workload(
        name="qwen3vocab", model=QWEN3VOCAB_MODEL, data="gsm8k", prompts_per_step=8, samples_per_prompt=8,
        max_new_tokens=128, reward="builtin", trl_micro_batch=64, lr=1e-5,
        gsm8k_judge={"method": "flexible", "format_score": 0.1},
        describe="GSM8K train prompts (mgrpo-prepare gsm8k), Qwen3 chat template (enable_thinking=False) through "
                 "the real Qwen3 tokenizer, in mgrpo's PromptDataset order (data.seed=1); reward: mgrpo's GSM8K "
                 "judge, flexible (the last number), with veRL's format credit 0.1 (reward.gsm8k.format_score)"),
}


# ======================================================================================================
# the mgrpo configuration of a workload (composed the way `mgrpo-train <overrides>` composes it)
# ======================================================================================================
def mgrpo_overrides(w: Workload, data_dir: str | None) -> list[str]:
    out = [f"model.{k}={v}" for k, v in w.model.items()]
    out += [f"rollout={w.rollout}", f"data.train_batch_size={w.prompts_per_step}", f"rollout.n={w.samples_per_prompt}",
            f"data.max_response_length={w.max_new_tokens}", f"data.max_prompt_length={w.max_prompt_length}",
            f"rollout.temperature={w.temperature}", f"actor.lr={w.lr}", f"algorithm.kl_coef={w.kl_coef}",
            "algorithm.entropy_coeff=0.0"]  # TRL's GRPO loss has no entropy bonus: the same objective on both sides
    if w.data == "gsm8k":
        out += ["data=gsm8k", f"data.train_files=[{os.path.join(data_dir, 'train.parquet')}]", "data.val_files=[]",
                *[f"reward.gsm8k.{k}={v}" for k, v in w.gsm8k_judge.items()]]
    if w.reward != "builtin":
        out.append(f'+reward.custom_functions={{{w.data_source}:"{w.reward}"}}')
    return out + list(w.mgrpo_overrides)


def model_key(m: dict) -> str:
    """A short name for a model shape (initial weights are made once per shape in a workdir)."""
    return hashlib.sha1(json.dumps(m, sort_keys=True).encode()).hexdigest()[:10]


def compose_mgrpo(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from mgrpo_launchers.train import CONFIG_DIR, to_config  # importing it registers the structured schema

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=overrides))


# ======================================================================================================
# shared setup: data, prompts, initial weights, the reward
# ======================================================================================================
def prepare_data(w: Workload, workdir: str) -> str | None:
    """GSM8K as RL records (`mgrpo-prepare gsm8k`) under the workdir; None for the synthetic task."""
    if w.data != "gsm8k":
        return None
    from mgrpo_launchers.prepare_data import main as prepare

    out = os.path.join(workdir, "gsm8k")
    if not os.path.exists(os.path.join(out, "train.parquet")):
        if prepare(["gsm8k", "--input-dir", GSM8K_RAW, "--out-dir", out]) != 0:
            raise SystemExit(f"mgrpo-prepare gsm8k --input-dir {GSM8K_RAW} failed")
    return out


def prompt_schedule(w: Workload, data_dir: str | None, total_steps: int) -> list[dict]:
    """The prompts mgrpo sees, step by step (PromptDataset with data.seed=1, shuffled epochs), in the form TRL's
    dataset takes: chat messages for GSM8K (TRL applies the same template), templated text for `sum`."""
    from mgrpo.data import PromptDataset
    from mgrpo.data.records import read_records
    from mgrpo.data.tokenizer import load_tokenizer

    cfg = compose_mgrpo(mgrpo_overrides(w, data_dir))
    tok = load_tokenizer(cfg.model)
    ds = PromptDataset(cfg.data, tok, split="train")
    messages = {}
    if w.data == "gsm8k":  # each record's chat messages, by their templated text (PromptItem keeps only the text)
        for rec in read_records(cfg.data.train_files[0], cfg.data.prompt_key):
            text = tok.apply_chat_template(rec.prompt, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=cfg.data.enable_thinking)
            messages.setdefault(text, rec.prompt)
    rows = []
    for _ in range(total_steps):
        for it in ds.next_batch(w.prompts_per_step):
            prompt = it.prompt_text
            if w.data == "gsm8k":
                prompt = messages[it.prompt_text]
                ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False,
                                              enable_thinking=cfg.data.enable_thinking)
                if list(ids) != list(it.prompt_ids):
                    raise SystemExit(f"TRL's template would tokenize prompt {it.index} differently from mgrpo's")
            rows.append({"prompt": prompt, "ground_truth": it.ground_truth, "data_source": it.data_source,
                         "prompt_len": len(it.prompt_ids)})
    return rows


def make_initial_model(w: Workload, path: str) -> None:
    from mgrpo.config.schema import ModelConfig
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.models import init_hf_checkpoint

    mc = ModelConfig(**w.model)
    init_hf_checkpoint(path, mc, seed=SEED, tokenizer=load_tokenizer(mc))


def load_reward(w: Workload):
    """The function mgrpo's judger calls for the workload's data source (TRL's process calls the same one)."""
    if w.reward == "builtin":
        from mgrpo.rewards.registry import builtin_rewards

        return builtin_rewards({"method": "strict", "format_score": 0.0, **w.gsm8k_judge})[w.data_source]
    module, fn = w.reward.split(":")
    return getattr(importlib.import_module(module), fn)


def child_pythonpath(env: dict) -> str:
    """The repository first on the path: mgrpo and its launchers from this tree, and the `benchmarks` package (a
    child runs as `python -m benchmarks...`, from its own working folder)."""
    return os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])


def dumps(w: Workload) -> str:
    return json.dumps(w.to_dict())
