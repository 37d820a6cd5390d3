"""mgrpo: GRPO-family RL for Qwen3 on Megatron-Core, SGLang and Ray.

  loop.py        the GRPO loop, where every room meets (`Trainer`)
  experience.py  one step's experience on the driver: responses, scores, log-probs, advantages, mini-batches
  preflight.py   what can be known to be wrong with a run before any process starts
  heap.py        the C heap of a process that trains and generates: freed memory given back between calls
  net.py         network helpers (free ports, a node's address); standard library only
  config/        typed run configuration, closed choices, the validator
  data/          records, tokenizers, prompt batches, packing, converters
  rewards/       judgers: reward functions by data_source in isolated workers, judges, services
  algorithms/    advantages, policy losses, KL, aggregation, filtering (no process groups)
  models/        model families as megatron-core models, HF <-> Megatron weights
  training/      the Megatron ranks' code: stages, forward/loss steps, optimizer, checkpoints
  rollout/       rollout engines (in-process transformers, SGLang and its CPU server)
  agent/         multi-turn rollouts: tools, tool-call parsing, trajectories
  sandbox/       a hermetic sandbox for model-written code
  cluster/       the run's processes: Ray, placement, the Megatron ranks and engines as actors, SLURM
  components/    the parts the loop assembles: actor client, weight sync, checkpointer, observer, ...
  observe/       metrics, trajectories, timers, TensorBoard
  plan/          the memory planner
  doctor/        the engine/trainer log-prob mismatch doctor
  compat/        front doors for other projects' command lines and configs (veRL)
"""
