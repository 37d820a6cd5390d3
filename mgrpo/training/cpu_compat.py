"""Run megatron-core on a machine without CUDA (development, CI, the default demo).

megatron-core assumes CUDA in a handful of places that our CPU path (local layer spec, fp32, gloo)
reaches. Each patch below redirects exactly one such assumption to the CPU and is applied only when
no CUDA device is present. Every patch names the megatron-core code it relies on (`premise`), so
`tests/training/test_cpu_compat.py` fails with the patch's name when a megatron-core upgrade moves or
removes that code, instead of failing somewhere deep inside a training step.

Checked against megatron-core 0.16.1 with torch 2.13 (CPU build), and against 0.19.2 (the newest release,
for Python 3.12; its sources import on 3.11) with `OPTIONAL_PATCHES` added.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from dataclasses import dataclass
from typing import Callable

import torch

# Modules that build tensors with a hard-coded device="cuda" on the paths we use:
#   pipeline_parallel.schedules   total_num_tokens = torch.zeros([], device="cuda") in every schedule
#   transformer.utils             get_default_causal_mask (local attention without an explicit mask)
#   optimizer.optimizer           FP32Optimizer._scale, found_inf buffers
#   optimizer.clip_grads          grad-norm accumulators
#   utils                         local_multi_tensor_l2_norm (the no-apex grad-norm fallback)
CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "ones_like", "empty_like")


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    premise: Callable[[], bool]
    """True while megatron-core still contains the CUDA-only code this patch works around."""
    apply: Callable[[], None]


def _source_has(module: str, attr: str | None, needle: str) -> bool:
    mod = importlib.import_module(module)
    obj = getattr(mod, attr) if attr else mod
    return needle in inspect.getsource(obj)


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside selected megatron modules: tensor factories asked for device
    'cuda' get 'cpu'; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


def _apply_cuda_factories() -> None:
    proxy = _CpuTorch("torch_cpu_factories")
    for fn in _FACTORIES:
        setattr(proxy, fn, _cpu_factory(getattr(torch, fn)))
    for mod in CUDA_FACTORY_MODULES:
        importlib.import_module(mod).torch = proxy


def _apply_current_device() -> None:
    # Buffers in tensor_parallel layers/mappings, p2p shape tensors and rotary embeddings are made
    # with device=torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"


def _apply_synchronize() -> None:
    torch.cuda.synchronize = lambda *a, **k: None


def _apply_rng() -> None:
    # The CUDA RNG tracker keeps separate streams per tensor-parallel rank (for dropout); on CPU we
    # back it with the CPU default generator. With dropout 0 (our CPU setting) it draws nothing.
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _apply_tensor_cuda() -> None:
    # With tied embeddings and PP > 1, LanguageModule.setup_embeddings_and_output_layer moves the
    # output-layer copy of the embedding with `weight.data.cuda()` before all-reducing it across
    # the embedding group. Without CUDA, `.cuda()` can only fail, so it becomes "stay where you are".
    torch.Tensor.cuda = lambda self, *a, **k: self


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's version asserts `grad.type() == 'torch.cuda.FloatTensor'`; same maths on CPU."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if g is not None:
                g.detach().mul_(coeff)


def _apply_clip_grads() -> None:
    import megatron.core.optimizer.optimizer as mopt

    mopt.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu


PATCHES: tuple[Patch, ...] = (
    Patch("current_device", "tensor_parallel buffers use device=torch.cuda.current_device()",
          lambda: _source_has("megatron.core.tensor_parallel.mappings", None, "torch.cuda.current_device()"),
          _apply_current_device),
    Patch("synchronize", "p2p_communication and parallel_state call torch.cuda.synchronize()",
          lambda: _source_has("megatron.core.pipeline_parallel.p2p_communication", None, "torch.cuda.synchronize()"),
          _apply_synchronize),
    Patch("cuda_factory", "schedules, optimizer, clip_grads and utils hard-code device='cuda'",
          lambda: (_source_has("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
                               'device="cuda"')
                   and _source_has("megatron.core.optimizer.optimizer", "FP32Optimizer", "device='cuda'")
                   and _source_has("megatron.core.utils", "local_multi_tensor_l2_norm", 'device="cuda"')),
          _apply_cuda_factories),
    Patch("rng", "the model-parallel RNG tracker reads and writes CUDA RNG state",
          lambda: _source_has("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", "_set_cuda_rng_state"),
          _apply_rng),
    Patch("tensor_cuda", "tied embeddings with PP>1 move the output-layer copy with .cuda()",
          lambda: _source_has("megatron.core.models.common.language_module.language_module", "LanguageModule",
                              "weight.data.cuda()"),
          _apply_tensor_cuda),
    Patch("clip_grads", "clip_grad_by_total_norm_fp32 asserts CUDA float tensors",
          lambda: _source_has("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
                              "torch.cuda.FloatTensor"),
          _apply_clip_grads),
)


class _NoStream:
    """Stands in for a CUDA stream on CPU: there are no streams or events, so there is nothing to wait for."""

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass


def _apply_current_stream() -> None:
    torch.cuda.current_stream = lambda *a, **k: _NoStream()


def _apply_rope_cp_index() -> None:
    # With context parallelism, get_pos_emb_on_this_cp_rank builds its chunk index as
    # torch.tensor(..., device="cpu", pin_memory=True).cuda(): pinned memory needs an accelerator.
    # The index stays an ordinary CPU tensor (`.cuda()` is already "stay" under tensor_cuda).
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    proxy = _CpuTorch("torch_without_pinned_memory")

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return torch.tensor(*args, **kwargs)

    proxy.tensor = tensor
    rope_utils.torch = proxy


# --- mixture of experts ------------------------------------------------------------------------------
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _dtoh_on_host(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize without CUDA streams.

    On a GPU the dispatcher copies its routing counts to the host on a side stream at `cuda_dtoh_point`
    and waits for that copy at `cuda_sync_point`. On CPU they are host tensors already: the same
    attributes get the same types (the split sizes as numpy arrays, as the GPU path leaves them) at the
    same point, with nothing to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _apply_moe_dtoh_stream() -> None:
    module = importlib.import_module(_DISPATCHER)
    cls = module.MoEAlltoAllTokenDispatcher
    # __init__ creates the shared side stream only while the class attribute is None
    cls.cuda_dtoh_stream = _NoStream()
    cls._maybe_dtoh_and_synchronize = _dtoh_on_host


def _apply_moe_router_gemm() -> None:
    # RouterGatingLinearFunction asks `te_general_gemm is not None`, but without Transformer Engine the
    # name is never bound (it is imported inside the TE-only try block): the fallback torch.mm path is
    # what the check means to select.
    importlib.import_module(_MOE_UTILS).te_general_gemm = None


def _apply_moe_tracker() -> None:
    # track_moe_metrics(force_initialize=True) allocates the per-layer loss tracker with device="cuda".
    proxy = _CpuTorch("torch_cpu_factories_moe")
    for fn in _FACTORIES:
        setattr(proxy, fn, _cpu_factory(getattr(torch, fn)))
    importlib.import_module(_MOE_UTILS).torch = proxy


_SWIGLU = "megatron.core.fusions.fused_bias_swiglu"


def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d/dy of silu(y1) * y2 (y = [y1 | y2] on the last dimension) for upstream gradient g: the ops autograd runs
    for the unfused glu (g * silu(y1) for y2, silu's backward of g * y2 for y1), so bit for bit its gradient, written
    straight into the two halves of one buffer."""
    y1, y2 = torch.chunk(y, 2, -1)
    dy = torch.empty_like(y)
    d1, d2 = torch.chunk(dy, 2, -1)
    torch.mul(g, torch.nn.functional.silu(y1), out=d2)
    torch.ops.aten.silu_backward.grad_input(g * y2, y1, grad_input=d1)
    return dy


def _apply_swiglu() -> None:
    # Every function of the module is called through its module global (SwiGLUFunction -> swiglu, swiglu_back;
    # the bias and weighted variants -> swiglu, swiglu_back). Where megatron-core was imported without
    # `lean_megatron_import` (test processes) `jit_fuser` was torch.compile, whose Inductor fails on this CPU build:
    # each compiled function goes back to its own eager body, and swiglu_back becomes the one above.
    module = importlib.import_module(_SWIGLU)
    for name, fn in list(vars(module).items()):
        if callable(fn) and hasattr(fn, "_torchdynamo_orig_callable"):
            setattr(module, name, fn._torchdynamo_orig_callable)
    module.swiglu_back = swiglu_back


SWIGLU_PATCH = Patch(
    "swiglu",
    "the SwiGLU autograd function (bias_activation_fusion: it keeps only its input for backward, where the unfused "
    "glu also keeps silu's output) computes through `swiglu` and `swiglu_back`, jit_fuser functions: one fused "
    "kernel each under torch.compile on a GPU; eagerly here swiglu_back runs ~11 elementwise passes (the tiny "
    "update 72 -> 79 ms) where the one above runs autograd's 4",
    # the module's file, not its (possibly already patched) functions
    lambda: all(_source_has(_SWIGLU, None, needle) for needle in (
        "def swiglu_back(g, y):", "torch.cat(", "tmp = swiglu_back(grad_output, input)")),
    _apply_swiglu)
"""Optional (applied where its premise holds), but on the installed megatron-core the premise must hold
(tests/training/test_cpu_compat.py): without the patch every CPU update runs megatron's slow eager gradient, or, in a
process that imported megatron-core without `lean_megatron_import`, fails in Inductor."""

MOE_PATCHES: tuple[Patch, ...] = (
    Patch("moe_dtoh_stream", "the alltoall token dispatcher creates torch.cuda.Stream() and moves its routing "
          "counts to the host on it", lambda: (
              _source_has(_DISPATCHER, "MoEAlltoAllTokenDispatcher", "torch.cuda.Stream()")
              and "torch.cuda.stream(self.cuda_dtoh_stream)" in inspect.getsource(
                  importlib.import_module(_DISPATCHER).MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)),
          _apply_moe_dtoh_stream),
    Patch("moe_router_gemm", "moe_utils.te_general_gemm is unbound without Transformer Engine (megatron-core "
          "0.16.1; 0.19.2 binds it to None), so the router's backward raises NameError",
          lambda: (not hasattr(importlib.import_module(_MOE_UTILS), "te_general_gemm")
                   and _source_has(_MOE_UTILS, "RouterGatingLinearFunction", "te_general_gemm is not None")),
          _apply_moe_router_gemm),
    Patch("moe_tracker", "track_moe_metrics allocates the aux-loss tracker with device='cuda'",
          lambda: _source_has(_MOE_UTILS, "track_moe_metrics", 'device="cuda"'), _apply_moe_tracker),
)
"""Needed by mixture-of-experts models only; optional like the next ones (applied where the premise holds),
so a dense model does not depend on megatron's MoE code staying as it is. tests/training/test_cpu_compat.py asserts
every premise on the installed megatron-core."""

# Patches for code that only some megatron-core releases contain. Each is applied exactly where its
# premise holds (a capability check, not a version pin), so one tree runs on 0.16.1 and on newer releases.
OPTIONAL_PATCHES: tuple[Patch, ...] = MOE_PATCHES + (
    SWIGLU_PATCH,
    Patch("current_stream", "newer megatron-core (0.19.2; not 0.16.1): DDP's start_grad_sync waits on "
          "torch.cuda.current_stream() for CUDA-graph gradient events, even without CUDA graphs",
          lambda: _source_has("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
                              "torch.cuda.current_stream()"),
          _apply_current_stream),
    Patch("rope_cp_index", "context parallelism: rope_utils.get_pos_emb_on_this_cp_rank pins its chunk index "
          "(pin_memory=True), which needs an accelerator",
          lambda: _source_has("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
                              "pin_memory=True"),
          _apply_rope_cp_index),
)

_applied: list[str] = []


# --- before megatron-core is imported ---------------------------------------------------------------
JIT_MODULE = "megatron.core.jit"
JIT_NAMES = ("jit_fuser", "noop_decorator", "enable_jit_fuser", "disable_jit_fuser")
"""What megatron-core's `jit` module defines (and its modules import: `jit_fuser`), checked by the tests."""


MEGATRON_NOISE = (
    r"(Transformer Engine and )?Apex (is|are) not installed",
    r"Transformer Engine and Apex are not installed",
    r"full scope is deprecated",
    r"When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"`load_state_dict` is deprecated",  # torch.distributed.checkpoint, called by megatron's dist-checkpointing
    r"Please use DTensor instead",
)
"""megatron-core warnings that say, once per module, which fallback it took (the rank's start-up line names
the paths instead: models.capability.fused_paths) or that concern CUDA only."""


def quiet_megatron_warnings() -> None:
    """Silence MEGATRON_NOISE in this process (a Megatron rank: before megatron-core is imported)."""
    import warnings

    for pattern in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=pattern)


def lean_megatron_import() -> list[str]:
    """Without CUDA, keep GPU-only import weight out of a Megatron rank; returns what it did. Must run
    before anything imports megatron-core, first thing in a rank's process (`cluster.megatron_group.MegatronRank`),
    never in a driver or test process (which may want Triton under the interpreter later).

    - `eager_jit`: megatron-core's `jit` module with the fuser disabled (`_eager_jit_module`).
    - `no_triton`: `import triton` fails in this process unless TRITON_INTERPRET=1 asks for Triton on
      the CPU. megatron-core imports Triton only to probe for symmetric-memory collectives, which need
      CUDA, and mgrpo's fused kernel needs CUDA or the interpreter; the import alone is ~40 MiB of PSS.
    - `no_<package>` for each of `RANK_UNUSED_OPTIONAL`: packages a rank's libraries import only when they
      are installed, for features a rank never calls; each reads as not installed here.
    """
    import os
    import sys

    if not needs_patches() or "megatron.core" in sys.modules:
        return []
    done = []
    if JIT_MODULE not in sys.modules:
        sys.modules[JIT_MODULE] = _eager_jit_module()
        done.append("eager_jit")
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" not in sys.modules:
        sys.modules["triton"] = None  # `import triton` raises ImportError; find_spec("triton") is None
        done.append("no_triton")
    for name in RANK_UNUSED_OPTIONAL:
        if name not in sys.modules:
            sys.modules[name] = None
            done.append("no_" + name)
    if "no_kernels" in done:
        # transformers 5.x (kernels a dependency of it) loads every model with Hub kernels unless USE_HUB_KERNELS
        # says no, and raises when `kernels` then reads as not installed ("Kernels are not available"; 5.25.0:
        # the hybrid engine's from_pretrained in every rank). Off here, where they never apply (CPU, offline).
        os.environ.setdefault("USE_HUB_KERNELS", "0")
    return done


RANK_UNUSED_OPTIONAL = ("accelerate", "kernels", "scipy", "boto3")
"""Optional imports of a Megatron rank's libraries that it never uses, kept out of its process by
`lean_megatron_import`. Each importer checks availability (transformers: `importlib.util.find_spec`,
tensorboard: `try: import`) and goes on without the package:
- accelerate: transformers' big-model loading (device_map, offload); the hybrid engine loads a plain model.
- kernels: transformers' Hub kernels (CUDA kernels fetched from the Hub), never fetched offline on CPU.
- scipy: transformers' object-detection losses (Hungarian matching), imported with every model class.
- boto3: tensorboard's S3 file system, imported by `torch.utils.tensorboard` (megatron's timers).
Measured in a rank-like process (megatron imported, then the engine's transformers model loaded from a checkpoint
and sampling, 3 runs each interleaved, load 10-14): 48 MiB less resident memory (422 -> 374 MiB); its CPU time
4.0/4.4/3.4 -> 4.0/2.6/3.1 s, within the noise of that load. In the tiny lockstep comparison mgrpo's peak tree
PSS went from a median of 925 to 892 MiB (4 runs each, load 10-30)."""


def _eager_jit_module():
    """megatron-core's `jit` module as it is after `disable_jit_fuser()`: `jit_fuser` leaves functions as
    they are.

    megatron decorates its fusions (bias-GeLU, SwiGLU, ...) with `jit_fuser` = `torch.compile` when
    `megatron.core` is imported, and `torch.compile` imports TorchDynamo and Inductor (sympy, networkx,
    ...): ~70 MiB of every Megatron rank's memory and over a second of its start, on a CPU path that runs
    those functions eagerly anyway (the local spec turns the fusions off; where one runs, eager is what
    Inductor would compute). megatron's own `disable_jit_fuser()` comes too late: the decorators run
    during `import megatron.core`. So its `jit` module is put in place before: the same names, with
    megatron's "disabled" behaviour. On a CUDA machine megatron keeps `torch.compile`.
    """
    import types

    def noop_decorator(func):
        return func

    jit = types.ModuleType(JIT_MODULE, "megatron-core's jit with the fuser disabled (mgrpo.training.cpu_compat)")
    jit.jit_fuser = jit.noop_decorator = noop_decorator
    jit.enable_jit_fuser = jit.disable_jit_fuser = lambda: None
    return jit


def needs_patches() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_patches() -> list[str]:
    """Apply every patch once (idempotent) when no CUDA device is present; return their names.

    A patch whose premise no longer holds is an error: the upgrade changed megatron-core and the
    patch must be re-checked, not applied blindly.
    """
    if not needs_patches() or _applied:
        return list(_applied)
    stale = [p.name for p in PATCHES if not p.premise()]
    if stale:
        raise RuntimeError(f"megatron-core CPU patches {stale} no longer match the installed megatron-core; "
                           "see mgrpo/training/cpu_compat.py")
    for p in PATCHES:
        p.apply()
        _applied.append(p.name)
    for p in OPTIONAL_PATCHES:
        if p.premise():
            p.apply()
            _applied.append(p.name)
    return list(_applied)
