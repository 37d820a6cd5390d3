"""What every GPU-check part shares: import paths, the machine's description, capability checks, and
the one way a part records its status and result files.

Each part runs in its own process (`run.py` starts them), so a CUDA fault in one cannot take the
others down; a part writes `<out>/<part>.json` whatever happens, with status
  ok       ran and every check was within tolerance
  failed   ran, but some check was out of tolerance (the JSON says which)
  error    raised (the traceback is in the JSON)
  skipped  a capability is missing here (the JSON says which, in plain words)
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bootstrap() -> None:
    """Make the working tree's kernels importable without installing it.

    The device machine gets a copy of the tree but not necessarily an install of it. Every part runs as
    `python -m benchmarks.gpu.<part>` from the repository root, so the root is already first on the
    path and `mgrpo` is found there; `mgrpo_kernels` (the import name of `kernels/`, given by
    pyproject's package-dir) is loaded from `kernels/` when no install provides it. An installed
    copy that is not this tree would run stale code, so the tree's own `kernels/` wins then too.
    """
    if "mgrpo_kernels" in sys.modules:
        return
    spec = importlib.util.find_spec("mgrpo_kernels")
    tree = REPO / "kernels"
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent == tree:
        return
    spec = importlib.util.spec_from_file_location("mgrpo_kernels", tree / "__init__.py",
                                                  submodule_search_locations=[str(tree)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mgrpo_kernels"] = module
    spec.loader.exec_module(module)


def version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) live with the kernel benchmark.
def bf16_peak(device_name: str):
    from benchmarks.peers.kernel_bench import BF16_PEAK_TFLOPS

    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in device_name), None)


def describe_machine() -> dict:
    """Device name, software versions and which optional pieces import here."""
    import torch

    cuda = torch.cuda.is_available()
    info = {
        "mode": "gpu" if cuda else "dry-run",
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "cuda": cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "megatron-core": version("megatron-core") if importable("megatron.core") else None,
        "liger-kernel": version("liger-kernel") if importable("liger_kernel") else None,
        "transformer-engine": (version("transformer-engine") or version("transformer_engine"))
        if importable("transformer_engine") else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "cpu_count": os.cpu_count(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", bf16_peak_tflops=bf16_peak(info["device"]))
    # The device machine gets a copy of the tree without .git: the caller names the commit there.
    info["git_commit"] = os.environ.get("MGRPO_COMMIT") or _git_commit()
    return info


def _git_commit():
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() + ("+dirty" if dirty else "")) if out.returncode == 0 else None


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)  # a part killed mid-write leaves the previous file, never half a file


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows may have different keys (an error row has fewer columns): the header is their union."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


# mgrpo dependencies that are not on the device machine (Ray cannot even be carried: too big); nothing the
# checks run may import them. (tensorboard is absent there too, but megatron-core imports it only inside
# try/except, so an import here proves nothing either way.)
NOT_ON_DEVICE = ("hydra", "omegaconf", "ray", "math_verify", "pyarrow")


def not_on_device_imported() -> list[str]:
    """Modules of NOT_ON_DEVICE this process has imported (must stay empty)."""
    return sorted(m for m in sys.modules if m.split(".")[0] in NOT_ON_DEVICE)


class Skip(Exception):
    """A capability this part needs is missing here; the message says which, in plain words."""


@contextmanager
def part(name: str, out: Path):
    """Run a part's body and always write `<out>/<name>.json`.

    The body gets a dict to fill: `result` (numbers), `checks` (name -> {value, tol, ok}), `files`.
    """
    out.mkdir(parents=True, exist_ok=True)
    rec = {"part": name, "status": "error", "machine": describe_machine(), "result": {}, "checks": {}, "files": []}
    t0 = time.perf_counter()
    try:
        yield rec
        rec["status"] = "ok" if all(c["ok"] for c in rec["checks"].values()) else "failed"
        if rec["status"] == "failed":
            rec["failed_checks"] = sorted(k for k, c in rec["checks"].items() if not c["ok"])
    except Skip as e:
        rec["status"], rec["reason"] = "skipped", str(e)
    except BaseException as e:  # noqa: BLE001  (recorded; run.py goes on with the next part)
        rec["status"], rec["error"] = "error", f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()
    finally:
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        rec["not_on_device_imported"] = not_on_device_imported()
        write_json(out / f"{name}.json", rec)
        print(f"[{name}] {rec['status']}" + (f": {rec.get('reason') or rec.get('error')}"
                                             if rec["status"] in ("skipped", "error") else "")
              + (f" (out of tolerance: {rec['failed_checks']})" if rec.get("failed_checks") else ""), flush=True)
    if rec["status"] == "error":
        sys.exit(1)


def check(rec: dict, name: str, value: float, tol: float, *, lower_is_better: bool = True) -> bool:
    """Record one tolerance check: value <= tol (or >= tol with lower_is_better=False). NaN fails."""
    ok = bool(value <= tol) if lower_is_better else bool(value >= tol)
    rec["checks"][name] = {"value": value, "tol": tol, "ok": ok, "rule": "<=" if lower_is_better else ">="}
    return ok


def part_args(description: str):
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True, help="folder for this part's CSV/JSON")
    ap.add_argument("--mode", choices=["gpu", "dry-run"], required=True)
    return ap
