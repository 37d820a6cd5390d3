"""What several test files share; no test imports another test module (tests/conftest.py holds the fixtures).

- `convert`: small random Qwen3 checkpoints and the per-rank pieces of the conversion tests
- `distributed`: `run_ranks`, a function on N freshly spawned gloo ranks
- `kernels`: problems and one call of each log-prob / loss implementation
- `moe`: tiny Qwen3-MoE configurations and checkpoints
- `packing`: one batch of mixed lengths through the real MegatronActor in several layouts
- `plan_memory`: the memory planner against the measured peak
- `procs`: finding and killing a test's own processes
- `reward_fns`: user reward functions the end-to-end runs name by import path
- `runs`: the default job made small, run as a user runs it, and what it writes
- `sglang_cpu`: the CPU rollout server and an independent transformers reference
- `verl_scripts`: veRL's own scripts run with bash against stand-ins

`ROOT`: the checkout's root (a `Path`), wherever the test module reading it sits in tests/.
`GSM8K_RAW`: raw GSM8K (MIT) in ../shared/data/gsm8k beside the checkout, wherever the checkout is (CI clones it
elsewhere than /work/main).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GSM8K_RAW = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k"))
