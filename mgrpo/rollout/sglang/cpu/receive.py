"""What an SGLang server does with a request it receives, as the CPU server does it: the body checked, the
weight payload unpickled, the weight-update group joined. SGLang's own code where the wheel is installed
(protocol/wheel.py), the tables and the fallbacks here otherwise:
- `check_request`: a control endpoint's JSON body against SGLang's request struct (pydantic, as its FastAPI
  routes validate it), else the field table (protocol/tables.py::REQUESTS); unknown fields refused in both;
- `check_generate`: `/generate` against SGLang's JSON contract, else the sampling-field table;
- `deserialize`: SGLang's MultiprocessingSerializer, else an unpickler admitting only
  protocol/tables.py::PAYLOAD_GLOBALS;
- `join_group`: SGLang's init_custom_process_group, else protocol/group.py::new_weight_update_group;
- `RequestError`: a refusal, with SGLang's status and body.
"""

from __future__ import annotations

import base64
import functools
import io
import pickle
from typing import Any

from mgrpo.rollout.sglang.protocol.group import new_weight_update_group
from mgrpo.rollout.sglang.protocol.tables import BASE_FIELDS, PAYLOAD_GLOBALS, REQUESTS, SAMPLING_FIELDS
from mgrpo.rollout.sglang.protocol.wheel import common, contract, request_classes


class RequestError(ValueError):
    """A request SGLang would refuse (or, for unknown fields, silently misread).

    `validation`: a body FastAPI itself rejects (not JSON, wrong field types), which SGLang's handler
    answers 400 with its ErrorResponse; `internal`: an exception SGLang's server does not catch, which
    Starlette answers 500 "Internal Server Error" in plain text (the message goes to the server's log);
    otherwise SGLang's `{"error": {"message": ...}}`."""

    def __init__(self, message: str, status: int = 400, *, validation: bool = False, internal: bool = False):
        super().__init__(message)
        self.status = status
        self.validation = validation
        self.internal = internal

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
    return new_weight_update_group(master_address, master_port, world_size, group_name, backend=backend, rank=rank,
                                   timeout_s=timeout_s)
