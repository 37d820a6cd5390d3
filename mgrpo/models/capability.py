"""Which accelerated paths this machine can take, asked at call time (never at import time).

Transformer Engine (TE) does not install on a CPU-only machine, and FP8 needs a recent GPU on top
of TE: Hopper (sm90) or Ada (sm89) for `delayed` / `tensorwise`, Hopper with CUDA >= 12.9 for
`blockwise`, Blackwell (sm100) for `mxfp8`. TE itself answers those questions with its
`check_*_support()` functions, which moved from `transformer_engine.pytorch.fp8` (TE 2.x) to
`transformer_engine.pytorch.quantization` (newer); we ask whichever module exists.

torch is imported inside the functions: the planner asks without importing torch. The FP8 formats and
recipes a config may name are declared in mgrpo.config.choices.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional

from mgrpo.config.choices import Fp8Format, Fp8Recipe, values

FP8_FORMATS = tuple(values(Fp8Format))
FP8_RECIPES = tuple(values(Fp8Recipe))

# recipe -> name of TE's support check; delayed and tensorwise only need plain FP8 GEMMs.
_TE_RECIPE_CHECK = {
    "delayed": "check_fp8_support",
    "tensorwise": "check_fp8_support",
    "blockwise": "check_fp8_block_scaling_support",
    "mxfp8": "check_mxfp8_support",
}
# The first TE version that has each recipe (megatron-core's fp8_utils.get_fp8_recipe asks the same).
_TE_MIN_VERSION = {"delayed": "1.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}


def te_importable() -> bool:
    """Transformer Engine's PyTorch extension and megatron-core's TE spec are both importable."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        from megatron.core.models.gpt import gpt_layer_specs

        return bool(getattr(gpt_layer_specs, "HAVE_TE", False))
    except ImportError:
        return False


def te_available() -> bool:
    """The Transformer Engine layer spec can run here: TE importable and a CUDA device present."""
    import torch

    return torch.cuda.is_available() and te_importable()


def resolve_use_te(use_te: Optional[bool], *, use_cpu: bool = False) -> bool:
    """None -> whether TE can run here; True where it cannot -> ValueError."""
    import torch

    if use_te is None:
        return (not use_cpu) and te_available()
    if use_te and not te_available():
        raise ValueError("use_te=True needs Transformer Engine importable and a CUDA GPU; this machine has "
                         f"cuda={torch.cuda.is_available()}, transformer_engine={te_importable()}")
    return bool(use_te)


def _te_support_fn(name: str):
    for module in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            fn = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    return None


def fp8_support(recipe: str) -> tuple[bool, str]:
    """(supported, reason) for running FP8 with `recipe` on this machine."""
    import torch

    if recipe not in FP8_RECIPES:
        return False, f"unknown FP8 recipe {recipe!r}; expected one of {list(FP8_RECIPES)}"
    if not torch.cuda.is_available():
        return False, "FP8 needs a CUDA GPU and none is present"
    if not te_importable():
        return False, "FP8 needs Transformer Engine (pip install 'transformer-engine[pytorch]'), which is not importable"
    from megatron.core.utils import is_te_min_version

    if not is_te_min_version(_TE_MIN_VERSION[recipe]):
        return False, f"FP8 recipe {recipe!r} needs Transformer Engine >= {_TE_MIN_VERSION[recipe]}"
    check = _te_support_fn(_TE_RECIPE_CHECK[recipe])
    if check is None:
        return False, f"this Transformer Engine has no {_TE_RECIPE_CHECK[recipe]}() for recipe {recipe!r}"
    ok, reason = check()
    return bool(ok), str(reason or "")


def require_fp8(fp8: str, recipe: str) -> None:
    """Raise a ValueError naming the missing capability when FP8 cannot run here."""
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8={fp8!r} is not one of {list(FP8_FORMATS)}")
    ok, reason = fp8_support(recipe)
    if not ok:
        raise ValueError(f"fp8={fp8!r} with fp8_recipe={recipe!r} cannot run on this machine: {reason}")


def fused_paths(*, use_te: bool, logprob_impl: str, fp8: Optional[str] = None, adam_fused: bool = False) -> str:
    """One line naming the accelerated paths a Megatron rank runs (printed at start-up in place of megatron's
    one-warning-per-module 'Transformer Engine and Apex are not installed'). Asks megatron-core what it
    picked: its optimizer module falls back from TE's to apex's to torch's Adam at import. `adam_fused`: torch's
    Adam runs its fused kernel (training/optim.py::use_fused_torch_adam)."""
    import megatron.core.optimizer as mcore_optimizer

    adam = mcore_optimizer.Adam
    apex = importlib.util.find_spec("apex") is not None
    parts = [
        "Transformer Engine layer spec (fused norms, TE attention)" if use_te else
        "megatron's local layer spec (torch norms, mgrpo's core attention over torch SDPA)",
        f"{adam.__module__}.{adam.__name__} optimizer" + (" (torch's fused kernel)" if adam_fused else ""),
        f"{'apex' if apex else 'torch'} multi-tensor grad utilities",
        f"log-prob kernel {logprob_impl}",
    ]
    if fp8:
        parts.append(f"FP8 {fp8}")
    if not use_te and not apex:
        parts.append("(Transformer Engine and apex not installed here)")
    return "; ".join(parts)
