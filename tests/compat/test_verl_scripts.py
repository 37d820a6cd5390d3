"""veRL's own example scripts through both front doors, `mgrpo-plan` and `mgrpo-train --cfg job`.

Five scripts of different kinds are stored verbatim under tests/data/verl_scripts/ (source and commit in
their headers): FSDP GRPO (run_qwen3-8b.sh), Megatron GRPO with --config-path/--config-name
(run_qwen2-7b_math_megatron.sh), DAPO on 16 nodes (the recipe's run_dapo_qwen2.5_32b.sh, through `ray job
submit`), GSPO as a SLURM batch script on 2 nodes (test_gspo_3b_math.sh), and Qwen3-MoE on Megatron with expert
parallelism and DAPO's current overlong keys (run_qwen3moe-30b_megatron_96gb.sh). bash runs each with
stand-ins for python3/ray/conda (tests/helpers/verl_scripts.py), which gives the exact argument list veRL's trainer
would get.

Each line, as the script writes it, is refused by both doors with the same list of keys, each named with its
reason (exit 2, no argparse error, no traceback). Then the keys a user would change for mgrpo are changed (the
rollout engine, offloading, the model), and the line composes: every veRL key has a row in the translation
table (or is a key both projects spell the same, composed to the line's value), the table is the same from
both doors, and the config holds the values the script asks for, key by key, including the step count
(total_epochs honoured), the number of rollout engines (veRL's GPUs x nodes / rollout TP) and DAPO's overlong
buffer."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any, Optional

import shutil

import pytest
import yaml

from mgrpo.compat.verl.translate import schema_keys
from tests.helpers.verl_scripts import QWEN3_8B_CONFIG
from tests.helpers.verl_scripts import SCRIPTS, replace_args, verl_argv

A, R, F, M = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref.",
              "actor_rollout_ref.model.")
QWEN3_30B_A3B_CONFIG = {  # the released config.json's architecture fields (configs/model/qwen3-30b-a3b.yaml)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# Hub models of the scripts: only what the translation reads (model_type and, for Qwen3, the architecture).
HUB = {
    "Qwen/Qwen3-8B": QWEN3_8B_CONFIG,
    "Qwen/Qwen2-7B-Instruct": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "Qwen/Qwen2.5-3B-Instruct": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "Qwen/Qwen3-30B-A3B-Base": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
    "Qwen/Qwen3-4B": {  # the released config.json's architecture fields
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
        "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"},
}


@pytest.fixture
def hub(tmp_path):
    """A Hugging Face cache holding the config.json of the scripts' hub models, a local Qwen3-8B directory
    (what a user points model.path at) and the DAPO script's default $HOME/verl/models/Qwen2.5-32B."""
    cache = tmp_path / "hf-cache"
    for repo, config in HUB.items():
        snap = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / "0123abcd"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
    local = tmp_path / "Qwen3-8B"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    moe = tmp_path / "Qwen3-30B-A3B"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    qwen25 = tmp_path / "home" / "verl" / "models" / "Qwen2.5-32B"
    qwen25.mkdir(parents=True)
    (qwen25 / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    # the multi-turn script runs from veRL's checkout and names its YAML files under examples/
    shutil.copytree(SCRIPTS / "examples", tmp_path / "examples")
    return {"tmp": tmp_path, "HF_HUB_CACHE": str(cache), "qwen3": str(local), "qwen3moe": str(moe),
            "snapshot": str(cache / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abcd")}


@dataclass
class Case:
    script: str
    refused: list[str]
    """The keys (as written, '+' included) refused on the verbatim line, in order."""
    changes: dict[str, Optional[str]]
    """What a user changes for mgrpo (key -> new value, None: drop it); '{qwen3}' is the local Qwen3-8B."""
    expect: dict[str, Any]
    """mgrpo config key -> value the changed line must compose to."""
    plan: dict[str, Any]
    """mgrpo-plan's numbers: trainer world/tp/pp/cp/dp, rollout engines and TP, steps/epochs."""
    env: dict[str, str] = field(default_factory=dict)
    """The script's environment (e.g. SLURM's)."""
    knobs: dict[str, str] = field(default_factory=dict)
    """Environment variables the script reads, set by the user for mgrpo (with `changes`)."""
    args: list[str] = field(default_factory=list)
    """What the user passes to the script (its `$@`), as veRL's newer Megatron scripts write it."""


MEGATRON_OFFLOAD = ["model_engine=megatron", A + "megatron.param_offload=True", A + "megatron.grad_offload=True",
                    A + "megatron.optimizer_offload=True", F + "megatron.param_offload=True"]
"""veRL's current Megatron command line: the engine by name and every offload on."""
EVERY_OFFLOAD = {f"actor.offload.{k}": True for k in ("params", "grads", "optimizer", "ref_params")}
CASES = [
    Case("run_qwen3-8b.sh",
         refused=[R + "name"],
         changes={R + "name": "sglang"},
         expect={"data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 1024,
                 "actor.lr": 1e-6, "actor.ppo_mini_batch_size": 256, "actor.recompute": "full", "actor.tp": 1,
                 "algorithm.adv_estimator": "grpo", "algorithm.use_kl_loss": True, "algorithm.kl_coef": 0.001,
                 "algorithm.kl_loss_type": "low_var_kl", "algorithm.entropy_coeff": 0.0,
                 "algorithm.use_kl_in_reward": False, "rollout.engine": "sglang", "rollout.tp": 2,
                 "rollout.num_engines": 4, "rollout.gpu_memory_utilization": 0.6, "rollout.n": 5,
                 "trainer.device": "cuda", "trainer.logger": ["console"], "trainer.n_gpus_per_node": 8,
                 "trainer.nnodes": 1, "trainer.save_freq": 20, "trainer.test_freq": 5, "trainer.total_epochs": 15,
                 "trainer.total_training_steps": None, "model.hf_path": "{snapshot}", "model.num_layers": 36,
                 "actor.offload.params": False, "actor.offload.grads": False, "actor.offload.optimizer": False,
                 "actor.offload.ref_params": True},
         plan={"world": 8, "tp": 1, "pp": 1, "cp": 1, "dp": 8, "engines": 4, "rollout_tp": 2, "steps": None,
               "epochs": 15}),
    Case("run_qwen2-7b_math_megatron.sh",
         refused=[M + "path", R + "name"],
         changes={M + "path": "{qwen3}", R + "name": "sglang"},
         expect={"data.train_files": ["{home}/data/gsm8k/train.parquet", "{home}/data/math/train.parquet"],
                 "data.val_files": ["{home}/data/gsm8k/test.parquet", "{home}/data/math/test.parquet"],
                 "data.max_prompt_length": 1024, "actor.tp": 2, "actor.pp": 2, "actor.ppo_mini_batch_size": 256,
                 "rollout.tp": 2, "rollout.num_engines": 4, "rollout.n": 5, "trainer.total_epochs": 15,
                 "trainer.total_training_steps": None, "model.hf_path": "{qwen3}", "trainer.save_freq": 20},
         plan={"world": 8, "tp": 2, "pp": 2, "cp": 1, "dp": 2, "engines": 4, "rollout_tp": 2, "steps": None,
               "epochs": 15}),
    Case("run_dapo_qwen2.5_32b.sh",
         refused=["data.truncation", "data.gen_batch_size", M + "path", R + "name"],
         changes={"data.truncation": "error", "data.gen_batch_size": None, R + "name": "sglang"},
         knobs={"MODEL_PATH": "{qwen3}"},  # the script's own knob for the model
         expect={"data.train_batch_size": 512, "data.max_response_length": 20480, "rollout.n": 16,
                 "algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 10,
                 "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.28, "algorithm.clip_ratio_c": 10.0,
                 "algorithm.use_kl_loss": False, "algorithm.loss_agg_mode": "token-mean",
                 "algorithm.overlong_buffer.enable": True, "algorithm.overlong_buffer.len": 4096,
                 "algorithm.overlong_buffer.penalty_factor": 1.0, "actor.lr_warmup_steps": 10,
                 "actor.weight_decay": 0.1, "actor.grad_clip": 1.0, "actor.cp": 8,
                 "actor.max_tokens_per_gpu": 22528, "rollout.tp": 4, "rollout.num_engines": 32,
                 "trainer.nnodes": 16, "trainer.total_epochs": 1, "trainer.total_training_steps": None,
                 "trainer.resume": "auto", "trainer.output_dir": "{home}/verl/ckpts/DAPO/DAPO-Qwen2.5-32B",
                 "evaluation.top_p": 0.7, "evaluation.n": 1, "model.hf_path": "{qwen3}", **EVERY_OFFLOAD},
         plan={"world": 128, "tp": 1, "pp": 1, "cp": 8, "dp": 16, "engines": 32, "rollout_tp": 4, "steps": None,
               "epochs": 1}),
    Case("test_gspo_3b_math.sh",
         refused=[R + "name", M + "path"],
         changes={R + "name": "sglang", M + "path": "{qwen3}"},
         env={"SLURM_JOB_NUM_NODES": "2"},  # a 2-node allocation
         expect={"algorithm.policy_loss": "gspo", "algorithm.loss_agg_mode": "seq-mean-token-mean",
                 "algorithm.clip_ratio_low": 0.0003, "algorithm.clip_ratio_high": 0.0004,
                 "data.train_files": ["/data/gsm8k/train.parquet"], "data.train_batch_size": 512,
                 "actor.ppo_mini_batch_size": 128, "rollout.n": 16, "rollout.tp": 1, "rollout.num_engines": 16,
                 "trainer.nnodes": 2, "trainer.total_epochs": 10, "trainer.total_training_steps": 500,
                 "actor.lr_warmup_steps": 25,  # lr_warmup_steps_ratio 0.05 x 500 steps
                 "algorithm.overlong_buffer.enable": False, "algorithm.overlong_buffer.len": 4096,
                 "trainer.val_before_train": False, **EVERY_OFFLOAD},
         plan={"world": 16, "tp": 1, "pp": 1, "cp": 1, "dp": 16, "engines": 16, "rollout_tp": 1, "steps": 500,
               "epochs": 10}),
    # Qwen3 multi-turn with veRL's GSM8K tool: multi-turn is turned on in the YAML behind --config-path/-name
    Case("run_qwen3-4b_gsm8k_multiturn.sh",
         refused=[],
         changes={},
         expect={"rollout.multi_turn.enable": True, "rollout.multi_turn.max_assistant_turns": 5,
                 "rollout.over_sample_rate": 0.1,
                 "rollout.multi_turn.tool_config_path":
                     "{tmp}/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml",
                 "data.max_prompt_length": 1024, "data.max_response_length": 1024, "data.train_batch_size": 256,
                 "rollout.n": 16, "rollout.tp": 2, "rollout.num_engines": 4, "actor.lr": 1e-6,
                 "algorithm.kl_coef": 0.001, "algorithm.kl_loss_type": "low_var_kl", "model.hf_path": "{snapshot4b}",
                 "model.tokenizer": "qwen3", "model.tie_word_embeddings": True, "trainer.total_epochs": 15,
                 "trainer.total_training_steps": None, "actor.offload.ref_params": True,
                 "actor.offload.params": False},
         plan={"world": 8, "tp": 1, "pp": 1, "cp": 1, "dp": 8, "engines": 4, "rollout_tp": 2, "steps": None,
               "epochs": 15}),
    Case("run_qwen3moe-30b_megatron_96gb.sh",
         refused=["data.truncation", M + "path", "+" + M + "override_config.model_config.max_position_embeddings",
                  *(f"+{A}optim.override_optimizer_config.{k}" for k in (
                      "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
                      "optimizer_cpu_offload")),
                  *(f"+{A}megatron.override_transformer_config.moe_{k}" for k in (
                      "token_dispatcher_type", "enable_deepep")),
                  R + "name"],
         changes={"data.truncation": "error", M + "path": "{qwen3moe}",
                  # the script's TEST_FILE names an unset $aime24_test_path: the line says data.val_files="['']"
                  "data.val_files": "{home}/verl/dataset/aime-2024.parquet",
                  M + "override_config.model_config.max_position_embeddings": None,
                  **{f"{A}optim.override_optimizer_config.{k}": None for k in (
                      "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
                      "optimizer_cpu_offload")},
                  **{f"{A}megatron.override_transformer_config.moe_{k}": None for k in (
                      "token_dispatcher_type", "enable_deepep")},
                  R + "name": "sglang"},
         expect={"actor.tp": 1, "actor.pp": 1, "actor.cp": 1, "actor.ep": 8, "model.family": "qwen3_moe",
                 "model.num_experts": 128, "rollout.tp": 4, "rollout.num_engines": 2,
                 "algorithm.clip_ratio_c": 10.0, "actor.lr_decay_style": "constant", "actor.lr_warmup_steps": 10,
                 "algorithm.overlong_buffer.enable": True, "algorithm.overlong_buffer.len": 4096,
                 "algorithm.overlong_buffer.penalty_factor": 1.0, "data.max_response_length": 8192,
                 "trainer.total_epochs": 10, "trainer.total_training_steps": None, "trainer.save_freq": 100,
                 "trainer.logger": ["console"], "actor.max_tokens_per_gpu": 10240, **EVERY_OFFLOAD},
         plan={"world": 8, "tp": 1, "pp": 1, "cp": 1, "dp": 8, "engines": 2, "rollout_tp": 4, "steps": None,
               "epochs": 10}),
    # Megatron multi-turn: multi-turn on in the YAML behind --config-path/-name (defaults: ppo_megatron_trainer),
    # the engine by name and every offload on, as veRL's current Megatron scripts pass them
    Case("run_qwen2.5-3b_megatron_gsm8k_multiturn.sh",
         # the reference's VPP equals the actor's (accepted as shared); dropped with it
         refused=[M + "path", A + "megatron.virtual_pipeline_model_parallel_size"],
         changes={M + "path": "{qwen3}", A + "megatron.virtual_pipeline_model_parallel_size": None,
                  F + "megatron.virtual_pipeline_model_parallel_size": None},
         args=MEGATRON_OFFLOAD,
         expect={"rollout.multi_turn.enable": True, "rollout.multi_turn.max_assistant_turns": 5,
                 "rollout.multi_turn.tool_config_path":
                     "{tmp}/examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml",
                 "actor.tp": 2, "actor.pp": 2, "actor.cp": 2, "actor.seed": 42, "data.train_batch_size": 1024,
                 "actor.ppo_mini_batch_size": 256, "rollout.tp": 2, "rollout.num_engines": 4, "rollout.n": 8,
                 "rollout.gpu_memory_utilization": 0.5, "rollout.mode": "colocated", "model.hf_path": "{qwen3}",
                 "trainer.total_epochs": 15, **EVERY_OFFLOAD},
         plan={"world": 8, "tp": 2, "pp": 2, "cp": 2, "dp": 1, "engines": 4, "rollout_tp": 2, "steps": None,
               "epochs": 15}),
]


def _fill(value, hub, home):
    if isinstance(value, str):
        return value.format(qwen3=hub["qwen3"], qwen3moe=hub["qwen3moe"], snapshot=hub["snapshot"], home=home,
                            tmp=hub["tmp"], snapshot4b=hub["snapshot"].replace("Qwen3-8B", "Qwen3-4B"))
    if isinstance(value, list):
        return [_fill(v, hub, home) for v in value]
    return value


def _doors(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    run = dict(capture_output=True, text=True, timeout=180, env={**os.environ, **env})
    return (subprocess.run(["mgrpo-plan", *args, "--json"], **run),
            subprocess.run(["mgrpo-train", *args, "--cfg", "job"], **run))


def _refused(stderr: str) -> list[str]:
    """The keys of the refusal list ('  - key=value: reason' lines)."""
    return [line[4:].split("=", 1)[0] for line in stderr.splitlines() if line.startswith("  - ")]


def _table(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if "veRL command line translated" in line)
    return [line for line in lines[start + 1:] if line.startswith("  ")]


def _get(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES, ids=[c.script for c in CASES])
def test_verl_script_through_both_front_doors(case: Case, hub):
    home = str(hub["tmp"] / "home")
    env = {"HF_HUB_CACHE": hub["HF_HUB_CACHE"]}
    line = verl_argv(case.script, hub["tmp"], *case.args, **{k: _fill(v, hub, home) for k, v in case.env.items()})

    # As written: both doors refuse the same keys, by name, with exit status 2 and nothing else.
    plan, train = _doors(line, env) if case.refused else (None, None)
    for door, out in (("mgrpo-plan", plan), ("mgrpo-train", train)) if case.refused else ():
        assert out.returncode == 2, (door, out.stderr[-3000:])
        assert "Traceback" not in out.stderr and "usage:" not in out.stderr and "unrecognized" not in out.stderr
        assert out.stderr.startswith(f"{door}: cannot honour these veRL keys"), out.stderr[:500]
        assert _refused(out.stderr) == case.refused, door
        assert out.stdout == ""
    if any("optimizer_cpu_offload" in k for k in case.refused):  # what to use instead is named
        assert f"use {A}megatron.optimizer_offload=True (actor.offload.optimizer" in train.stderr

    # Changed as a user would: both doors compose the same translation.
    if case.knobs:
        line = verl_argv(case.script, hub["tmp"], *case.args,
                         **{k: _fill(v, hub, home) for k, v in {**case.env, **case.knobs}.items()})
    changed = replace_args(line, {k: _fill(v, hub, home) for k, v in case.changes.items()})
    plan, train = _doors(changed, env)
    assert train.returncode == 0, train.stderr[-3000:]
    assert plan.returncode == 0, plan.stderr[-3000:]
    table = _table(train.stderr)
    assert table == _table(plan.stderr)
    job = yaml.safe_load(train.stdout)
    for key, want in case.expect.items():
        got, want = _get(job, key), _fill(want, hub, home)
        assert got == (pytest.approx(want) if isinstance(want, float) else want), key

    # Key by key: a row for every veRL key; a key both projects spell the same composes to the line's value.
    rows = {row.split(" -> ")[0].strip() for row in table}
    shared = schema_keys()
    for arg in changed:
        if arg.startswith("-"):
            assert arg in rows, arg  # --config-path / --config-name: what they are taken to mean
            continue
        key, _, value = arg.lstrip("+").partition("=")
        if arg in rows:
            continue
        assert key in shared, f"{arg}: no row in the translation table"
        composed = _get(job, key)
        assert str(composed).lower() == value.lower().strip("'\"") or composed == yaml.safe_load(value), arg

    p = json.loads(plan.stdout)
    tr, ro, b = p["trainer"], p["rollout"], p["batch"]
    assert (tr["world"], tr["tp"], tr["pp"], tr["cp"], tr["dp"]) == \
        tuple(case.plan[k] for k in ("world", "tp", "pp", "cp", "dp"))
    assert (ro["num_engines"], ro["tp"], ro["mode"]) == (case.plan["engines"], case.plan["rollout_tp"], "colocated")
    assert (b["total_training_steps"], b["total_epochs"]) == (case.plan["steps"], case.plan["epochs"])


@pytest.mark.integration
def test_reference_layout_must_equal_the_actors(hub):
    """The MoE script with only the reference's expert parallelism changed: refused by name."""
    case = next(c for c in CASES if c.script == "run_qwen3moe-30b_megatron_96gb.sh")
    home = str(hub["tmp"] / "home")
    changes = {**case.changes, F + "megatron.expert_model_parallel_size": "4"}
    line = replace_args(verl_argv(case.script, hub["tmp"]), {k: _fill(v, hub, home) for k, v in changes.items()})
    plan, train = _doors(line, {"HF_HUB_CACHE": hub["HF_HUB_CACHE"]})
    for out in (plan, train):
        assert out.returncode == 2 and _refused(out.stderr) == [F + "megatron.expert_model_parallel_size"]
        assert (f"mgrpo's reference model shares the actor's layout ({A}megatron.expert_model_parallel_size=8)"
                in out.stderr)


@pytest.mark.integration
def test_a_users_config_file_behind_config_path_is_read_key_by_key(hub, tmp_path, monkeypatch):
    """veRL's multi-turn examples turn multi-turn on in their own YAML (defaults: [ppo_trainer, _self_]): its keys
    are translated as if written before the command line, each named by file and line; the command line wins."""
    from mgrpo.compat.verl.translate import VerlKeyError, translate

    monkeypatch.setenv("HF_HUB_CACHE", hub["HF_HUB_CACHE"])
    case = next(c for c in CASES if c.script == "run_qwen3-4b_gsm8k_multiturn.sh")
    line = replace_args(verl_argv(case.script, hub["tmp"]), case.changes)
    yaml_path = hub["tmp"] / "examples" / "sglang_multiturn" / "config" / "gsm8k_multiturn_grpo.yaml"
    lines = yaml_path.read_text().splitlines()
    at = {text.strip(): i + 1 for i, text in enumerate(lines)}  # the file's own line numbers
    rows = dict(translate(line).rows)
    name = "gsm8k_multiturn_grpo.yaml"
    assert rows[f"{R}multi_turn.enable=true ({name}:{at['enable: True']})"] == "rollout.multi_turn.enable=true"
    assert rows[f"{R}multi_turn.max_assistant_turns=5 ({name}:{at['max_assistant_turns: 5']})"] == \
        "rollout.multi_turn.max_assistant_turns=5"
    assert rows[f"data.train_batch_size=256 ({name}:{at['train_batch_size: 256']})"] == \
        "superseded by the command line's data.train_batch_size"
    assert rows[f"--config-name=gsm8k_multiturn_grpo"].startswith(f"{yaml_path}: 8 keys over veRL's FSDP trainer")

    # what cannot be honoured is named by file and line; a second config in defaults is refused
    bad = tmp_path / "conf"
    bad.mkdir()
    (bad / "mine.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n"
                                   "    over_sample_rate: 0.1\n    no_such_knob: 3\n")
    with pytest.raises(VerlKeyError) as e:
        translate([f"--config-path={bad}", "--config-name=mine", "trainer.nnodes=1"])
    assert f"{R}no_such_knob=3 (mine.yaml:7): no mgrpo equivalent" in str(e.value)
    (bad / "two.yaml").write_text("defaults:\n  - ppo_trainer\n  - reward_model: my_rm\n  - _self_\n")
    with pytest.raises(VerlKeyError, match=r"two.yaml:3: defaults entry \{'reward_model': 'my_rm'\}: mgrpo composes"):
        translate([f"--config-path={bad}", "--config-name=two"])


@pytest.mark.integration
def test_megatron_multi_turn_in_verls_current_config_layout(hub):
    """The Megatron multi-turn config in veRL's current layout (defaults: ppo_trainer and `override model_engine:
    megatron`) composes to the same config as through ppo_megatron_trainer, from both doors; the engine override
    has its row, named by file and line."""
    case = next(c for c in CASES if c.script == "run_qwen2.5-3b_megatron_gsm8k_multiturn.sh")
    home = str(hub["tmp"] / "home")
    env = {"HF_HUB_CACHE": hub["HF_HUB_CACHE"]}
    line = replace_args(verl_argv(case.script, hub["tmp"], *case.args),
                        {k: _fill(v, hub, home) for k, v in case.changes.items()})
    layered = replace_args(line, {"--config-name": "gsm8k_multiturn_megatron_grpo_model_engine"})
    jobs = []
    for args in (line, layered):
        plan, train = _doors(args, env)
        assert plan.returncode == 0 and train.returncode == 0, (plan.stderr[-2000:], train.stderr[-2000:])
        assert _table(plan.stderr) == _table(train.stderr)
        jobs.append(yaml.safe_load(train.stdout))
    assert jobs[0] == jobs[1]
    rows = {k.strip(): v for k, v in (row.strip().split(" -> ", 1) for row in _table(train.stderr) if " -> " in row)}
    name = "gsm8k_multiturn_megatron_grpo_model_engine.yaml"
    assert rows[f"model_engine='megatron' ({name}:11)"] == "superseded by the command line's model_engine"
    assert rows["model_engine=megatron"] == "ignored: megatron: mgrpo trains with Megatron-Core"
    for key in ("params", "grads", "optimizer"):
        assert rows[f"{A}megatron.{key.rstrip('s') if key != 'optimizer' else key}_offload=True"] == \
            f"actor.offload.{key}=true"
    assert rows[f"{F}megatron.param_offload=True"] == "actor.offload.ref_params=true"
