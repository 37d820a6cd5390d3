"""`import kernels` found this folder (the repository root on sys.path): load PyPI's `kernels` in its place."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over() -> None:
    """Replace sys.modules['kernels'] (this folder, being imported) by the installed package of that name; the
    import statement then returns the installed one. Without it installed, the import fails as it would
    without this folder."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    sys.modules.pop("kernels._pypi", None)  # this module, imported under the borrowed name
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named 'kernels' ({root}/kernels is mgrpo_kernels, not PyPI's kernels)",
                                  name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
