"""The Megatron ranks' code: megatron-core stages, forward/loss steps, optimizer, checkpoints.

  actor.py          one Megatron rank: a stage of the actor and of the frozen reference
  parallel.py       the rank's process groups (the only place that touches megatron's parallel_state)
  rank_batch.py     what the driver sends a data-parallel rank (no torch)
  batch.py          the trainer's view of a batch: samples in, micro-batch tensors out
  forward.py        forward steps: hidden states in, log-probs and loss out
  optim.py          megatron's optimizer and the learning-rate schedule
  checkpoint.py     resumable trainer checkpoints in megatron's distributed format
  router_replay.py  routing replay on megatron-core's RouterReplay
  cpu_compat.py     megatron-core on a machine without CUDA
  spawn.py          a function on N local processes of one gloo group (no Ray)
lora.py           LoRA adapters on the actor's linears, the base frozen; merged and disabled views
offload.py        host memory for a rank's storages while the engines generate (actor.offload)
"""
