"""SGLang's own protocol code, read from the installed `sglang` wheel.

Importing `sglang` pulls in CUDA-only packages, so the pieces that define the protocol are taken
out of the wheel's files (by path, or by `ast` for single classes and functions) and run on their
own. They need only msgspec and pydantic (and torch for `common`). The test extra installs the wheel
(`pip install --no-deps -r requirements-sglang.txt`), so the CPU server and the tests check our side
with SGLang's code:
- `contract()`: sglang/api/v1/api_types.py, the strict JSON contract of `/generate` (requests:
  unknown fields refused) and of its answers (`GenerateResponse`);
- `request_classes()`: the request structs of sglang/srt/managers/io_struct.py, validated the way
  SGLang's FastAPI routes do (pydantic over `msgspec_struct_pydantic_core_schema`: field types,
  required fields, base64 bytes);
- `common()`: `SafeUnpickler`, `MultiprocessingSerializer` and `init_custom_process_group` from
  sglang/srt/utils/common.py (what a TP rank runs on `serialized_named_tensors` and to join the
  weight-update group);
- `auth_rules()`: sglang/srt/utils/auth.py (`decide_request_auth`, `AuthLevel`);
- `sampling_mask()`, `config_merger()`: how sampling masks travel; SGLang's `--config` YAML merger;
- `json_schema_validation()`: the JSON-schema features SGLang refuses before xgrammar compiles a schema.
Every accessor returns None where the wheel (or what it needs) is missing; the CPU server then uses
the tables (tables.py) and its own fallbacks (cpu/receive.py, cpu/auth.py).
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
from typing import Optional

from mgrpo.rollout.sglang.protocol.tables import REQUESTS, SGLANG_VERSION


def sglang_dir() -> Optional[str]:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def wheel_file(*parts: str) -> Optional[str]:
    d = sglang_dir()
    path = d and os.path.join(d, *parts)
    return path if path and os.path.exists(path) else None


def load_file(name: str, path: str) -> types.ModuleType:
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
    path = wheel_file("api", "v1", "api_types.py")
    if path is None or importlib.util.find_spec("msgspec") is None:
        return None
    return load_file("_mgrpo_sglang_api_types", path)


@functools.lru_cache(None)
def request_classes() -> Optional[dict[str, type]]:
    """Endpoint -> SGLang's request struct (io_struct.py), or None."""
    io_path = wheel_file("srt", "managers", "io_struct.py")
    utils_path = wheel_file("srt", "utils", "msgspec_utils.py")
    wv_path = wheel_file("srt", "utils", "weight_versions.py")
    if not (io_path and utils_path and wv_path) or importlib.util.find_spec("msgspec") is None:
        return None
    import typing

    import msgspec

    utils = load_file("_mgrpo_sglang_msgspec_utils", utils_path)
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
    path = wheel_file("srt", "sampling", "sampling_mask.py")
    if path is None or importlib.util.find_spec("msgspec") is None:
        return None
    return load_file("_mgrpo_sglang_sampling_mask", path)


@functools.lru_cache(None)
def json_schema_validation() -> Optional[types.ModuleType]:
    """sglang/srt/constrained/json_schema_validation.py (validate_xgrammar_json_schema: the JSON-schema
    features SGLang refuses for xgrammar; it imports nothing), or None."""
    path = wheel_file("srt", "constrained", "json_schema_validation.py")
    return load_file("_mgrpo_sglang_json_schema_validation", path) if path else None


@functools.lru_cache(None)
def config_merger() -> Optional[types.ModuleType]:
    """sglang/srt/utils/server_args_config_parser.py (SGLang's --config YAML merger; needs PyYAML), or None."""
    path = wheel_file("srt", "utils", "server_args_config_parser.py")
    if path is None or importlib.util.find_spec("yaml") is None:
        return None
    return load_file("_mgrpo_sglang_config_parser", path)


@functools.lru_cache(None)
def common() -> Optional[types.SimpleNamespace]:
    """SafeUnpickler, MultiprocessingSerializer and init_custom_process_group from the wheel's
    sglang/srt/utils/common.py, or None."""
    path = wheel_file("srt", "utils", "common.py")
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


@functools.lru_cache(None)
def auth_rules() -> Optional[types.ModuleType]:
    """sglang/srt/utils/auth.py (it imports nothing heavy), or None."""
    path = wheel_file("srt", "utils", "auth.py")
    return load_file("_mgrpo_sglang_auth", path) if path else None
