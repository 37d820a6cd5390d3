"""SGLang's own protocol code, read from the installed `sglang` wheel, and what we know without it.

Importing `sglang` pulls in CUDA-only packages, so the pieces that define the protocol are taken
out of the wheel's files (by path, or by `ast` for single classes and functions) and run on their
own. They need only msgspec and pydantic. The test extra installs the wheel (`pip install --no-deps
-r requirements-sglang.txt`), so the CPU server and the tests check our side with SGLang's code:
- `contract()`: sglang/api/v1/api_types.py, the strict JSON contract of `/generate` (requests:
  unknown fields refused) and of its answers (`GenerateResponse`);
- `request_classes()`: the request structs of sglang/srt/managers/io_struct.py, validated the way
  SGLang's FastAPI routes do (pydantic over `msgspec_struct_pydantic_core_schema`: field types,
  required fields, base64 bytes);
- `common()`: `SafeUnpickler`, `MultiprocessingSerializer` and `init_custom_process_group` from
  sglang/srt/utils/common.py (what a TP rank runs on `serialized_named_tensors` and to join the
  weight-update group).
Every accessor returns None where the wheel (or msgspec) is missing; the CPU server then uses the
fallbacks here (field tables and an allow-list unpickler written from sglang 0.5.23).
"""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import importlib.util
import io
import os
import pickle
import sys
import types
from typing import Any, Optional

SGLANG_VERSION = "0.5.23"
"""The version the shapes here were read from (requirements-sglang.txt pins it)."""

# sglang/api/v1/api_types.py::SamplingParams (0.5.23): /generate refuses other keys.
SAMPLING_FIELDS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"})

# Endpoint -> io_struct request class and its fields (0.5.23; `rid` and `http_worker_ipc` come from
# BaseReq). SGLang ignores unknown fields here; the CPU server refuses them, so that a misspelt
# field (silently defaulted by SGLang) fails our tests. tests/test_sglang_schema.py compares this
# table with the wheel's classes.
REQUESTS = {
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", {
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version", "selector",
        "torch_empty_cache"}),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", {
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "selector", "torch_empty_cache"}),
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", {
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", {"group_name"}),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", {"selector"}),
    "/end_weight_update": ("EndWeightUpdateReqInput", set()),
    "/update_weight_version": ("UpdateWeightVersionReqInput", {"new_version", "abort_all_requests"}),
    "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", {"tags"}),
    "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", {"tags"}),
    "/abort_request": ("AbortReq", {"abort_all", "finished_reason", "abort_message", "weight_versions"}),
}
BASE_FIELDS = frozenset({"rid", "http_worker_ipc"})
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES


def sglang_dir() -> Optional[str]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _wheel_file(*parts: str) -> Optional[str]:
    d = sglang_dir()
    path = d and os.path.join(d, *parts)
    return path if path and os.path.exists(path) else None


def _load_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # msgspec resolves string annotations through the module
    spec.loader.exec_module(mod)
    return mod


def _extract(path: str, names: set[str], module_name: str, namespace: dict) -> types.ModuleType:
    """Run only the named top-level classes, functions and assignments of `path`, in order,
    in a fresh module whose globals start as `namespace`."""
    tree = ast.parse(open(path).read())
    body = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            body.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            body.append(node)
    found = {getattr(n, "name", None) or n.targets[0].id for n in body}
    if found != names:
        raise ImportError(f"{path}: expected {sorted(names - found)} (sglang {SGLANG_VERSION} layout)")
    mod = types.ModuleType(module_name)
    mod.__dict__.update(namespace)
    sys.modules[module_name] = mod
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), mod.__dict__)
    return mod


@functools.lru_cache(None)
def contract() -> Optional[types.ModuleType]:
    """sglang/api/v1/api_types.py (needs msgspec), or None."""
    path = _wheel_file("api", "v1", "api_types.py")
    if path is None or importlib.util.find_spec("msgspec") is None:
        return None
    return _load_file("_mgrpo_sglang_api_types", path)


@functools.lru_cache(None)
def request_classes() -> Optional[dict[str, type]]:
    """Endpoint -> SGLang's request struct (io_struct.py), or None."""
    io_path = _wheel_file("srt", "managers", "io_struct.py")
    utils_path = _wheel_file("srt", "utils", "msgspec_utils.py")
    wv_path = _wheel_file("srt", "utils", "weight_versions.py")
    if not (io_path and utils_path and wv_path) or importlib.util.find_spec("msgspec") is None:
        return None
    import typing

    import msgspec

    utils = _load_file("_mgrpo_sglang_msgspec_utils", utils_path)
    base = {"msgspec": msgspec, **{k: getattr(typing, k) for k in ("Annotated", "Any", "Dict", "List", "Literal",
                                                                      "Optional", "Tuple", "Union")},
            "Base64Bytes": utils.Base64Bytes,
            "msgspec_struct_pydantic_core_schema": utils.msgspec_struct_pydantic_core_schema}
    wv = _extract(wv_path, {"WeightVersionSpan", "WeightVersionSpans"}, "_mgrpo_sglang_weight_versions", base)
    names = {"BaseReq", "FinishReasonDict"} | {cls for cls, _ in REQUESTS.values()}
    mod = _extract(io_path, names, "_mgrpo_sglang_io_struct", {**base, "WeightVersionSpans": wv.WeightVersionSpans})
    return {path: getattr(mod, cls) for path, (cls, _) in REQUESTS.items()}


@functools.lru_cache(None)
def sampling_mask() -> Optional[types.ModuleType]:
    """sglang/srt/sampling/sampling_mask.py (SamplingMaskChunk: how a request's sampling masks travel and
    become the answer's lists; needs msgspec and numpy), or None."""
    path = _wheel_file("srt", "sampling", "sampling_mask.py")
    if path is None or importlib.util.find_spec("msgspec") is None:
        return None
    return _load_file("_mgrpo_sglang_sampling_mask", path)


@functools.lru_cache(None)
def config_merger() -> Optional[types.ModuleType]:
    """sglang/srt/utils/server_args_config_parser.py (SGLang's --config YAML merger; needs PyYAML), or None."""
    path = _wheel_file("srt", "utils", "server_args_config_parser.py")
    if path is None or importlib.util.find_spec("yaml") is None:
        return None
    return _load_file("_mgrpo_sglang_config_parser", path)


@functools.lru_cache(None)
def common() -> Optional[types.SimpleNamespace]:
    """SafeUnpickler, MultiprocessingSerializer and init_custom_process_group from the wheel's
    sglang/srt/utils/common.py, or None."""
    path = _wheel_file("srt", "utils", "common.py")
    if path is None:
        return None
    import typing

    import torch
    from multiprocessing.reduction import ForkingPickler

    wanted = {"_safe_load_torch_storage", "SafeUnpickler", "MultiprocessingSerializer", "init_custom_process_group"}
    ns = {"io": io, "pickle": pickle, "torch": torch, "binascii": binascii, "ForkingPickler": ForkingPickler,
          "pybase64": base64, "functools": functools, "Union": typing.Union, "List": typing.List,
          "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])}
    tree = ast.parse(open(path).read())
    body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    missing = wanted - set(ns)
    if missing - {"_safe_load_torch_storage"}:
        raise ImportError(f"{path}: expected {sorted(missing)} (sglang {SGLANG_VERSION} layout)")
    return types.SimpleNamespace(**{k: ns[k] for k in wanted if k in ns})


# --- what the CPU server uses -------------------------------------------------------------------------
class RequestError(ValueError):
    """A request SGLang would refuse (or, for unknown fields, silently misread).

    `validation`: a body FastAPI itself rejects (not JSON, wrong field types), which SGLang's handler
    answers 400 with its ErrorResponse; otherwise SGLang's `{"error": {"message": ...}}`."""

    def __init__(self, message: str, status: int = 400, *, validation: bool = False):
        super().__init__(message)
        self.status = status
        self.validation = validation

    def body(self) -> dict:
        if self.validation:  # http_server.py::validation_exception_handler -> ErrorResponse
            return {"object": "error", "message": str(self), "type": "Bad Request", "param": None, "code": self.status}
        return {"error": {"message": str(self)}}


@functools.lru_cache(None)
def _adapter(path: str):
    """pydantic's validator for SGLang's struct, built once (building one costs ~0.1 s)."""
    classes = request_classes()
    if classes is None:
        return None
    from pydantic import TypeAdapter

    return TypeAdapter(classes[path])


def check_request(path: str, body: Any) -> dict:
    """Validate the JSON body of a control endpoint: SGLang's own struct where the wheel is
    installed (a validation error: 400, as SGLang's handler answers FastAPI's), our field table
    otherwise; unknown fields are refused in both cases. Returns the body."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise RequestError(f"{path}: the body must be a JSON object, got {type(body).__name__}", validation=True)
    cls_name, fields = REQUESTS[path]
    unknown = set(body) - fields - BASE_FIELDS
    if unknown:
        raise RequestError(f"{path}: unknown fields {sorted(unknown)} (SGLang's {cls_name} has {sorted(fields)}; "
                           "SGLang would ignore them silently)")
    adapter = _adapter(path)
    if adapter is not None:
        from pydantic import ValidationError

        try:
            adapter.validate_python(body)
        except ValidationError as e:
            # the union's "is an instance already" branch always fails for a dict: not informative
            why = "; ".join(f"{'.'.join(map(str, err['loc'][1:])) or '(body)'}: {err['msg']}" for err in e.errors()
                            if err["type"] != "is_instance_of")
            raise RequestError(f"{path}: SGLang's {cls_name} refuses this body: {why}", validation=True) from e
        except (TypeError, ValueError) as e:
            raise RequestError(f"{path}: SGLang's {cls_name} refuses this body: {e}", validation=True) from e
    return body


def check_generate(body: Any) -> None:
    """/generate: SGLang's JSON contract where available, else the sampling-field table."""
    c = contract()
    if c is not None:
        try:
            c.GenerateRequest.from_json_value(body)
        except c.JsonContractError as e:
            raise RequestError(str(e)) from e
        return
    if not isinstance(body, dict):
        raise RequestError(f"/generate: the body must be a JSON object, got {type(body).__name__}")
    sps = body.get("sampling_params") or {}
    for sp in sps if isinstance(sps, list) else [sps]:
        unknown = set(sp) - SAMPLING_FIELDS
        if unknown:
            raise RequestError(f"/generate: unknown sampling_params fields {sorted(unknown)}")


def deserialize(data: bytes | str) -> Any:
    """What an SGLang TP rank does with its entry of serialized_named_tensors: SGLang's
    MultiprocessingSerializer where installed, else an unpickler admitting only PAYLOAD_GLOBALS
    (a subset of SGLang's allow-list)."""
    c = common()
    if c is not None:
        return c.MultiprocessingSerializer.deserialize(data)
    from mgrpo.rollout.sglang.weights_tensor import PAYLOAD_GLOBALS

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in PAYLOAD_GLOBALS:
                raise RuntimeError(f"Blocked unsafe global ({module}.{name})")
            return super().find_class(module, name)

    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    return Restricted(io.BytesIO(raw)).load()


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
               timeout_s: float = 600.0):
    """The engine's side of the weight-update group: SGLang's init_custom_process_group where installed."""
    from datetime import timedelta

    c = common()
    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    if c is not None:
        return c.init_custom_process_group(backend=backend, init_method=f"tcp://{host}:{master_port}",
                                           world_size=world_size, rank=rank, group_name=group_name,
                                           timeout=timedelta(seconds=timeout_s))
    from mgrpo.rollout.sglang.weights_distributed import new_weight_update_group

    return new_weight_update_group(master_address, master_port, world_size, group_name, backend=backend, rank=rank,
                                   timeout_s=timeout_s)
