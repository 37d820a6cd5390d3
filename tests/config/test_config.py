"""Config: Hydra composition onto the typed dataclasses, and the validator's messages."""

import dataclasses
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from mgrpo.algorithms.registry import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from mgrpo.config import ActorConfig, AlgorithmConfig, ConfigError, MGRPOConfig, RolloutConfig, layout
from mgrpo.config.choices import LogprobImpl
from mgrpo.preflight import preflight
from mgrpo_launchers.train import CONFIG_DIR, to_config


def _compose(*overrides: str) -> MGRPOConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


def test_default_composes_to_the_typed_default_job():
    cfg = _compose()
    assert isinstance(cfg, MGRPOConfig) and isinstance(cfg.actor, ActorConfig)
    assert cfg.model.vocab_size == 16 and cfg.model.tokenizer == "synthetic"
    assert cfg.trainer.device == "cpu" and cfg.rollout.engine == "sglang"  # the production rollout path, CPU server here
    preflight(cfg, check_memory=False)


def test_python_config_equals_command_line():
    """The two front doors build the same run."""
    cli = _compose("actor.lr=1e-5", "rollout.n=4", "trainer.total_training_steps=50")
    py = MGRPOConfig()
    py = dataclasses.replace(py, actor=dataclasses.replace(py.actor, lr=1e-5),
                             rollout=dataclasses.replace(py.rollout, n=4),
                             trainer=dataclasses.replace(py.trainer, total_training_steps=50, device="cpu"))
    assert cli == py


@pytest.mark.parametrize("override, error", [
    ("actor.not_a_key=1", (ConfigAttributeError, ConfigKeyError)),
    ("actor.lr=fast", ValidationError),
    ("rollout.n=eight", ValidationError),
])
def test_unknown_keys_and_wrong_types_fail_naming_the_key(override, error):
    with pytest.raises(Exception) as info:
        _compose(override)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert override.split("=")[0].split(".")[-1] in text


@pytest.mark.parametrize("changes, message", [
    ({"actor": {"tp": 3}}, "actor.tp=3 does not divide model.num_attention_heads=4"),
    ({"actor": {"pp": 3}}, "actor.pp=3 does not divide model.num_layers=2"),
    ({"actor": {"tp": 4}}, "actor.tp=4 does not divide model.num_query_groups=2"),
    ({"trainer": {"n_gpus_per_node": 3}, "actor": {"tp": 2}}, "does not divide the trainer's 3 accelerators"),
    ({"algorithm": {"adv_estimator": "ppo"}}, "algorithm.adv_estimator='ppo' is not one of"),
    ({"data": {"train_files": ["/nope.jsonl"]}}, "data.train_files[0]='/nope.jsonl' does not exist"),
    ({"data": {"synthetic_task": None}}, "data.train_files is empty and data.synthetic_task is null: give the "
     "records to train on (data.train_files=[my.jsonl]) or a built-in task (data.synthetic_task=sum)"),
    ({"rollout": {"n": 1}}, "rollout.n=1 must be at least 2"),
    ({"rollout": {"health_check_interval_s": -1.0}}, "rollout.health_check_interval_s=-1.0 and"),
    ({"trainer": {"max_ckpt_to_keep": 0}}, "trainer.max_ckpt_to_keep=0 must be at least 1"),
    ({"actor": {"ppo_mini_batch_size": 5}}, "actor.ppo_mini_batch_size=5 does not divide data.train_batch_size=32"),
    ({"rollout": {"mode": "hybrid", "async_mode": "one_step_off"}},
     "rollout.async_mode='one_step_off' overlaps generation with training, which rollout.mode=hybrid engines cannot"),
    ({"rollout": {"ep": 2}}, "rollout.ep=2: SGLang's expert-parallel size must be 1 or rollout.tp (1)"),
    ({"rollout": {"api_key": "env:MGRPO_TEST_NO_SUCH_VARIABLE"}},
     "rollout.api_key='env:MGRPO_TEST_NO_SUCH_VARIABLE': auto | none | env:<VARIABLE> (set and non-empty) | a key"),
    ({"rollout": {"mode": "hybrid", "num_engines": 2}},
     "rollout.num_engines*rollout.tp=2 exceeds the 1 accelerators (rollout.mode=hybrid: each engine lives in a Megatron rank)"),
    ({"rollout": {"top_p": 0.9}, "algorithm": {"logprob_support": "sampled"}},  # SGLang wants a finite top_k
     "algorithm.logprob_support=sampled with rollout.engine=sglang: SamplingParams.return_support with top_p=0.9 "
     "and top_k=-1: SGLang 0.5.23 returns a token's sampling support only for top_k=1 or 1 < top_k <= 4096"),
    ({"rollout": {"stop": [str(i) for i in range(33)]}}, "rollout.stop holds 33 entries; SGLang takes at most 32"),
    ({"rollout": {"stop": ["a", ""]}}, "rollout.stop[1]='' must be a non-empty string"),
    ({"rollout": {"stop_regex": ["a(?<=b+)"]}}, "rollout.stop_regex[0]='a(?<=b+)' does not compile"),
    ({"rollout": {"stop_regex": ["x" * 257]}}, "rollout.stop_regex[0] is 257 bytes; SGLang takes at most 256"),
    ({"rollout": {"stop_regex": ["[0-9]"], "num_engines": 2}},
     "rollout.stop_regex cannot go through SGLang's router, which fronts more than one engine"),
])
def test_validation_names_the_field(changes, message):
    cfg = MGRPOConfig()
    for group, fields in changes.items():
        cfg = dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **fields)})
    with pytest.raises(ConfigError) as info:
        preflight(cfg, check_memory=False)
    assert message in str(info.value)


def test_sampled_support_with_a_finite_top_k_or_another_engine_passes():
    for rollout in (RolloutConfig(top_p=0.9, top_k=5), RolloutConfig(top_p=0.9, engine="hf")):
        preflight(MGRPOConfig(rollout=rollout, algorithm=AlgorithmConfig(logprob_support="sampled")),
                  check_memory=False)


def test_stop_regex_passes_where_no_router_drops_it():
    for rollout in (RolloutConfig(stop_regex=["[0-9]"], engine="hf"),
                    RolloutConfig(stop_regex=["[0-9]"], stop=["</answer>"], num_engines=1)):
        preflight(MGRPOConfig(rollout=rollout), check_memory=False)


def test_production_rollout_modes_validate_on_cpu():
    """The SGLang path runs on CPU against the server speaking its protocol (every branch of the
    production path runs in tests; refusing it would hide its bugs), so both weight-sync modes pass
    validation on a CPU trainer."""
    for mode in ("colocated", "hybrid", "disaggregated"):
        cfg = _compose("rollout.engine=sglang", f"rollout.mode={mode}", "trainer.device=cpu",
                       "trainer.n_gpus_per_node=2" if mode == "disaggregated" else "rollout.n=8")
        preflight(cfg, check_memory=False)


def test_layout_splits_accelerators():
    cfg = _compose("actor.tp=2", "trainer.n_gpus_per_node=4")
    lay = layout(cfg)
    assert (lay.megatron_world, lay.dp) == (4, 2)
    cfg = _compose("actor.pp=2")  # n_gpus_per_node unset: exactly tp*pp*cp ranks
    assert layout(cfg).megatron_world == 2


def _algo(estimator: str, n: int) -> MGRPOConfig:
    return MGRPOConfig(algorithm=AlgorithmConfig(adv_estimator=estimator), rollout=RolloutConfig(n=n))


@pytest.fixture
def toy_estimators():
    """Two estimators registered for one test: the validator must learn of them from the registry alone."""
    ADVANTAGE_ESTIMATORS.register("toy_grouped", AdvantageEstimator("mgrpo.algorithms.advantages:grpo"))
    ADVANTAGE_ESTIMATORS.register("toy_single", AdvantageEstimator("mgrpo.algorithms.advantages:reinforce_plus_plus",
                                                                   needs_groups=False))
    yield
    ADVANTAGE_ESTIMATORS.unregister("toy_grouped")
    ADVANTAGE_ESTIMATORS.unregister("toy_single")


def test_estimator_errors_come_from_the_registry(toy_estimators):
    with pytest.raises(ConfigError) as info:
        preflight(_algo("ppo", 8), check_memory=False)
    assert (f"algorithm.adv_estimator='ppo' is not one of {list(ADVANTAGE_ESTIMATORS)}" in str(info.value)
            and "'toy_grouped', 'toy_single'" in str(info.value))
    # rollout.n=1 is refused exactly for the estimators whose entry says needs_groups
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        if name == "none":  # the teacher's term alone: refused without a teacher (tests/test_distill.py)
            continue
        preflight(_algo(name, 2), check_memory=False)
        if entry.needs_groups:
            with pytest.raises(ConfigError, match=f"rollout.n=1 must be at least 2 for "
                                                  f"algorithm.adv_estimator='{name}'"):
                preflight(_algo(name, 1), check_memory=False)
        else:
            preflight(_algo(name, 1), check_memory=False)
    assert [n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.needs_groups] == ["reinforce_plus_plus", "none",
                                                                                 "toy_single"]


def test_unknown_family_and_unregistered_estimator_are_refused():
    preflight(_algo("grpo", 2), check_memory=False)
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='toy_grouped' is not one of"):
        preflight(_algo("toy_grouped", 2), check_memory=False)  # the fixture's entries are gone again
    cfg = MGRPOConfig()
    with pytest.raises(ConfigError, match=r"model.family='llama' is not one of \['qwen3', 'qwen3_moe'\]"):
        preflight(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, family="llama")), check_memory=False)


def test_every_logprob_impl_choice_reaches_a_kernel_path():
    """actor.logprob_impl's choices are declared once (mgrpo.config.choices); each one is a path the kernel
    entry point runs (fused needs Triton on a GPU or its interpreter, and says so by name), and anything
    else is refused there too."""
    import torch

    import mgrpo_kernels

    h, w, labels = torch.randn(3, 8), torch.randn(16, 8), torch.tensor([1, 2, 3])
    for impl in LogprobImpl:
        try:
            lp, _ = mgrpo_kernels.linear_logprobs(h, w, labels, impl=impl)
        except RuntimeError as err:
            assert impl == LogprobImpl.fused and "actor.logprob_impl=fused" in str(err)
            continue
        assert torch.allclose(lp, torch.log_softmax(h @ w.T, -1).gather(1, labels[:, None])[:, 0], atol=1e-5)
    with pytest.raises(ValueError, match="actor.logprob_impl"):
        mgrpo_kernels.linear_logprobs(h, w, labels, impl="fast")


@pytest.mark.integration
def test_cli_rejects_bad_config_before_spawning_anything():
    out = subprocess.run([sys.executable, "-m", "mgrpo_launchers.train", "actor.tp=3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "actor.tp=3 does not divide model.num_attention_heads=4" in out.stderr
    assert "Ray" not in out.stdout + out.stderr.split("actor.tp=3")[0]


def test_trainer_refuses_a_run_that_cannot_fit_before_starting_anything():
    """mgrpo-train runs mgrpo-plan's memory check in Trainer(...): Qwen3-32B in fp32 on one CPU rank needs
    far more than the host has, so it is refused naming the largest term; the explicit override starts it."""
    from mgrpo.loop import Trainer

    cfg = _compose("model=qwen3-32b", "trainer.device=cpu", "model.tokenizer=synthetic")
    with pytest.raises(ConfigError, match=r"(?s)does not fit.*largest term: activations"):
        Trainer(cfg)
    ok = Trainer(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, allow_oversubscribe=True)))
    assert not ok.memory.fits


def test_a_hub_id_as_model_path_gets_the_download_command(tmp_path, monkeypatch):
    import dataclasses

    from mgrpo.config import ConfigError, MGRPOConfig, validate

    monkeypatch.chdir(tmp_path)  # no folder called Qwen/ here
    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path="Qwen/Qwen3-8B"))
    with pytest.raises(ConfigError, match=r"model.hf_path='Qwen/Qwen3-8B': no config.json there; it looks like a "
                                          r"Hugging Face hub id, .*`huggingface-cli download Qwen/Qwen3-8B --local-dir "
                                          r"DIR`, then model.hf_path=DIR"):
        validate(cfg)
