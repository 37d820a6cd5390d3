"""The tree is the architecture: imports point one way, toward the leaves (docs/architecture.md).

Every import statement of every module under mgrpo/ and kernels/ (including the ones inside functions, which
is where the heavy ones live) is read with `ast`, never executed, and placed on the floor of its room. An
import from a room on a higher floor, or from another room on the same floor, is an upward or sideways arrow
and fails here, naming the module and the import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FLOORS = {
    # the floor: what everything may use
    "config": 0, "net": 0, "heap": 0,
    # rooms that implement one thing each, on config alone
    "data": 1, "rewards": 1, "algorithms": 1, "models": 1, "kernels": 1, "observe": 1,
    # a Megatron rank's work; the rollout engines; the other projects' front doors; the memory planner
    "training": 2, "rollout": 2, "compat": 2, "plan": 2,
    # the driver: one step's samples, and the processes (Ray) that run the ranks and engines
    "experience": 3, "cluster": 3,
    # the mismatch doctor: builds both models and reads run folders, never Ray
    "doctor": 3,
    # the parts the loop assembles; the checks before anything starts
    "components": 4, "preflight": 4,
    "loop": 5,
}
"""Room -> floor. A room may import its own modules and rooms on lower floors only."""

MAX_LINES = 450


def _modules():
    for top, package in (("mgrpo", "mgrpo"), ("kernels", "mgrpo_kernels")):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT / top).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield path, ".".join([package, *parts]), path.name == "__init__.py"


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "mgrpo_kernels":
        return "kernels"
    if parts[0] != "mgrpo" or len(parts) == 1:
        return None
    return parts[1]


def imports_of(path: Path, module: str, is_package: bool) -> list[str]:
    """Absolute names of everything `path` imports (relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                out.append(".".join(base + ([node.module] if node.module else [])))
            else:
                out.append(node.module)
    return out


def test_every_room_has_a_floor():
    rooms = {room_of(m) for _, m, _ in _modules()} - {None}
    assert rooms <= set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))} (add them to FLOORS)"


def test_imports_point_toward_the_leaves():
    wrong = []
    for path, module, is_package in _modules():
        src = room_of(module)
        for name in imports_of(path, module, is_package):
            dst = room_of(name)
            if dst is None or dst == src or src is None:
                continue
            if FLOORS[dst] >= FLOORS[src]:
                kind = "upward" if FLOORS[dst] > FLOORS[src] else "sideways"
                wrong.append(f"{module} ({src}, floor {FLOORS[src]}) imports {name} ({dst}, floor {FLOORS[dst]}): "
                             f"{kind}")
    assert not wrong, "\n".join(wrong)


def test_config_imports_only_the_standard_library_hydra_and_itself():
    allowed = set(sys.stdlib_module_names) | {"hydra", "omegaconf", "__future__"}
    wrong = []
    for path, module, is_package in _modules():
        if room_of(module) != "config":
            continue
        for name in imports_of(path, module, is_package):
            if not (name.split(".")[0] in allowed or name == "mgrpo.config" or name.startswith("mgrpo.config.")):
                wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_only_the_cluster_room_talks_to_ray():
    """Process groups and Ray placement stay out of models, algorithms, training and rollout."""
    wrong = [f"{module} imports {name}" for path, module, pkg in _modules() if room_of(module) != "cluster"
             for name in imports_of(path, module, pkg) if name.split(".")[0] == "ray"]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("top", ["mgrpo", "kernels"])
def test_modules_stay_small(top):
    big = {str(p.relative_to(ROOT)): n for p in (ROOT / top).rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by idea): {big}"


def test_the_walk_sees_function_level_imports():
    """The premise of the checks above: an import inside a function is found (the heavy ones live there)."""
    names = imports_of(ROOT / "mgrpo" / "loop.py", "mgrpo.loop", False)
    assert "mgrpo.components.assemble" in names and "mgrpo.preflight" in names
    assert "mgrpo.cluster.megatron_group" in imports_of(ROOT / "mgrpo" / "components" / "assemble.py",
                                                        "mgrpo.components.assemble", False)
