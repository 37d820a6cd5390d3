"""slime command lines: slime's on-policy distillation example translates into the mgrpo config it means, and
flags mgrpo cannot honour are refused by name (exit status 2, no traceback).

The line is slime's examples/on_policy_distillation/run-qwen3-8B-opd.sh (its train.py arguments, with
scripts/models/qwen3-8B.sh's MODEL_ARGS) in its --use-opd form (docs/en/advanced/on-policy-distillation.md),
the paths replaced."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
import yaml

from mgrpo.compat.slime import SlimeFlagError, translate
from mgrpo_launchers.plan import compose_config
from tests.helpers.verl_scripts import QWEN3_8B_CONFIG

OPD_LINE = """
   --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus 4
   --swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 32
   --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
   --normalization "RMSNorm" --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
   --qk-layernorm --untie-embeddings-and-output-weights
   --hf-checkpoint $MODEL --ref-load $MODEL_torch_dist --load $SAVE --save $SAVE --save-interval 20
   --prompt-data $DATA/dapo-math-17k.jsonl --input-key prompt --apply-chat-template --rollout-shuffle
   --num-rollout 3000 --rollout-batch-size 16 --n-samples-per-prompt 4 --rollout-max-response-len 16384
   --rollout-temperature 0.8 --global-batch-size 64 --balance-data
   --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
   --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
   --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
   --use-dynamic-batch-size --max-tokens-per-gpu 16384
   --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
   --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
   --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.4
   --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
   --attention-backend flash
   --use-opd --opd-type megatron --opd-kl-coef 0.5 --opd-teacher-load $TEACHER
"""


@pytest.fixture
def env(tmp_path):
    out = {"DATA": str(tmp_path / "data"), "SAVE": str(tmp_path / "run")}
    for name, width in (("MODEL", 4096), ("TEACHER", 4096)):
        folder = tmp_path / name.lower()
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**QWEN3_8B_CONFIG, "hidden_size": width}))
        out[name] = str(folder)
    return out


def argv(script: str, env: dict, drop: tuple[str, ...] = ()) -> list[str]:
    text = script
    for k, v in sorted(env.items(), key=lambda kv: -len(kv[0])):
        text = text.replace("$" + k, v)
    args = shlex.split(text)
    for flag in (f for f in drop if f in args):  # a flag and its value
        i = args.index(flag)
        del args[i:i + (1 if i + 1 == len(args) or args[i + 1].startswith("--") else 2)]
    return args


def test_slime_opd_line_composes_to_the_mgrpo_config_it_means(env):
    t = translate(argv(OPD_LINE, env))
    cfg = compose_config(t.args)
    assert (cfg.model.hf_path, cfg.model.num_layers, cfg.model.tie_word_embeddings) == (env["MODEL"], 36, False)
    assert (cfg.teacher.hf_path, cfg.teacher.mode, cfg.algorithm.opd.coef) == (env["TEACHER"], "megatron", 0.5)
    assert cfg.algorithm.opd.loss_mode == "reverse_kl" and cfg.algorithm.adv_estimator == "grpo"
    # units: 16 prompts x 4 samples per rollout, 64 samples per optimizer step = 16 prompts (one step per rollout)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size) == (16, 4, 16)
    assert (cfg.trainer.total_training_steps, cfg.trainer.save_freq, cfg.trainer.output_dir) == \
        (3000, 20, env["SAVE"])
    assert cfg.data.train_files == [env["DATA"] + "/dapo-math-17k.jsonl"] and cfg.data.apply_chat_template
    assert (cfg.actor.tp, cfg.actor.recompute, cfg.actor.max_tokens_per_gpu, cfg.actor.lr) == (2, "full", 16384, 1e-6)
    assert (cfg.actor.weight_decay, cfg.actor.adam_beta2) == (0.1, 0.98)
    assert (cfg.algorithm.use_kl_loss, cfg.algorithm.kl_coef, cfg.algorithm.entropy_coeff) == (True, 0.0, 0.0)
    # 2 trainer GPUs and 4 engine GPUs of 1 each, on one node: disaggregated engines
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.rollout.mode, cfg.rollout.num_engines) == \
        (1, 6, "disaggregated", 4)
    rows = dict(t.rows)
    assert rows["--opd-kl-coef 0.5"] == "algorithm.opd.coef=0.5"
    assert rows["--swiglu"].startswith("ignored: Qwen3's architecture")


def test_plain_and_verl_lines_are_untouched():
    line = ["actor.lr=1e-3", "actor_rollout_ref.rollout.n=5", "--cfg", "job", "--config-name=ppo_trainer"]
    t = translate(line)
    assert t.args == line and not t.rows


def test_sglang_teacher_names_the_folder_mgrpo_starts_it_from(env):
    line = ["--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "2", f"teacher.hf_path={env['TEACHER']}"]
    cfg = compose_config(translate(line).args)
    assert (cfg.teacher.mode, cfg.teacher.hf_path, cfg.algorithm.opd.coef) == ("sglang", env["TEACHER"], 2.0)
    with pytest.raises(SlimeFlagError, match="add teacher.hf_path=<the teacher's HF folder>"):
        translate(line[:-1])


@pytest.mark.parametrize("change, says", [
    ({"--opd-teacher-load": "/not/hf"}, "'/not/hf' has no config.json: mgrpo loads a teacher from a Hugging Face"),
    ({"--opd-teacher-ckpt-step": "100"}, "a Hugging Face folder has no steps"),
    ({"--opd-type": "vllm"}, "'vllm': megatron or sglang"),
    ({"--advantage-estimator": "ppo"}, "(no critic: ppo is not there)"),
    ({"--expert-tensor-parallel-size": "2"}, "mgrpo never splits experts by TP"),
    ({"--custom-rm-path": "my.reward_func"}, "set custom_reward_function.path=FILE"),
    ({"--rollout-function-path": "my.generate"}, "--rollout-function-path my.generate: no mgrpo equivalent"),
    ({"--rm-url": "http://127.0.0.1:13141/generate"}, "mgrpo starts the SGLang teacher itself: --use-opd"),
    ({"--hidden-size": "5120"}, "--hidden-size 5120 and --hf-checkpoint"),
    ({"--global-batch-size": "62"}, "62 samples per optimizer step is not a whole number of groups"),
])
def test_refusals_name_the_flag_and_the_reason(env, change, says):
    args = argv(OPD_LINE, env, drop=tuple(change))
    for flag, value in change.items():
        args += [flag, value]
    with pytest.raises(SlimeFlagError) as info:
        translate(args)
    assert says in str(info.value), str(info.value)


def test_opd_flags_need_use_opd_and_a_type(env):
    with pytest.raises(SlimeFlagError, match="--opd-kl-coef 0.5: set without --use-opd"):
        translate(["--opd-kl-coef", "0.5"])
    with pytest.raises(SlimeFlagError, match="--opd-type megatron|sglang is required with --use-opd"):
        translate(["--use-opd"])


def test_a_repeated_flag_takes_the_last_as_argparse_does(env):
    t = translate(argv(OPD_LINE, env) + ["--lr", "3e-6"])
    assert compose_config(t.args).actor.lr == 3e-6
    assert any("--lr is given more than once" in n for n in t.notes)


def test_a_line_that_sets_a_key_twice_is_refused(env):
    with pytest.raises(SlimeFlagError, match="--lr 1e-6 sets actor.lr, which the line also sets"):
        translate(["--lr", "1e-6", "actor.lr=2e-6"])


@pytest.mark.integration
def test_mgrpo_train_and_plan_take_the_slime_line(env):
    args = argv(OPD_LINE, env)
    out = subprocess.run(["mgrpo-train", *args, "--cfg", "job"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    job = yaml.safe_load(out.stdout)
    assert (job["teacher"]["hf_path"], job["algorithm"]["opd"]["coef"], job["rollout"]["num_engines"]) == \
        (env["TEACHER"], 0.5, 4)
    assert "slime command line translated" in out.stderr and "--opd-kl-coef 0.5" in out.stderr
    plan = subprocess.run(["mgrpo-plan", *args, "--json"], capture_output=True, text=True, timeout=120)
    # slime's 16384 tokens per GPU cannot hold a 16384-token response with its prompt; mgrpo validates it
    assert plan.returncode == 2 and "actor.max_tokens_per_gpu=16384 is smaller than one sequence" in plan.stderr
    args = argv(OPD_LINE, env, drop=("--max-tokens-per-gpu",)) + ["--max-tokens-per-gpu", "32768"]
    plan = subprocess.run(["mgrpo-plan", *args, "--json"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "teacher weights" in subprocess.run(["mgrpo-plan", *args], capture_output=True, text=True,
                                               timeout=120).stdout  # the planner counts the teacher
    bad = subprocess.run(["mgrpo-train", *args, "--opd-teacher-ckpt-step", "3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "a Hugging Face folder has no steps" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""
