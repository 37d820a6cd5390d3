"""What a user coming from veRL expects of a run without asking: a checkpoint cadence that bounds what a kill
loses, one vocabulary for trainer.resume, typo suggestions by meaning; and a veRL line on a machine without a
GPU that keeps the machine's layout, or is refused in one line when it asks for one the machine cannot place."""

from __future__ import annotations

import dataclasses
import os

import pytest

from mgrpo.components.checkpoint import Checkpointer
from mgrpo.config import ConfigError, MGRPOConfig
from mgrpo.config.schema import TrainerConfig


def _saves(total: int, save_freq=None) -> list[int]:
    c = Checkpointer("/nonexistent", TrainerConfig(save_freq=save_freq), fingerprint={}, total_steps=total)
    return [s for s in range(1, total + 1) if c.due(s, total)] + ([total] if c.saves_at_end else [])


def test_the_default_cadence_saves_every_tenth_of_the_run():
    assert TrainerConfig().save_freq is None
    assert _saves(150) == list(range(15, 151, 15))  # the default job: a SIGKILL loses at most 15 steps
    assert _saves(4) == [1, 2, 3, 4]  # ceil(4 / 10) = 1
    assert _saves(25) == [3, 6, 9, 12, 15, 18, 21, 24, 25]
    assert _saves(150, -1) == [150] and _saves(150, 0) == [] and _saves(10, 4) == [4, 8, 10]


def test_the_default_cadence_keeps_the_newest_two(tmp_path):
    def kept(**trainer):
        c = Checkpointer(str(tmp_path / str(len(os.listdir(tmp_path)))), TrainerConfig(**trainer), fingerprint={},
                         total_steps=150)
        for step in range(15, 151, 15):
            os.makedirs(os.path.join(c.root, f"step_{step:06d}"))
            c._prune(keep=f"step_{step:06d}")
        return sorted(os.listdir(c.root))

    assert kept() == ["step_000135", "step_000150"]
    assert len(kept(save_freq=15)) == 10 and kept(max_ckpt_to_keep=3) == ["step_000120", "step_000135", "step_000150"]


def test_resume_has_one_vocabulary():
    from mgrpo.components import run_folder
    from mgrpo.config.validate import RESUME_MODES, field_errors

    assert RESUME_MODES == ("auto", "disable", "force")
    doc = TrainerConfig.__dataclass_fields__["resume"]
    source = open(os.path.join(os.path.dirname(run_folder.__file__), "..", "config", "schema.py")).read()
    resume_doc = source.split("    resume: str = \"auto\"\n", 1)[1].split('"""', 2)[1]
    assert doc.default == "auto" and all(f"{m} (" in resume_doc for m in RESUME_MODES)
    cfg = MGRPOConfig(trainer=TrainerConfig(resume="of"))
    assert f"trainer.resume='of' is neither one of {list(RESUME_MODES)} nor a checkpoint directory" in \
        field_errors(cfg, check_files=False)
    assert not field_errors(MGRPOConfig(trainer=TrainerConfig(resume="off")), check_files=False)  # read as disable
    words = open(run_folder.__file__).read() + open(os.path.join(os.path.dirname(run_folder.__file__),
                                                                 "checkpoint.py")).read()
    assert "trainer.resume=off" not in words and "trainer.resume=disable" in words


def test_a_typo_is_matched_by_meaning_before_spelling():
    from mgrpo_launchers.overrides import closest

    # spelled nearest to max_user_turns, meant as veRL's former max_turns: the assistant's turns
    assert closest("rollout.multi_turn.max_turns") == " (did you mean rollout.multi_turn.max_assistant_turns?)"
    assert closest("rollout.num_generations") == " (did you mean rollout.n?)"
    assert closest("rollout.multi_turn.max_user_turn") == " (did you mean rollout.multi_turn.max_user_turns?)"


VERL_CPU_LINE = ["data.train_files=task.jsonl", "custom_reward_function.path=my_reward.py",
                 "custom_reward_function.name=compute_score"]


def _machine(monkeypatch, device: str):
    import importlib

    # both packages export a function of their module's name: the modules themselves
    validate = importlib.import_module("mgrpo.config.validate")
    translate_module = importlib.import_module("mgrpo.compat.verl.translate")

    monkeypatch.setattr(translate_module, "resolved_device", lambda d: device if d == "auto" else d)
    real = validate.resolved_device
    monkeypatch.setattr(validate, "resolved_device", lambda d: device if d == "auto" else real(d))


def test_a_verl_line_on_a_machine_without_gpus_keeps_its_defaults(monkeypatch):
    from mgrpo.compat.verl import translate

    _machine(monkeypatch, "cpu")
    t = translate(VERL_CPU_LINE)
    assert not [a for a in t.args if a.startswith(("cluster=", "rollout.tp=", "rollout.num_engines="))], t.args
    assert any(n.startswith("this machine has no GPU: its own defaults (cluster=local_cpu") for n in t.notes)
    assert "(veRL trains on CUDA)" not in [r[0] for r in t.rows]
    # a line that asks for GPUs gets veRL's GPU layout, machine or not (the preflight judges it)
    t = translate(VERL_CPU_LINE + ["trainer.n_gpus_per_node=8"])
    assert t.args[0] == "cluster=gpu" and "rollout.num_engines=4" in t.args and "rollout.tp=2" in t.args
    _machine(monkeypatch, "cuda")  # on a GPU machine: veRL's layout, as before
    assert translate(VERL_CPU_LINE).args[0] == "cluster=gpu"


def test_a_layout_this_machine_cannot_place_is_refused_in_one_line(monkeypatch):
    from mgrpo.config.validate import resolve_device
    from mgrpo.preflight import preflight
    from mgrpo_launchers.plan import compose_config

    gpu = compose_config(["cluster=gpu"])
    _machine(monkeypatch, "cpu")
    with pytest.raises(ConfigError) as e:
        preflight(resolve_device(gpu), check_files=False, check_memory=False)
    assert str(e.value) == ("invalid configuration: trainer.device=cuda (cluster=gpu) but this machine has no NVIDIA "
                            "GPU and trainer.ray_address names no cluster: 8 trainer rank(s) cannot be placed (use "
                            "cluster=local_cpu, or trainer.ray_address of a GPU cluster)")
    # a cluster of its own (ray_address), a plan for another machine, a CPU run: nothing to refuse here
    remote = dataclasses.replace(gpu, trainer=dataclasses.replace(gpu.trainer, ray_address="10.0.0.1:6379"))
    preflight(resolve_device(remote), check_files=False, check_memory=False)
    preflight(resolve_device(gpu), check_files=False, check_memory=False, check_placement=False)
    preflight(resolve_device(compose_config([])), check_files=False, check_memory=False)
    # a GPU machine with too few CPUs for 8 bundles of cpus_per_worker=8
    _machine(monkeypatch, "cuda")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    with pytest.raises(ConfigError, match=r"trainer.cpus_per_worker=8: the run's 8 Ray bundles \(8 trainer rank\(s\) "
                                          r"and its engines\) need 64 CPUs, this machine has 16 \(lower "
                                          r"trainer.cpus_per_worker to 2 or fewer"):
        preflight(resolve_device(gpu), check_files=False, check_memory=False)
