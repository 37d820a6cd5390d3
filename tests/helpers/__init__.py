"""What several test files share; no test imports another test module (tests/conftest.py holds the fixtures).

- `agent`: a scripted 'policy' (a generate callable answering each turn from a script) and test environments
- `chaos`: the chaos harness (a seeded schedule of faults in one long run); `chaos_tools` (+ `chaos_tools.yaml`):
  the peek task's tool, made to hang when the harness asks
- `convert`: small random Qwen3 checkpoints and the per-rank pieces of the conversion tests
- `distributed`: `run_ranks`, a function on N freshly spawned gloo ranks
- `kernels`: problems and one call of each log-prob / loss implementation
- `moe`: tiny Qwen3-MoE configurations and checkpoints
- `packing`: one batch of mixed lengths through the real MegatronActor in several layouts
- `plan_memory`: the memory planner against the measured peak
- `procs`: finding and killing a test's own processes
- `reward_fns`: user reward functions the end-to-end runs name by import path
- `reward_models`: tiny random sequence classifiers saved as HF checkpoints
- `runs`: the default job made small, run as a user runs it, and what it writes
- `sandbox`: whether a sandbox level works here (skip without one, unless MGRPO_REQUIRE_SANDBOX=1)
- `sglang_cpu`: the CPU rollout server and an independent transformers reference
- `sglang_wheel`: SGLang's own finish and sampling-parameter rules, taken out of the installed wheel's files
- `verl_scripts`: veRL's own scripts run with bash against stand-ins

`ROOT`: the checkout's root (a `Path`), wherever the test module reading it sits in tests/.
`GSM8K_RAW`: raw GSM8K (MIT) in ../shared/data/gsm8k beside the checkout, wherever the checkout is (CI clones it
elsewhere than /work/main).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GSM8K_RAW = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k"))
