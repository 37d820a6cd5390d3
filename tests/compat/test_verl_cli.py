"""veRL command lines: a real veRL GRPO example translates into the mgrpo config it means, and keys mgrpo
cannot honour are refused by name (exit status 2, no traceback).

The command lines are veRL's examples/grpo_trainer/run_qwen3-8b.sh (FSDP) and run_qwen2-7b_sgl_megatron.sh
(Megatron + SGLang) at volcengine/verl b178a3cd, copied verbatim apart from the model and data paths."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest
import yaml

from mgrpo.compat.verl import VerlKeyError, translate
from mgrpo_launchers.plan import compose_config
from tests.helpers.verl_scripts import QWEN3_8B_CONFIG

# examples/grpo_trainer/run_qwen3-8b.sh
RUN_QWEN3_8B = """
    algorithm.adv_estimator=grpo
    data.train_files=$DATA/gsm8k/train.parquet
    data.val_files=$DATA/gsm8k/test.parquet
    data.train_batch_size=1024
    data.max_prompt_length=512
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path=$MODEL
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen3_8b_function_rm'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=20
    trainer.test_freq=5
    trainer.total_epochs=15
"""

# examples/grpo_trainer/run_qwen2-7b_sgl_megatron.sh (model: Qwen3-8B instead of Qwen2-7B-Instruct)
RUN_SGL_MEGATRON = """
    --config-path=config --config-name='ppo_megatron_trainer.yaml'
    algorithm.adv_estimator=grpo
    data.train_files="['$DATA/gsm8k/train.parquet', '$DATA/math/train.parquet']"
    data.val_files="['$DATA/gsm8k/test.parquet', '$DATA/math/test.parquet']"
    data.train_batch_size=1024
    data.max_prompt_length=1024
    data.max_response_length=1024
    data.filter_overlong_prompts=True
    data.truncation='error'
    actor_rollout_ref.model.path=$MODEL
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
    actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=sglang
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    algorithm.use_kl_in_reward=False
    trainer.critic_warmup=0
    trainer.logger='["console","wandb"]'
    trainer.project_name='verl_grpo_example_gsm8k'
    trainer.experiment_name='qwen2_7b_function_rm_megatron'
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=5
    trainer.total_epochs=15
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))  # no weights: translation reads config.json only
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))  # hub ids must not resolve from a real cache
    return {"DATA": str(tmp_path / "data"), "MODEL": str(model), "HF_HUB_CACHE": str(tmp_path / "empty-hub-cache")}


def argv(script: str, env: dict, **replace: str) -> list[str]:
    """The command line as the shell would pass it (variables expanded, quotes removed)."""
    text = script
    for k, v in env.items():
        text = text.replace("$" + k, v)
    args = shlex.split(text)
    for old, new in replace.items():
        args = [new if a == old else a for a in args if not (a == old and new == "")]
    return args


def test_verl_megatron_sglang_line_composes_to_the_mgrpo_config_it_means(env):
    args = argv(RUN_SGL_MEGATRON, env, **{
        # the one key of this line mgrpo cannot honour (checked below); the rest is the veRL line
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2": ""})
    t = translate(args)
    cfg = compose_config(t.args)
    d = env["DATA"]
    assert cfg.data.train_files == [f"{d}/gsm8k/train.parquet", f"{d}/math/train.parquet"]
    assert cfg.data.val_files == [f"{d}/gsm8k/test.parquet", f"{d}/math/test.parquet"]
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, 1024, 1024)
    a, al, r, tr, m = cfg.actor, cfg.algorithm, cfg.rollout, cfg.trainer, cfg.model
    assert (a.lr, a.ppo_mini_batch_size, a.tp, a.pp) == (1e-6, 256, 4, 2)
    assert (al.adv_estimator, al.use_kl_loss, al.kl_coef, al.kl_loss_type, al.entropy_coeff, al.use_kl_in_reward) == \
        ("grpo", True, 0.001, "low_var_kl", 0.0, False)
    assert (r.engine, r.tp, r.gpu_memory_utilization, r.n) == ("sglang", 2, 0.6, 5)
    assert (tr.device, tr.n_gpus_per_node, tr.nnodes, tr.total_epochs, tr.save_freq, tr.test_freq) == \
        ("cuda", 8, 1, 15, -1, 5)
    assert tr.logger == ["console"]
    assert (tr.project_name, tr.experiment_name) == ("verl_grpo_example_gsm8k", "qwen2_7b_function_rm_megatron")
    # the architecture comes from config.json and equals mgrpo's Qwen3-8B preset
    preset = compose_config(["model=qwen3-8b"]).model
    assert m.hf_path == env["MODEL"] and m.name == "Qwen3-8B" and m.tokenizer == "qwen3"
    for f in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "head_dim",
              "ffn_hidden_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(m, f) == getattr(preset, f), f
    table = dict(t.rows)
    assert table["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"] == "actor.tp=4"
    assert table["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"].startswith("ignored: mgrpo packs")
    assert "--config-name=ppo_megatron_trainer.yaml" in table
    assert any("clip_ratio_c is unset" in n for n in t.notes)
    assert not any("use_kl_loss" in n for n in t.notes)  # the script sets it
    unset = translate(["actor_rollout_ref.actor.optim.lr=1e-6"]).notes
    assert any(n.startswith("actor_rollout_ref.actor.use_kl_loss is unset: veRL's default is false") for n in unset)


def test_plain_mgrpo_line_is_untouched():
    args = ["actor.tp=2", "rollout.n=4", "data.train_batch_size=16", "--cfg", "job", "trainer.logger=[console]"]
    t = translate(args)
    assert not t.is_verl and t.notes == []
    assert t.args == ["--cfg", "job", "actor.tp=2", "rollout.n=4", "data.train_batch_size=16", "trainer.logger=[console]"]


def test_refusals_name_every_key_with_its_reason(env):
    with pytest.raises(VerlKeyError) as info:
        translate(argv(RUN_QWEN3_8B, env, **{"actor_rollout_ref.model.path=" + env["MODEL"]:
                                            "actor_rollout_ref.model.path=Qwen/Qwen3-8B"}))
    msg = str(info.value)
    refused = [line.split(": ")[0].strip(" -") for line in msg.splitlines()[1:]]
    assert refused == ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.rollout.name=vllm"]
    assert "does not download" in msg and "use actor_rollout_ref.rollout.name=sglang" in msg


OFFLOAD = {  # every spelling of veRL's offload switches -> the actor.offload keys it sets
    "actor_rollout_ref.actor.megatron.param_offload": {"params"},
    "actor_rollout_ref.actor.megatron.grad_offload": {"grads"},
    "actor_rollout_ref.actor.megatron.optimizer_offload": {"optimizer"},
    "actor_rollout_ref.ref.megatron.param_offload": {"ref_params"},
    "actor_rollout_ref.actor.fsdp_config.param_offload": {"params", "grads"},  # FSDP moves the grads with them
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": {"optimizer"},
    "actor_rollout_ref.ref.fsdp_config.param_offload": {"ref_params"},
    "actor_rollout_ref.ref.megatron.grad_offload": set(),  # the reference has neither: accepted, named as such
    "actor_rollout_ref.ref.megatron.optimizer_offload": set(),
    "actor_rollout_ref.ref.fsdp_config.optimizer_offload": set(),
}


@pytest.mark.parametrize("key", list(OFFLOAD))
def test_every_offload_spelling_sets_its_actor_offload_keys(key):
    names = ("params", "grads", "optimizer", "ref_params")
    for value in (True, False):
        t = translate([f"{key}={value}", "model_engine=megatron"])
        o = compose_config(t.args).actor.offload
        assert {n for n in names if getattr(o, n)} == (OFFLOAD[key] if value else set()), (key, value)
        rows = dict(t.rows)
        assert rows["model_engine=megatron"] == "ignored: megatron: mgrpo trains with Megatron-Core"
        if not OFFLOAD[key]:
            assert rows[f"{key}={value}"].startswith("ignored: the reference has no ")


def test_offload_keys_still_refused_name_what_to_use_instead():
    with pytest.raises(VerlKeyError) as info:
        translate(["+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
                   "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1.0",
                   "+actor_rollout_ref.actor.optim.override_optimizer_config.some_other_knob=3",
                   "model_engine=veomni", "actor_rollout_ref.model.enable_activation_offload=True"])
    lines = str(info.value).splitlines()[1:]
    instead = "use actor_rollout_ref.actor.megatron.optimizer_offload=True (actor.offload.optimizer"
    assert [line.split("=")[0].strip(" -+") for line in lines] == [
        "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload",
        "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction",
        "actor_rollout_ref.actor.optim.override_optimizer_config.some_other_knob", "model_engine",
        "actor_rollout_ref.model.enable_activation_offload"]
    assert all(instead in line for line in lines[:3])
    assert "model_engine=megatron (or leave it out)" in lines[3] and "actor.recompute=full" in lines[4]
    # megatron's CPU optimizer left off, as veRL's default: accepted
    t = translate(["+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=False"])
    assert dict(t.rows)["+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=False"] \
        == "ignored: off: the optimizer steps on the accelerator"
    # two spellings that disagree are named together
    with pytest.raises(VerlKeyError, match="both set actor.offload.params"):
        translate(["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                   "actor_rollout_ref.actor.megatron.param_offload=False"])


def test_values_that_need_two_keys():
    t = translate(["actor_rollout_ref.actor.optim.lr=2e-6", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
                   "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "trainer.total_training_steps=50",
                   "actor_rollout_ref.actor.optim.betas=[0.9,0.999]", "actor_rollout_ref.actor.kl_loss_type=mse",
                   "actor_rollout_ref.actor.clip_ratio=0.25", "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    cfg = compose_config(t.args)
    assert cfg.actor.min_lr == pytest.approx(2e-7) and cfg.actor.lr_warmup_steps == 5
    assert (cfg.actor.adam_beta1, cfg.actor.adam_beta2) == (0.9, 0.999)
    assert cfg.algorithm.kl_loss_type == "k2"
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.25, 0.28)
    with pytest.raises(VerlKeyError, match="lr_warmup_steps_ratio=0.1: veRL multiplies"):
        translate(["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])
    with pytest.raises(VerlKeyError, match="one algorithm.kl_coef"):
        translate(["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
                   "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.01"])
    with pytest.raises(VerlKeyError, match="both set actor.grad_clip"):
        translate(["actor_rollout_ref.actor.optim.clip_grad=1.0", "actor_rollout_ref.actor.grad_clip=0.5"])
    with pytest.raises(VerlKeyError, match="both set actor.tp, to 2 and 4"):
        translate(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4", "actor.tp=2"])


@pytest.mark.integration
def test_mgrpo_train_prints_the_translation_and_composes(env):
    args = argv(RUN_SGL_MEGATRON, env, **{
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2": ""})
    out = subprocess.run(["mgrpo-train", *args, "--cfg", "job"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_CACHE": env["HF_HUB_CACHE"]})
    assert out.returncode == 0, out.stderr
    job = yaml.safe_load(out.stdout)
    assert (job["actor"]["lr"], job["actor"]["tp"], job["rollout"]["n"], job["trainer"]["device"]) == \
        (1e-6, 4, 5, "cuda")
    assert "actor_rollout_ref.rollout.n=5" in out.stderr and "-> rollout.n=5" in out.stderr


@pytest.mark.integration
def test_mgrpo_train_refuses_an_unhonourable_key_with_exit_2(env):
    args = argv(RUN_SGL_MEGATRON, env)  # keeps virtual_pipeline_model_parallel_size=2
    out = subprocess.run(["mgrpo-train", *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_CACHE": env["HF_HUB_CACHE"]})
    assert out.returncode == 2
    assert "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2: mgrpo runs the " \
           "non-interleaved 1F1B pipeline" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


# --- reward functions on the command line, as the README writes them and as veRL scripts give them ---------------
REWARD_FILE = """
def quarter(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25

def broken(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("answer")
"""
SHORT = ["trainer.total_training_steps=2", "data.train_batch_size=4", "rollout.n=2", "rollout=hf_cpu",
         "trainer.save_hf=false"]


@pytest.mark.integration
def test_readme_reward_line_trains_with_a_reward_file_and_a_broken_one_is_one_line(tmp_path):
    """`mgrpo-train 'reward.custom_functions={mgrpo/sum: my_reward.py:quarter}'` from the file's folder (no
    PYTHONPATH): every sample scores the file's 0.25, in the reward workers too. A function that raises on the
    first record is refused before Ray starts, with exit status 2 and one line naming it and the record."""
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    env = dict(os.environ)  # tmp_path is on no import path: the file is found by its name alone
    run = subprocess.run(["mgrpo-train", "reward.custom_functions={mgrpo/sum: my_reward.py:quarter}", *SHORT,
                          f"trainer.output_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert [m["critic/score/mean"] for m in steps] == [0.25, 0.25] and all(m["reward/failed"] == 0 for m in steps)

    bad = subprocess.run(["mgrpo-train", "reward.custom_functions={mgrpo/sum: my_reward.py:broken}", *SHORT,
                          f"trainer.output_dir={tmp_path / 'bad'}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert ("reward.custom_functions['mgrpo/sum']='my_reward.py:broken', called once at start on the record at "
            "<synthetic:sum>:1 with an empty response: KeyError: 'answer'") in bad.stderr


@pytest.mark.integration
def test_verl_reward_file_scores_every_data_source(tmp_path):
    """veRL's custom_reward_function.path / .name become reward.custom_functions' '*' entry (veRL's semantics:
    the file's function scores every data_source); .name defaults to veRL's compute_score."""
    reward = tmp_path / "verl_reward.py"
    reward.write_text(REWARD_FILE)
    out = subprocess.run(["mgrpo-train", f"custom_reward_function.path={reward}", "custom_reward_function.name=quarter",
                          "--cfg", "job"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["reward"]["custom_functions"] == {"*": f"{reward}:quarter"}
    assert f"custom_reward_function.path={reward} -> reward.custom_functions={{*:'{reward}:quarter'}}" in out.stderr
    out = subprocess.run(["mgrpo-train", f"custom_reward_function.path={reward}", "--cfg", "job"],
                         capture_output=True, text=True, timeout=120)
    assert yaml.safe_load(out.stdout)["reward"]["custom_functions"] == {"*": f"{reward}:compute_score"}


def test_dict_and_list_fields_take_what_users_type_on_the_command_line():
    """Hydra's struct mode refuses a dict field's new keys as unknown config keys; the front doors pass them as
    add-or-replace, in both spellings, and a misspelt field is still refused by name. One value for a list field
    is a list of one."""
    from mgrpo_launchers.overrides import check, shaped
    from mgrpo_launchers.train import CONFIG_DIR

    assert shaped(["reward.custom_functions={a: m:f}", "actor.lr=1", "reward.custom_functions.b=m:g"]) == \
        ["++reward.custom_functions={a: m:f}", "actor.lr=1", "++reward.custom_functions.b=m:g"]
    # one file for a list of files (veRL's data.train_files takes both); lists, null and quoted values as typed
    assert shaped(["data.train_files=/d/train.parquet", "data.val_files=[a.jsonl,b.jsonl]", "data.val_files=null",
                   "trainer.logger=tensorboard"]) == \
        ["data.train_files=['/d/train.parquet']", "data.val_files=[a.jsonl,b.jsonl]", "data.val_files=null",
         "trainer.logger=['tensorboard']"]
    assert compose_config(["data.train_files=/d/train.parquet"]).data.train_files == ["/d/train.parquet"]
    cfg = compose_config(["reward.custom_functions={my_source: my_reward.py:score}", "reward.custom_functions.b=m:g"])
    assert cfg.reward.custom_functions == {"my_source": "my_reward.py:score", "b": "m:g"}
    with pytest.raises(ValueError, match=r"unknown config key reward.custom_function \(did you mean "
                                         r"reward.custom_functions\?\)"):
        check(str(CONFIG_DIR), shaped(["reward.custom_function={a: m:f}"]))


# --- veRL's multi-turn GSM8K line (examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh at b178a3cd, the
# keys its gsm8k_multiturn_grpo.yaml sets written out, the model ours): rollout.over_sample_rate is honoured -------
RUN_MULTITURN = RUN_QWEN3_8B.replace("rollout.n=5", "rollout.n=16").replace("rollout.name=vllm", "rollout.name=sglang") \
    .replace("ref.fsdp_config.param_offload=True", "ref.fsdp_config.param_offload=False") + """
    data.return_raw_chat=True
    actor_rollout_ref.rollout.over_sample_rate=0.1
    actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5
    actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/peek.yaml
"""


def test_over_sample_rate_translates_and_is_validated():
    from mgrpo.config.validate import field_errors

    t = translate(["actor_rollout_ref.rollout.over_sample_rate=0.1", "actor_rollout_ref.rollout.multi_turn.enable=True",
                   "actor_rollout_ref.rollout.multi_turn.tool_config_path=configs/tools/peek.yaml"])
    cfg = compose_config(t.args)
    assert cfg.rollout.over_sample_rate == pytest.approx(0.1) and cfg.rollout.multi_turn.enable
    assert not [e for e in field_errors(cfg, check_files=False) if "over_sample_rate" in e]
    # veRL's single-turn path ignores the key; mgrpo says so instead of ignoring it, and refuses a rate of 1
    single = compose_config(translate(["actor_rollout_ref.rollout.over_sample_rate=0.1"]).args)
    assert any("rollout.over_sample_rate=0.1 cuts the long tail of multi-turn rollouts" in e
               for e in field_errors(single, check_files=False))
    whole = compose_config(translate(["actor_rollout_ref.rollout.over_sample_rate=1.0"]).args)
    assert any("rollout.over_sample_rate=1.0 must be in [0, 1)" in e for e in field_errors(whole, check_files=False))


def test_verl_interaction_keys_translate():
    """veRL's interaction config and max_user_turns (its gsm8k_multiturn_grpo_w_interaction.yaml sets both)."""
    from mgrpo.config.validate import field_errors

    path = "tests/data/verl_scripts/examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml"
    t = translate(["actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.max_user_turns=5",
                   f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={path}", "model.tokenizer=printable"])
    cfg = compose_config(t.args)
    mt = cfg.rollout.multi_turn
    assert (mt.interaction_config_path, mt.max_user_turns) == (path, 5)
    assert not [e for e in field_errors(cfg) if "multi_turn" in e]
    none = compose_config(translate(["actor_rollout_ref.rollout.multi_turn.max_user_turns=null",
                                     "actor_rollout_ref.rollout.multi_turn.interaction_config_path=null"]).args)
    assert (none.rollout.multi_turn.max_user_turns, none.rollout.multi_turn.interaction_config_path) == (0, None)
    both = compose_config(t.args + ["rollout.multi_turn.environment=tests.helpers.agent:AlwaysReply"])
    assert any("two environments for one trajectory" in e for e in field_errors(both))


@pytest.mark.integration
def test_verl_multi_turn_line_with_over_sample_rate_through_both_front_doors(env):
    args = argv(RUN_MULTITURN, env)
    run = dict(capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HUB_CACHE": env["HF_HUB_CACHE"]})
    train = subprocess.run(["mgrpo-train", *args, "--cfg", "job"], **run)
    plan = subprocess.run(["mgrpo-plan", *args, "--json"], **run)
    assert train.returncode == 0, train.stderr[-3000:]
    assert plan.returncode == 0, plan.stderr[-3000:]
    job = yaml.safe_load(train.stdout)
    assert job["rollout"]["over_sample_rate"] == pytest.approx(0.1) and job["rollout"]["multi_turn"]["enable"]
    for out in (train, plan):
        assert "actor_rollout_ref.rollout.over_sample_rate=0.1" in out.stderr
        assert "-> rollout.over_sample_rate=0.1" in out.stderr
