"""The tree says what it holds: test modules sit in rooms that mirror the code's packages, and each package's
`__init__.py` docstring lists its modules (its file map) exactly.

A file map entry is a line of the package docstring that starts (after indentation, a "- " and a backtick) with
a module's file name (`name.py`) or a sub-package's folder (`name/`). Every module and sub-package of the package
is an entry, and every entry is one of them."""

from __future__ import annotations

import ast
import re

from tests.helpers import ROOT

TESTS = ROOT / "tests"
PACKAGES = [ROOT / "mgrpo", ROOT / "kernels"]
ENTRY = re.compile(r"^\s*(?:-\s+)?`?([A-Za-z_]\w*(?:\.py|/))`?(?=[\s:]|$)")


def packages() -> list:
    """Every package folder under mgrpo/ and kernels/, the top ones included."""
    return sorted(p.parent for top in PACKAGES for p in top.rglob("__init__.py") if "__pycache__" not in p.parts)


def held(package) -> set[str]:
    """What a package holds: its modules' file names (not __init__.py) and its sub-packages as `name/`."""
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    subs = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    return modules | subs


def file_map(package) -> set[str]:
    """The entries of a package's file map (empty when its docstring has none)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return {m.group(1) for line in doc.splitlines() if (m := ENTRY.match(line))}


def test_no_test_module_sits_flat_in_tests():
    flat = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not flat, (f"test modules directly in tests/: {flat}; put each in the room of what it exercises "
                      "(tests/<package>/, e2e/ for whole jobs; tests/README.md lists the rooms)")


def test_every_room_is_a_package():
    # Rooms are packages (tests.<room>.test_x), so two rooms may hold modules of the same name.
    rooms = {p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}
    missing = sorted(str(r.relative_to(ROOT)) for r in rooms if not (r / "__init__.py").is_file())
    assert not missing, f"test rooms without __init__.py: {missing}"


def test_the_entry_pattern_reads_both_map_styles():
    doc = '"""x\n\n  a.py      one\n- `b.py`    two\n`c/`: three\n  d.py: four\nsee e.py and f/ in prose\n"""'
    tree = ast.parse(doc)
    lines = ast.get_docstring(tree).splitlines()
    assert {m.group(1) for line in lines if (m := ENTRY.match(line))} == {"a.py", "b.py", "c/", "d.py"}


def test_every_package_file_map_is_exact():
    wrong = []
    for package in packages():
        entries, have = file_map(package), held(package)
        name = str(package.relative_to(ROOT)) + "/__init__.py"
        if not entries:
            wrong.append(f"{name}: no file map; its docstring should list {sorted(have)}")
            continue
        if have - entries:
            wrong.append(f"{name}: not in its file map: {sorted(have - entries)}")
        if entries - have:
            wrong.append(f"{name}: in its file map but not in the package: {sorted(entries - have)}")
    assert not wrong, "\n".join(wrong)
