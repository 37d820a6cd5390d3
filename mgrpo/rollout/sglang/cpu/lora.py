"""LoRA adapters in the CPU server, as SGLang 0.5.23 serves them (`--enable-lora`).

What SGLang does (files under `sglang/srt/`):
- `/load_lora_adapter_from_tensors` (io_struct.LoadLoRAAdapterFromTensorsReqInput): a PEFT `adapter_config.json`
  as `config_dict` and one serialized `{name: tensor}` per TP rank (managers/tp_worker.py); `/load_lora_adapter`
  the same from a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`); `/unload_lora_adapter` by
  name. Each answers `LoRAUpdateOutput` (success, error_message, loaded_adapters: name -> path, "__tensor__"
  for tensors), 400 on failure (entrypoints/http_server.py).
- Loading refuses, with SGLang's messages (lora/lora_manager.py::validate_new_adapter, tokenizer_control_mixin.py):
  LoRA not enabled, a name already loaded, DoRA, added tokens, and an adapter the memory pool cannot hold (rank
  above `--max-lora-rank`, a target outside `--lora-target-modules`).
- An adapter applies `lora_alpha / r * B A x` on each adapted linear (lora/lora.py: scaling), for the requests
  whose `lora_path` names it; a request naming an adapter never loaded fails with the tokenizer manager's message.
  PEFT's q/k/v and gate/up are adapted separately (SGLang stacks them into qkv_proj / gate_up_proj; the sum is
  the same).
Not served here: adapters on the embedding or the output layer, or on a mixture-of-experts model's experts
(refused at load, naming what is missing); SGLang's per-batch adapter slots (`--max-loras-per-batch`) are
accepted and not needed on one CPU process.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
from fastapi import Request  # module level: FastAPI resolves the routes' string annotations here

from mgrpo.rollout.sglang.cpu.model import ModelError

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF linears of a Qwen3 / Llama-shaped decoder layer an adapter can sit on here."""
NORMALIZED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}
"""sglang/srt/lora/utils.py::get_normalized_target_modules (the names SGLang's memory pool keeps)."""
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


class LoraError(ModelError):
    """Answered as SGLang answers a ValueError: 400, {"error": {"message": ...}}."""


def normalized(targets) -> set:
    if isinstance(targets, str):
        if targets not in ("all", "all-linear"):
            raise LoraError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {NORMALIZED.get(t.rsplit(".", 1)[-1], t.rsplit(".", 1)[-1]) for t in targets}


class Adapter:
    def __init__(self, name: str, path: str, config: dict, weights: dict):
        self.name, self.path, self.config = name, path, config
        self.scaling = float(config["lora_alpha"]) / int(config["r"])  # lora/lora.py: LoRAAdapter.scaling
        self.weights = weights
        """HF module path (model.layers.i.self_attn.q_proj) -> (A [r, in], B [out, r])."""


class LoraBank:
    """The adapters one server holds, by name, and the hooks that apply them to the rows that name them."""

    def __init__(self, model, *, enabled: bool, max_rank: Optional[int], target_modules: Optional[Sequence[str]]):
        self.model, self.enabled = model, enabled
        self.max_rank = int(max_rank or 0)
        self.targets = normalized(list(target_modules)) if target_modules else set()
        if "all" in self.targets:  # lora_manager.init_lora_shapes: 'all' resolved from the base model
            self.targets = {NORMALIZED.get(n, n) for n in LINEARS}
        self.adapters: dict[str, Adapter] = {}
        self.rows: Optional[list] = None
        """Per batch row, the Adapter of its request (or None: the base), while a forward runs."""
        self.modules = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in LINEARS
                        and isinstance(m, torch.nn.Linear)}
        if enabled:
            for name, module in self.modules.items():
                module.register_forward_hook(self._hook(name))

    # --- loading ------------------------------------------------------------------------------------
    def result(self, success: bool, error: str = "") -> dict:
        """LoRAUpdateOutput, as lora_manager.create_lora_update_result fills it."""
        return {"success": success, "error_message": error,
                "loaded_adapters": {a.name: a.path for a in self.adapters.values()}}

    def load(self, name: str, config: dict, tensors: dict, path: str = "__tensor__",
             added_tokens: Optional[dict] = None) -> dict:
        if not self.enabled:
            return {"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None}
        try:
            if str(config.get("peft_type", "")).lower() != "lora":
                raise LoraError(f"peft_type {config.get('peft_type')!r}: SGLang loads LoRA adapters (peft_type LORA)")
            vocab = self.model.config.vocab_size
            if added_tokens and any(i >= vocab for i in added_tokens.values()):
                raise LoraError(f"Failed to load {name} because LoRA serving currently doesn't support adapters "
                                "that add tokens to the vocabulary")
            if config.get("use_dora", False):
                raise LoraError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
            if name in self.adapters:
                raise LoraError(f"Failed to load LoRA adapter {name} because it is already loaded")
            wanted = normalized(config["target_modules"])
            if int(config["r"]) > self.max_rank or not (wanted <= self.targets or wanted == {"all"}):
                raise LoraError(
                    f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
            self.adapters[name] = Adapter(name, path, config, self._weights(config, tensors))
        except (LoraError, KeyError, TypeError, ValueError) as e:
            return self.result(False, str(e))
        return self.result(True)

    def load_path(self, name: str, path: str) -> dict:
        """/load_lora_adapter: a PEFT folder on this node."""
        import json

        from safetensors.torch import load_file

        if not self.enabled:
            return {"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None}
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                config = json.load(f)
            tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        except OSError as e:
            return self.result(False, str(e))
        return self.load(name, config, tensors, path=path)

    def unload(self, name: str) -> dict:
        if not self.enabled:
            return {"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None}
        if name not in self.adapters:  # lora_registry.unregister
            return {"success": False, "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                                      f"{self.adapters.keys()}", "loaded_adapters": None}
        del self.adapters[name]
        return self.result(True)

    def _weights(self, config: dict, tensors: dict) -> dict:
        r = int(config["r"])
        parts: dict = {}
        for key, t in tensors.items():
            m = _KEY.search(key)
            if m is None:
                what = "the embedding or the output layer" if re.search(r"embed_tokens|lm_head", key) else key
                raise LoraError(f"{key}: the CPU server applies adapters on decoder-layer linears only, not {what}")
            layer, rel, which = m.groups()
            module = f"model.layers.{layer}.{rel}"
            if module not in self.modules:
                raise LoraError(f"{key}: the model has no linear {module} an adapter can sit on "
                                "(the CPU server adapts q/k/v/o and gate/up/down projections, not experts)")
            parts.setdefault(module, {})[which] = t.detach().to(torch.float32 if not t.is_floating_point()
                                                                  else t.dtype).clone()
        out = {}
        for module, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise LoraError(f"{module}: lora_{'A' if 'A' not in ab else 'B'} is missing")
            lin = self.modules[module]
            A, B = ab["A"].to(lin.weight.dtype), ab["B"].to(lin.weight.dtype)
            if A.shape != (r, lin.in_features) or B.shape != (lin.out_features, r):
                raise LoraError(f"{module}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit rank {r} "
                                f"on a [{lin.out_features}, {lin.in_features}] linear")
            out[module] = (A, B)
        return out

    # --- requests -----------------------------------------------------------------------------------
    def resolve(self, names: Sequence[Optional[str]]) -> list:
        """Each request's Adapter (None: the base); tokenizer_manager._validate_and_resolve_lora's errors."""
        named = [n for n in names if n]
        if named and not self.enabled:
            raise LoraError(f"LoRA adapter '{named[0]}' was requested, but LoRA is not enabled. Please launch the "
                            "server with --enable-lora flag and preload adapters using --lora-paths or "
                            "/load_lora_adapter endpoint.")
        for n in named:
            if n not in self.adapters:
                raise LoraError(f"Got LoRA adapter that has never been loaded: {n}\n"
                                f"All loaded adapters: {self.adapters.keys()}.")
        return [self.adapters[n] if n else None for n in names]

    @contextmanager
    def batch(self, rows: Sequence) -> Iterator[None]:
        """The forwards inside apply each row's adapter."""
        self.rows = list(rows) if any(a is not None for a in rows) else None
        try:
            yield
        finally:
            self.rows = None

    def _hook(self, module_name: str):
        def hook(module, args, output):
            rows = self.rows
            if rows is None:
                return output
            x = args[0]
            for adapter in {id(a): a for a in rows if a is not None}.values():
                ab = adapter.weights.get(module_name)
                if ab is None:
                    continue
                idx = torch.tensor([i for i, a in enumerate(rows) if a is adapter])
                A, B = ab
                delta = torch.nn.functional.linear(torch.nn.functional.linear(x[idx], A), B) * adapter.scaling
                output = output.index_add(0, idx, delta) if len(idx) < len(rows) else output + delta
            return output
        return hook


# --- the server's side: arguments, routes, requests ----------------------------------------------------
def add_arguments(p) -> None:
    """SGLang's LoRA launch arguments (srt/server_args.py)."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter*)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank the server takes")
    p.add_argument("--lora-target-modules", nargs="*", default=None,
                   help="the modules adapters may adapt (q_proj ... down_proj, or all)")
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="accepted (one CPU process has no slots)")
    p.add_argument("--max-loaded-loras", type=int, default=None, help="accepted")


def from_args(model, args) -> LoraBank:
    return LoraBank(model, enabled=bool(args.enable_lora),
                    max_rank=args.max_lora_rank, target_modules=args.lora_target_modules)


def names_of(body: dict, n: int, single: bool) -> list:
    """`lora_path` per request (io_struct.GenerateReqInput._normalize_lora_paths)."""
    from mgrpo.rollout.sglang.cpu.receive import RequestError

    v = body.get("lora_path")
    if v is None or isinstance(v, str):
        return [v or None] * n
    if isinstance(v, list) and len(v) == n and all(x is None or isinstance(x, str) for x in v) and not single:
        return v
    raise RequestError("lora_path should be a list or a string.")


def attach(bank: LoraBank, reqs: list, body: dict, single: bool) -> None:
    for r, adapter in zip(reqs, bank.resolve(names_of(body, len(reqs), single))):
        r.lora = adapter


def add_routes(app, state, body_of) -> None:
    from fastapi.responses import JSONResponse

    from mgrpo.rollout.sglang.cpu import receive
    from mgrpo.rollout.sglang.protocol.buckets import FLATTENED, unflatten

    bank: LoraBank = state.model.lora

    def answer(out: dict) -> JSONResponse:
        return JSONResponse(out, status_code=200 if out["success"] else 400)

    async def load_from_tensors(request: Request):
        body = await body_of(request, "/load_lora_adapter_from_tensors")
        if not bank.enabled:  # the tokenizer manager answers before any rank reads the tensors
            return answer({"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None})
        payloads = body["serialized_named_tensors"]
        if len(payloads) != state.args.tp_size:
            return answer(bank.result(False, f"serialized_named_tensors has {len(payloads)} entries for --tp-size "
                                             f"{state.args.tp_size} (one per TP rank)"))
        tensors = None
        try:
            for rank, payload in enumerate(payloads):  # each TP rank deserialises its own copy (tp_worker.py)
                data = receive.deserialize(payload)
                if rank == 0:
                    fmt = body.get("load_format")
                    tensors = dict(unflatten(data["flattened_tensor"], data["metadata"])) if fmt == FLATTENED \
                        else data
                del data
        except Exception as e:  # noqa: BLE001 - a payload that does not decode fails the load, with the reason
            return answer(bank.result(False, f"serialized_named_tensors: {type(e).__name__}: {e}"))
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            return answer(bank.result(False, f"expected a {{name: tensor}} payload, got {type(tensors).__name__}"))
        return answer(await state.on_model(bank.load, body["lora_name"], body["config_dict"], tensors, "__tensor__",
                                           body.get("added_tokens_config")))

    async def load(request: Request):
        body = await body_of(request, "/load_lora_adapter")
        return answer(await state.on_model(bank.load_path, body["lora_name"], body["lora_path"]))

    async def unload(request: Request):
        body = await body_of(request, "/unload_lora_adapter")
        return answer(await state.on_model(bank.unload, body["lora_name"]))

    app.post("/load_lora_adapter_from_tensors")(load_from_tensors)
    app.post("/load_lora_adapter")(load)
    app.post("/unload_lora_adapter")(unload)
