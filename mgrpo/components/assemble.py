"""Assembling a run's parts, in the order that fails fastest, and taking them down again.

1. Data and judges: an unknown data_source or a bad record fails before any process starts.
2. The initial weights every process starts from.
3. Placement (Ray and its bundles), the Megatron ranks' processes, the rollout engines (colocated ones
   take their accelerator memory before the trainer builds its model), then the Megatron stages.
4. Resume: the checkpoint's weights, optimizer, data position and driver state; the engines are
   brought to the checkpoint's weight version.
5. The experience maker and evaluator over the data, judges and engines; the observer, which drops records a
   previous attempt logged after the resumed step.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from mgrpo.components.checkpoint import Checkpointer, RunState
from mgrpo.components.run_folder import Decision, RunFolder, fingerprint
from mgrpo.config import Layout, MGRPOConfig

if TYPE_CHECKING:
    # cluster imports Ray, and the step's parts numpy and their libraries, which the driver loads only when a run
    # starts (build); none of them imports torch (the driver stays torch-free: tests/repo/test_driver_imports.py)
    from mgrpo.cluster.placement import Placement
    from mgrpo.components.actor_client import ActorClient
    from mgrpo.components.evaluator import Evaluator
    from mgrpo.components.experience_maker import ExperienceMaker
    from mgrpo.components.logprob_guard import LogprobGuard
    from mgrpo.components.observer import Observer
    from mgrpo.components.weight_sync import WeightSync

log = logging.getLogger("mgrpo")


@dataclass
class Parts:
    """What a running Trainer holds (each with one job), and how to take it down."""

    experiences: ExperienceMaker
    """Prompts -> judged samples: training data, judges, rollout engines (and the async producer)."""
    actor: ActorClient
    """The actor and its frozen reference on the Megatron ranks."""
    weights: WeightSync
    checkpointer: Checkpointer
    evaluator: Evaluator
    observer: Observer
    placement: Placement
    """The Ray bundles."""
    state: RunState
    """The driver's progress, restored from the checkpoint it resumed from (fresh otherwise)."""
    total_steps: int
    guard: LogprobGuard
    """Stops a run whose engine and trainer log-probs disagree (trainer.max_logprob_diff)."""

    def close(self) -> None:
        self.experiences.close()  # the asynchronous producer stops before its engines go
        close(self.observer, self.experiences.rubric, self.experiences.rollout, self.actor.group)


@dataclass
class Prepared:
    """What is known before any process starts: the data, the run's length, and what the run folder says."""

    tokenizer: object
    train_data: object
    val_data: object
    total_steps: int
    checkpointer: Checkpointer
    decision: Decision
    tools: object = None
    """rollout.multi_turn: the run's `mgrpo.agent.tools.ToolSet`, else None."""
    """Continue from a checkpoint, start at step 0, or nothing to do (components/run_folder.py)."""


def config_yaml(cfg: MGRPOConfig) -> str:
    """The whole config as `mgrpo-train --cfg job` prints it (for TensorBoard's Text tab), a literal
    rollout.api_key left out (auto, none and env:<VARIABLE> name no secret)."""
    from omegaconf import OmegaConf

    tree = asdict(cfg)
    key = str(tree["rollout"]["api_key"])
    if key not in ("auto", "none") and not key.startswith("env:"):
        tree["rollout"]["api_key"] = "<a key of your own, not shown>"
    return OmegaConf.to_yaml(OmegaConf.create(tree))


def write_config(run_dir: str, cfg: MGRPOConfig) -> str:
    """<run_dir>/config.yaml: the whole config of this attempt (`config_yaml`), written whole or not at all."""
    path = os.path.join(run_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:
        f.write(config_yaml(cfg))
    os.replace(path + ".tmp", path)
    return path


def prepare(cfg: MGRPOConfig, run_dir: str) -> Prepared:
    """Data first (a bad record or an unknown data_source fails here, naming file:line:field), then the run
    folder's verdict: a folder holding another run is refused here too, before Ray or any worker starts."""
    from mgrpo.data import PromptDataset, check_vocab, load_tokenizer
    from mgrpo.rewards import check_data_sources

    tokenizer = load_tokenizer(cfg.model)
    check_vocab(tokenizer, cfg.model)
    tools = tools_for = None
    if cfg.rollout.multi_turn.enable:
        from mgrpo.agent.parse import call_cannot_fit
        from mgrpo.agent.tools import ToolSet, function_tools_strict

        mt = cfg.rollout.multi_turn
        tools = ToolSet.from_config(list(mt.function_tools), mt.tool_config_path,
                                    function_tools_strict(mt.tool_choice, mt.required_per_group,
                                                          mt.strict_function_tools))
        tools_for = lambda extra, where: tools.schemas(tools.for_record(extra, where))  # noqa: E731
        cannot_fit = call_cannot_fit(mt, tools, tokenizer, cfg.data.max_response_length)
        if cannot_fit:  # said before Ray starts, not after a minute of start-up
            log.warning(cannot_fit)
    train_data = PromptDataset(cfg.data, tokenizer, cfg.data.train_files, split="train", tools_for=tools_for)
    val_data = PromptDataset(cfg.data, tokenizer, cfg.data.val_files, split="val", tools_for=tools_for)
    check_data_sources(train_data.data_sources() | val_data.data_sources(), cfg.reward,
                       samples={**val_data.samples(), **train_data.samples()})
    os.makedirs(run_dir, exist_ok=True)
    t = cfg.trainer
    total_steps = t.total_training_steps if t.total_training_steps is not None else \
        t.total_epochs * train_data.batches_per_epoch()
    checkpointer = Checkpointer(run_dir, t, fingerprint=fingerprint(cfg), total_steps=total_steps)
    latest = checkpointer.resume_dir()
    saved = checkpointer.read_state(latest) if latest is not None else None  # a broken checkpoint fails here
    decision = RunFolder(run_dir, cfg).decide(latest, saved, total_steps)
    if not decision.finished:  # the run folder says what started it, as veRL's and Hydra's runs do
        write_config(run_dir, cfg)
    return Prepared(tokenizer, train_data, val_data, total_steps, checkpointer, decision, tools)


def build(cfg: MGRPOConfig, layout: Layout, run_dir: str, prepared: Prepared) -> Parts:
    """Start every process of the run (Ray, Megatron ranks, engines, judges) and restore the checkpoint the
    run folder's decision names. Each start-up phase logs one line with its time."""
    from mgrpo.cluster.placement import engine_gpu_ids, place

    p, t = prepared, cfg.trainer
    tokenizer, total_steps, checkpointer, resume_dir = p.tokenizer, p.total_steps, p.checkpointer, p.decision.resume_dir
    rubric = group = rollout = early = teacher = None
    phase = _Phases()
    engine_pool = ThreadPoolExecutor(1, thread_name_prefix="mgrpo-engines")
    try:
        with phase("Ray placement + initial weights"), ThreadPoolExecutor(1, thread_name_prefix="mgrpo-init") as pool:
            # While ray.init waits for the processes it starts: the initial weights (a check of config.json, or a
            # seeded init written with torch and transformers; ~1 s) and the modules of the run's parts (no torch):
            # both off the path to the first step.
            weights = pool.submit(initial_weights, cfg, run_dir, tokenizer)
            modules = pool.submit(_import_parts)
            placement = place(cfg, layout)
            init_dir = weights.result()
            modules.result()
        from mgrpo.cluster.megatron_group import MegatronGroup
        from mgrpo.cluster.rollout_group import RolloutGroup
        from mgrpo.components.actor_client import ActorClient
        from mgrpo.components.evaluator import Evaluator
        from mgrpo.components.experience_maker import ExperienceMaker
        from mgrpo.components.logprob_guard import LogprobGuard
        from mgrpo.cluster.aux_engines import RewardEngines
        from mgrpo.components.observer import Observer, log_token_logprobs
        from mgrpo.components.weight_sync import WeightSync
        from mgrpo.rewards import build_rubric
        from mgrpo.rollout.factory import EngineContext

        eos = [tokenizer.eos_token_id]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        context = EngineContext(eos_token_ids=eos, pad_token_id=pad, log_dir=os.path.join(run_dir, "logs"))
        engines = f"{cfg.rollout.num_engines} rollout engine(s) ({cfg.rollout.engine}, {cfg.rollout.mode})"
        # Engines in processes of their own that take no accelerator memory from the ranks start with the ranks'
        # processes and go on while the ranks build their Megatron stages: the longest start-up phases, on
        # different processes (the default job: 9.5 s and 5.0 s one after the other, then the rank processes'
        # 1.3 s before the engines). Engines on the ranks' accelerators take their memory first; a hybrid engine
        # is built in its rank's process before the stages (its transformers import comes after
        # cpu_compat.lean_megatron_import, as the rank's __init__ says).
        alongside = not placement.hybrid and not placement.engines_use_actor_gpus
        devices = hosts = None
        if alongside:
            engines_from = time.perf_counter()
            early = engine_pool.submit(RolloutGroup, cfg, placement, hf_dir=init_dir, context=context)
        with phase(f"{layout.megatron_world} Megatron rank process(es)"):
            group = MegatronGroup(cfg, layout, placement, init_hf_dir=init_dir, total_steps=total_steps,
                                  need_ref=cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)
        stages = f"Megatron stages (tp={cfg.actor.tp} pp={cfg.actor.pp} cp={cfg.actor.cp} dp={layout.dp})"
        if alongside:
            stages_from = time.perf_counter()
            group.start_setup(cfg)
            with phase(engines, since=engines_from, note="started with the rank processes"):
                rollout = early.result()
        else:
            if placement.engines_use_actor_gpus:
                devices = [engine_gpu_ids(group.devices, placement.engine_ranks(i), i)
                           for i in range(cfg.rollout.num_engines)]
            if placement.hybrid:  # engine i moves into the process of the first Megatron rank it shares
                hosts = [group.ranks[placement.engine_ranks(i)[0]] for i in range(cfg.rollout.num_engines)]
            with phase(engines):
                rollout = RolloutGroup(cfg, placement, hf_dir=init_dir, devices=devices, hosts=hosts, context=context)
        with phase(f"judges ({', '.join(['rules', *cfg.reward.models])})"):  # reward models: the run's key
            rubric = build_rubric(cfg.reward, engines=RewardEngines(), api_key=rollout.api_key,
                                  log_dir=os.path.join(run_dir, "logs"), placement=placement, cpus=t.cpus_per_worker,
                                  shared_devices=devices or [a["gpu_ids"] for a in rollout.addresses])
        if alongside:
            with phase(stages, since=stages_from, note="built alongside the engines"):
                group.finish_setup()
        else:
            with phase(stages):
                group.setup(cfg)
        log.info("start | Megatron ranks use: %s", group.info[0].get("paths", "?"))
        if cfg.teacher.hf_path and cfg.teacher.mode == "sglang":  # on-policy distillation's teacher engines
            from mgrpo.components.teacher import SGLangTeacher

            with phase(f"{cfg.teacher.num_engines} SGLang teacher engine(s) ({cfg.teacher.hf_path})"):
                teacher = SGLangTeacher(cfg, api_key=rollout.api_key, log_dir=os.path.join(run_dir, "logs"),
                                        cpus=t.cpus_per_worker)
        actor = ActorClient(group, cfg, layout.dp, teacher=teacher)
        weights = WeightSync(cfg.rollout, actor, rollout, adapters=adapter_sync(cfg))
        state = RunState()
        if resume_dir is not None:
            with phase(f"resume from {resume_dir}"):
                state = checkpointer.restore(resume_dir, actor, p.train_data)
                weights.sync(state.weight_version)  # engines started from the initial weights
        experiences = ExperienceMaker(cfg, tokenizer=tokenizer, train_data=p.train_data, rubric=rubric,
                                      rollout=rollout, tools=p.tools)
        evaluator = Evaluator(cfg.evaluation, test_freq=t.test_freq, val_before_train=t.val_before_train,
                              seed=t.seed, max_response_length=cfg.data.max_response_length, val_data=p.val_data,
                              experiences=experiences, stop=cfg.rollout.stop, stop_regex=cfg.rollout.stop_regex)
        observer = Observer(run_dir, t, total_steps=total_steps,
                            resume_step=state.step if resume_dir is not None else None,
                            token_logprobs=log_token_logprobs(cfg), config_text=config_yaml(cfg),
                            multi_turn=cfg.rollout.multi_turn.enable)
    except BaseException:
        if rollout is None and early is not None:  # engines started beside a failed step: taken down too
            with contextlib.suppress(BaseException):
                rollout = early.result()
        if teacher is not None:
            teacher.close()
        close(None, rubric, rollout, group)
        raise
    finally:
        engine_pool.shutdown(wait=False)
    log.info("start | ready in %.1fs: run dir %s, steps %d..%d", phase.total, run_dir, state.step, total_steps)
    return Parts(experiences, actor, weights, checkpointer, evaluator, observer, placement, state, total_steps,
                 LogprobGuard(cfg, run_dir))


class _Phases:
    """`with phase(name):` logs 'start | <name> in <seconds>' when the phase is done; `since` starts its clock
    earlier (a phase that ran alongside others, said by `note`). `total`: wall seconds since the first phase."""

    def __init__(self):
        self.total = 0.0
        self._t0: float | None = None

    @contextlib.contextmanager
    def __call__(self, name: str, since: float | None = None, note: str = ""):
        t0 = time.perf_counter() if since is None else since
        if self._t0 is None:
            self._t0 = t0
        yield
        now = time.perf_counter()
        self.total = now - self._t0
        log.info("start | %s in %.1fs%s", name, now - t0, f" ({note})" if note else "")


PART_MODULES = ("mgrpo.cluster.megatron_group", "mgrpo.cluster.rollout_group", "mgrpo.components.actor_client",
                "mgrpo.components.evaluator", "mgrpo.components.experience_maker", "mgrpo.components.observer",
                "mgrpo.rewards.rubric", "mgrpo.cluster.aux_engines", "mgrpo.components.weight_sync")
"""What `build` makes the run's parts from. None imports torch: the driver's bookkeeping is numpy."""


def _import_parts() -> None:
    """Import PART_MODULES (a thread of `build`'s, while Ray starts)."""
    for name in PART_MODULES:
        importlib.import_module(name)


def adapter_sync(cfg: MGRPOConfig) -> bool:
    """Whether the engines take the LoRA adapters alone (actor.lora.sync resolved to adapter)."""
    from mgrpo.config.lora import sync_mode

    lora = cfg.actor.lora
    return lora.enabled and sync_mode(lora, engine=cfg.rollout.engine, num_experts=cfg.model.num_experts) == "adapter"


def initial_weights(cfg: MGRPOConfig, run_dir: str, tokenizer) -> str:
    """The HF directory every process starts from: the user's checkpoint, or a seeded random init
    written once per run (so every TP/PP layout and the rollout engines start identical)."""
    from mgrpo.models import check_hf_config

    m = cfg.model
    if m.hf_path:
        check_hf_config(m.hf_path, m)  # config.json alone: the driver never imports torch
        return m.hf_path
    path = os.path.join(run_dir, "init_hf")
    if not os.path.isfile(os.path.join(path, "config.json")):
        # Writing seeded random weights takes torch (and transformers' model classes) in the driver; only a run
        # without model.hf_path pays for it, in the thread beside ray.init, and writes them once per run folder.
        from mgrpo.models import init_hf_checkpoint

        init_hf_checkpoint(path, m, seed=cfg.trainer.seed, tokenizer=tokenizer)
    return path


def close(observer, rubric, rollout, group) -> None:
    """Take down whatever was built (any of them may be None after a failed start); a failure while
    shutting down is logged, never allowed to hide the failure that caused it."""
    for closer in (observer, rubric):
        if closer is not None:
            closer.close()
    for part in (rollout, group):
        if part is not None:
            try:
                part.shutdown()
            except Exception as err:
                log.warning("shutdown of %s failed: %s", type(part).__name__, err)
    from mgrpo.cluster.ray_env import stop_ray

    stop_ray()
