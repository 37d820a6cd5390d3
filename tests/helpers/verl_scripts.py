"""Run veRL's own example scripts (tests/data/verl_scripts/) with bash and record the command line they give
veRL's trainer: `python3` (and `ray`, `conda`, `python`) on PATH are stand-ins, so the shell expands the
script's variables, quotes and defaults exactly as it would on a cluster, and nothing of veRL runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


SCRIPTS = Path(__file__).resolve().parent.parent / "data" / "verl_scripts"
ENTRY_POINTS = ("verl.trainer.main_ppo", "recipe.dapo.main_dapo")

# python3 -m <veRL entry point> ARGS...: ARGS go to $VERL_ARGV_OUT, one per NUL-terminated record.
PYTHON3 = """#!/bin/bash
if [ "$1" = "-m" ] && { [ "$2" = "verl.trainer.main_ppo" ] || [ "$2" = "recipe.dapo.main_dapo" ]; }; then
    shift 2
    printf '%s\\0' "$@" > "$VERL_ARGV_OUT"
    exit 0
fi
echo "stand-in python3: not a veRL trainer command: $*" >&2
exit 1
"""
# `ray job submit [options] -- COMMAND...` runs COMMAND here.
RAY = """#!/bin/bash
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
[ "$1" = "--" ] || { echo "stand-in ray: no '--' command" >&2; exit 1; }
shift
exec "$@"
"""
NOOP = "#!/bin/bash\nexit 0\n"  # conda (activation), python (dataset preparation)


def verl_argv(name: str, tmp: Path, *args: str, **env: str) -> list[str]:
    """The arguments script `name` passes to veRL's trainer (after `python3 -m <entry point>`); `args` are the
    script's own (what its `$@` forwards)."""
    shims = tmp / "verl-shims"
    shims.mkdir(exist_ok=True)
    for tool, text in (("python3", PYTHON3), ("ray", RAY), ("conda", NOOP), ("python", NOOP)):
        (shims / tool).write_text(text)
        (shims / tool).chmod(0o755)
    out = tmp / f"{name}.argv"
    run_env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(tmp / "home"), "VERL_ARGV_OUT": str(out), **env}
    proc = subprocess.run(["bash", str(SCRIPTS / name), *args], env=run_env, cwd=tmp, capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"bash {name} exited with {proc.returncode} without reaching veRL's trainer:\n"
                             f"{proc.stderr[-3000:]}")
    return out.read_text().split("\0")[:-1]


def replace_args(argv: list[str], changes: dict[str, str | None]) -> list[str]:
    """argv with the arguments whose key (before '=', '+' removed) is in `changes` replaced by key=value, or
    dropped where the value is None; every key in `changes` must be on the line."""
    out, seen = [], set()
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+")
        if key in changes:
            seen.add(key)
            if changes[key] is not None:
                out.append(f"{key}={changes[key]}")
        else:
            out.append(arg)
    missing = set(changes) - seen
    assert not missing, f"not on the line: {sorted(missing)}"
    return out


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()}


# Qwen/Qwen3-8B config.json (architecture fields as published on the Hub).
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
