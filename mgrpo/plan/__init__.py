"""The memory planner: per-accelerator memory of a run, the verdict and the smallest change that fits.

No torch, no Ray, no processes: it reads the config and the model family's counts (mgrpo.models' torch-free
modules), so mgrpo-plan and the driver's preflight (`check_fits`, before anything starts) run it anywhere.

  memory.py   every term by phase (weights, grads, optimizer, reference, activations, head, sync),
              `estimate` / `estimate_stages`, `verdict`, `suggest`, `check_fits`
  activations.py  the largest micro-batch and what autograd, the backward and the head keep for it
  moe.py      the mixture-of-experts terms (MoE blocks, dispatcher buffers, EP gather, routing payload)
  lora.py     LoRA adapters' parameters per stage
  offload.py  actor.offload per phase, and the KV-cache tokens it buys the engines
  rewards.py  the reward models' engines (reward.models): accelerators, memory, whether they fit
"""
