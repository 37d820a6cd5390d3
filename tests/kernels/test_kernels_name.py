"""The repository's kernels/ folder (installed as mgrpo_kernels) and PyPI's `kernels`, which transformers >= 5.25
imports with every model: a process started in a checkout (`python -m ...`, the repository root first on
sys.path) must get PyPI's package by that name, or fail as it would without the folder. Each case runs in a
fresh interpreter, since the name is decided once per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_transformers_models_import_in_a_checkout():
    # the failure this guards against: ImportError: cannot import name 'CUDAProperties' from 'kernels'
    # (.../kernels/__init__.py), raised by transformers' hub_kernels for every model in every `python -m` child
    out = python("import transformers.activations, transformers.models.qwen3.modeling_qwen3 as m, mgrpo_kernels\n"
                 "import kernels, sys; print(getattr(sys.modules.get('kernels'), '__file__', None))")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not out.stdout.strip().startswith(str(ROOT)), out.stdout


def test_another_kernels_package_on_the_path_gets_the_name(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'pypi'\n")
    (site / "kernels" / "utils.py").write_text("WHAT = 'submodule'\n")
    code = (f"import sys; sys.path[:] = [{str(ROOT)!r}, {str(site)!r}] + sys.path\n"
            "import kernels, kernels.utils\n"
            "print(kernels.WHO, kernels.utils.WHAT, sorted(k for k in sys.modules if k.startswith('kernels')))")
    out = python(code, "-I")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["pypi", "submodule", "['kernels',", "'kernels.utils']"], out.stdout


def test_without_another_kernels_package_the_import_fails_by_name():
    out = python(f"import sys; sys.path.insert(0, {str(ROOT)!r})\nimport kernels", "-I", "-S")
    assert out.returncode == 1
    assert "ModuleNotFoundError: No module named 'kernels'" in out.stderr and "mgrpo_kernels" in out.stderr, out.stderr
