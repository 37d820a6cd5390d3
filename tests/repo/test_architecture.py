"""The tree is the architecture: imports point one way, toward the leaves (docs/architecture.md).

Every import statement of every module under mgrpo/ and kernels/ (including the ones inside functions, which
is where the heavy ones live) is read with `ast`, never executed, and placed on the floor of its room. An
import from a room on a higher floor, or from another room on the same floor, is an upward or sideways arrow
and fails here, naming the module and the import. Inside a room, the files' imports form no circle (a circle
means two files are one idea, or a third file is missing): it fails here, naming the files of the circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


FLOORS = {
    # the floor: what everything may use
    "config": 0, "net": 0, "heap": 0,
    # rooms that implement one thing each, on config alone
    "data": 1, "rewards": 1, "algorithms": 1, "models": 1, "kernels": 1, "observe": 1,
    # the sandbox for model-written code (standard library only)
    "sandbox": 1,
    # a Megatron rank's work; the rollout engines; the other projects' front doors; the memory planner
    "training": 2, "rollout": 2, "compat": 2, "plan": 2,
    # the driver: one step's samples, and the processes (Ray) that run the ranks and engines
    "experience": 3, "cluster": 3,
    # the mismatch doctor: builds both models and reads run folders, never Ray
    "doctor": 3,
    # multi-turn agentic rollouts: tools, SGLang's tool-call parser, chat-template suffixes (on rollout's types)
    "agent": 3,
    # the parts the loop assembles; the checks before anything starts
    "components": 4, "preflight": 4,
    "loop": 5,
}
"""Room -> floor. A room may import its own modules and rooms on lower floors only."""

MAX_LINES = 450


def _modules(root: Path = ROOT):
    for top, package in (("mgrpo", "mgrpo"), ("kernels", "mgrpo_kernels")):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root / top).with_suffix("")
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


def file_imports(path: Path, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports, at module level or inside functions: `from a import b` is
    the module a.b where that is one (a submodule), else a; `import a.b.c` the longest known prefix. Only what
    the file itself names: importing a.b also runs a/__init__.py, which is no arrow of this file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            hit = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), None)
            if hit is not None and hit != module:
                out.add(hit)
    return out


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The circles of file imports inside rooms: for each group of files that import one another round (a
    strongly connected component), its shortest circle through its first file, that file repeated at the end."""
    mods = {m: (p, pkg) for p, m, pkg in _modules(root)}
    edges = {m: sorted(d for d in file_imports(p, m, pkg, set(mods)) if room_of(d) == room_of(m) is not None)
             for m, (p, pkg) in mods.items()}

    def reach(v):
        seen, todo = set(), list(edges[v])
        while todo:
            w = todo.pop()
            if w not in seen:
                seen.add(w)
                todo += edges[w]
        return seen

    reaches = {m: reach(m) for m in mods}
    cycles, done = [], set()
    for start in sorted(mods):
        if start in done or start not in reaches[start]:
            continue
        group = {w for w in reaches[start] if start in reaches[w]}
        done |= group
        parent, queue = {start: None}, [start]
        while start not in edges[queue[0]]:  # breadth first, inside the group, back to `start`
            v = queue.pop(0)
            for w in edges[v]:
                if w in group and w not in parent:
                    parent[w] = v
                    queue.append(w)
        path, v = [start], queue[0]
        while v is not None:
            path.insert(0, v)
            v = parent[v]
        cycles.append(path)
    return cycles


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


def test_files_of_a_room_import_one_another_in_no_circle():
    cycles = import_cycles()
    assert not cycles, "import circles inside a room (split the shared part into a file both import):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def _fake_tree(tmp_path, files: dict[str, str]) -> Path:
    for rel, text in {"mgrpo/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_circle_check_finds_a_two_file_circle(tmp_path):
    """The check can fail: a.py imports b at module level, b.py imports a inside a function (where the heavy
    imports live, and where a circle hides best), through `from <package> import <module>`."""
    root = _fake_tree(tmp_path, {
        "mgrpo/fake/__init__.py": "",
        "mgrpo/fake/a.py": "from mgrpo.fake.b import helper\n",
        "mgrpo/fake/b.py": "def helper():\n    from mgrpo.fake import a\n    return a\n",
        "mgrpo/fake/c.py": "from . import a\n",  # imports into the circle, is not part of it
        "mgrpo/other/__init__.py": "from mgrpo.fake import c\n"})
    assert import_cycles(root) == [["mgrpo.fake.a", "mgrpo.fake.b", "mgrpo.fake.a"]]


def test_the_circle_check_spans_a_rooms_subpackages_and_not_other_rooms(tmp_path):
    root = _fake_tree(tmp_path, {
        "mgrpo/fake/__init__.py": "",
        "mgrpo/fake/top.py": "import mgrpo.fake.sub.deep\n",
        "mgrpo/fake/sub/__init__.py": "",
        "mgrpo/fake/sub/deep.py": "from ..top import x\n",
        "mgrpo/one.py": "import mgrpo.two\n",  # two rooms importing each other: the floors' business
        "mgrpo/two.py": "import mgrpo.one\n"})
    assert import_cycles(root) == [["mgrpo.fake.sub.deep", "mgrpo.fake.top", "mgrpo.fake.sub.deep"]]


SGLANG = "mgrpo.rollout.sglang"


def test_sglang_protocol_client_and_cpu_server_stay_apart():
    """rollout/sglang/: protocol/ imports nothing else of the folder; the CPU server (cpu/) reads protocol/ and
    never our client; the client never imports the CPU server (it launches it by module name)."""
    mods = {m: (p, pkg) for p, m, pkg in _modules()}
    wrong = []
    for m, (p, pkg) in mods.items():
        if not m.startswith(SGLANG + "."):
            continue
        part = m.split(".")[3]
        for d in file_imports(p, m, pkg, set(mods)):
            if not d.startswith(SGLANG + ".") and d != SGLANG:
                continue
            other = d.split(".")[3] if d != SGLANG else ""
            if part == "protocol" and other != "protocol":
                wrong.append(f"{m} (protocol, a leaf) imports {d}")
            elif part == "cpu" and other not in ("cpu", "protocol"):
                wrong.append(f"{m} (the CPU server) imports {d} (our client)")
            elif part not in ("cpu", "protocol") and other == "cpu":
                wrong.append(f"{m} (our client) imports {d} (the CPU server)")
    assert not wrong, "\n".join(wrong)
