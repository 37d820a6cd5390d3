"""The processes of a run: Ray, its placement, the Megatron ranks and the rollout engines as actors, and SLURM.

The only room that talks to Ray (tests/repo/test_architecture.py). The memory planner is mgrpo/plan/ (no Ray, no
torch); a node's network address is mgrpo/net.py.

  ray_env.py         start (or join) the Ray cluster: a private, lean local Ray, or the SLURM job's
  placement.py       placement groups for the Megatron ranks and the rollout engines
  megatron_group.py  the Megatron ranks as Ray actors: fan-out, data-parallel shards, gathers
  engine_host.py     the process an engine lives in (its own `EngineHost` actor, or a Megatron rank)
  rollout_group.py   the engines as Ray actors: dispatch, progress, health checks, restarts, retries
  ray_nodes.py       have all of a job's nodes joined the Ray cluster (`wait_for_nodes`)
  engine_dispatch.py where the rollout group's chunks go (engines in turn, or SGLang's router), sessions' engine
  aux_engines.py     auxiliary engines (reward models, judges) hosted as rollout engines are
  ray_logs.py        the actors' output on the driver's console (a driver thread, not Ray's log monitor)
  slurm.py           SLURM allocation discovery and the command line slurm/train.sbatch uses
"""
