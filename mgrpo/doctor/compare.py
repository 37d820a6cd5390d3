"""Where two traces of one sequence part: per site relative error, a tolerance that fits the dtypes, a verdict.

Each site's error is the relative L2 error of the engine's tensor against the trainer's over the whole
sequence, ||e - t|| / ||t|| (hidden sites [positions, hidden], the logits over the real vocabulary, the
response tokens' log-probs), with the position where the two differ most.

Tolerance. What rounding alone explains depends on the coarser of the two dtypes (u = its unit roundoff,
2^-24 for float32, 2^-8 for bfloat16, 2^-11 for float16):
  - float32 on both sides: 1e-5. On CPU both sides run the same torch kernels and every hidden site agrees
    bit for bit (measured on 4-layer models of width 64 and 1024); only the log-probs differ, by 5e-8 to
    7e-8 (the trainer's chunked kernel against a full log_softmax). Different GPU kernels reorder sums:
    a dot product over K terms then differs by about u*sqrt(K), 1e-5 for K ~ 10^4..10^5 with a few layers'
    growth. 1e-5 is ~160 u.
  - bfloat16 on either side: 1e-2, ~2.5 u: one layer's inputs, weights and outputs rounded once each. The same
    4-layer models measure 1.6e-3 at the embeddings (the table rounded once), 0.7e-2 to 1.4e-2 inside the
    first layer, then growth of at most 1.8x per site to 2e-2 to 3e-2 at the last layer.
A deep bf16 model passes any fixed tolerance somewhere, so a site only counts as the place where the sides
part when it is also a step change: above the tolerance and at least JUMP times the largest error of every
site before it (and of u). A perturbed or wrongly converted layer, a wrong RoPE theta (the first attention)
are step changes from bitwise or rounding-level agreement; precision is gradual growth, no single place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from mgrpo.doctor import DoctorError

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-3}
JUMP = 4.0
"""A site parts from the ones before it when its error is at least this many times theirs (bf16 rounding
alone grows at most 1.8x from one site to the next in the measured models, 2x from u at the first attention)."""
CANONICAL = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def canonical(dtype: str) -> str:
    name = CANONICAL.get(dtype, dtype)
    if name not in UNIT_ROUNDOFF:
        raise DoctorError(f"dtype {dtype!r} is not one of {sorted(UNIT_ROUNDOFF)}")
    return name


def coarser(*dtypes: str) -> str:
    return max((canonical(d) for d in dtypes), key=lambda d: UNIT_ROUNDOFF[d])


@dataclass
class Site:
    name: str
    rel: float
    """||engine - trainer|| / ||trainer|| over the sequence."""
    max_abs: float
    worst_position: int
    """Row (sequence position; response token for log-probs) where the two differ most."""
    growth: Optional[float]
    """rel / the largest rel of the sites before (None for the first)."""


def site_error(name: str, engine: np.ndarray, trainer: np.ndarray, before: float) -> Site:
    if engine.shape != trainer.shape:
        raise DoctorError(f"{name}: the engine's tensor has shape {list(engine.shape)}, the trainer's "
                          f"{list(trainer.shape)} (not the same architecture?)")
    diff = engine - trainer
    norm = float(np.linalg.norm(trainer))
    rel = float(np.linalg.norm(diff)) / norm if norm > 0 else (0.0 if not diff.any() else float("inf"))
    rows = np.abs(diff).reshape(diff.shape[0], -1).max(axis=1) if diff.size else np.zeros(1)
    return Site(name, rel, float(np.abs(diff).max()) if diff.size else 0.0, int(rows.argmax()),
                None if before < 0 else rel / before if before > 0 else (1.0 if rel == 0 else float("inf")))


def compare(engine: dict, trainer: dict, *, engine_dtype: str, trainer_dtype: str,
            tolerance: Optional[float] = None) -> dict:
    """The verdict over the sites both traces hold, in the engine trace's order."""
    missing = [k for k in engine if k not in trainer] + [k for k in trainer if k not in engine]
    if missing:
        raise DoctorError(f"the traces do not hold the same sites: {missing[:4]} (different layer counts?)")
    dtype = coarser(engine_dtype, trainer_dtype)
    tol = TOLERANCE[dtype] if tolerance is None else tolerance
    floor = UNIT_ROUNDOFF[dtype]
    sites, worst_before = [], -1.0
    for name in engine:
        s = site_error(name, engine[name], trainer[name], worst_before)
        sites.append(s)
        worst_before = max(worst_before, s.rel)
    parts = None
    prior = 0.0
    for s in sites:
        if s.rel > tol and s.rel >= JUMP * max(prior, floor):
            parts = s
            break
        prior = max(prior, s.rel)
    over = next((s for s in sites if s.rel > tol), None)
    if parts is not None:
        kind = "parts"
    elif over is not None:
        kind = "gradual"
    else:
        kind = "agree"
    return {"kind": kind, "dtype": dtype, "tolerance": tol, "unit_roundoff": floor, "jump": JUMP,
            "parts_at": parts.name if parts else None, "first_over": over.name if over else None,
            "sites": [asdict(s) for s in sites]}


def verdict_line(c: dict, ids: Optional[list] = None, prompt_len: int = 0) -> str:
    """One line: AGREE, NO SINGLE PLACE (gradual growth) or PARTS AT <site>, with the numbers behind it."""
    sites = c["sites"]
    first, last = sites[0], sites[-1]
    if c["kind"] == "agree":
        worst = max(sites, key=lambda s: s["rel"])
        return (f"AGREE: every site within {c['tolerance']:g} ({c['dtype']}); the relative error is {first['rel']:.2e} "
                f"at {first['name']}, at most {worst['rel']:.2e} (at {worst['name']})")
    if c["kind"] == "gradual":
        big = max((s["growth"] for s in sites[1:] if s["growth"] is not None), default=1.0)
        return (f"NO SINGLE PLACE: the difference grows gradually, from {first['rel']:.2e} at {first['name']} to "
                f"{last['rel']:.2e} at {last['name']} (at most {big:.2g}x from one site to the next; above "
                f"{c['tolerance']:g} from {c['first_over']} on): rounding at {c['dtype']}, not one layer")
    s = next(s for s in sites if s["name"] == c["parts_at"])
    before = max((p["rel"] for p in sites[:sites.index(s)]), default=0.0)
    where = s["worst_position"] + (prompt_len if s["name"] == "log-probs" else 0)  # log-probs: response tokens
    pos = f"sequence position {where}" + (f" (token {ids[where]})" if ids and where < len(ids) else "")
    return (f"PARTS AT {s['name'].upper()}: relative error {s['rel']:.2e} there against at most {before:.2e} "
            f"before it (tolerance {c['tolerance']:g} for {c['dtype']}); largest at {pos}")


def render_sites(c: dict) -> str:
    out = [f"  {'site':22} {'rel. error':>11} {'max |diff|':>11} {'x before':>9}  worst at"]
    for s in c["sites"]:
        growth = "" if s["growth"] is None else ("inf" if s["growth"] == float("inf") else f"{s['growth']:.3g}")
        mark = "  <- parts here" if s["name"] == c["parts_at"] else (
            "  <- above tolerance" if s["name"] == c["first_over"] and c["kind"] == "gradual" else "")
        out.append(f"  {s['name']:22} {s['rel']:11.3e} {s['max_abs']:11.3e} {growth:>9}  {s['worst_position']}{mark}")
    return "\n".join(out)
