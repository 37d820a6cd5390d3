"""The parts the GRPO loop assembles, one job each: the actor client (data-parallel sharding over the
Megatron ranks), the weight sync, the checkpointer, the observer (every run file), stop signals, and
the assembly that builds and takes them down in order.

  assemble.py           building a run's parts in the order that fails fastest, and taking them down
  run_folder.py         what trainer.resume finds in a run folder: continue, start, or nothing to do
  actor_client.py       the actor and reference on the Megatron ranks: data-parallel sharding, gathers
  experience_maker.py   prompts in, judged samples out (synchronously or from the rollout pipeline)
  rollout_pipeline.py   asynchronous rollout: the next batches generated while the current one trains
  weight_sync.py        the actor's weights, as HF tensors, into every rollout engine
  checkpoint.py         the checkpointer: save, find the latest, restore all RL state, keep the last k
  evaluator.py          validation: when it runs and what it measures (mean@n, pass@n)
  observer.py           the only writer of a run's record files (metrics, trajectories, TensorBoard)
  logprob_guard.py      stops a run whose engine and trainer log-probs disagree
  teacher.py            on-policy distillation's teacher (Megatron ranks or SGLang engines) as the loop sees it
  signals.py            stop requests (SIGUSR1, SIGTERM, SIGINT)
"""
