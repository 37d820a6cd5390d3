"""The weight-update routes of the CPU server: both transports, as an SGLang engine receives them.

- `/update_weights_from_tensor`: every TP rank deserialises its own entry of
  `serialized_named_tensors` with SGLang's unpickler (receive.deserialize); rank 0's tensors are
  loaded (one process holds the whole model), the other ranks' are decoded and dropped, which
  releases their shared-memory references as SGLang's ranks would.
- `/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`:
  the engine joins the trainer's group as rank `rank_offset` (SGLang's init_custom_process_group
  where the wheel is installed) and receives the broadcasts, flattened or one per tensor.
Both refuse to run outside a weight-update session, with SGLang's messages.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from fastapi import Request  # module level: FastAPI resolves the string annotations here

from mgrpo.rollout.sglang.cpu import receive
from mgrpo.rollout.sglang.protocol.buckets import FLATTENED, distributed_layout, unflatten

log = logging.getLogger("mgrpo.cpu_server")


def _named_from_payload(data, load_format):
    if load_format == FLATTENED:
        return unflatten(data["flattened_tensor"], data["metadata"])
    if load_format is None:
        return list(data)
    raise ValueError(f"load_format {load_format!r} is not supported by the CPU server (flattened_bucket or None)")


def receive_tensor(state, body: dict) -> int:
    payloads = body["serialized_named_tensors"]
    if len(payloads) != state.args.tp_size:
        raise ValueError(f"serialized_named_tensors has {len(payloads)} entries for --tp-size {state.args.tp_size} "
                         "(one per TP rank)")
    named = None
    for rank, payload in enumerate(payloads):
        data = receive.deserialize(payload)
        if rank == 0:
            named = _named_from_payload(data, body.get("load_format"))
        del data
    return state.model.load(named)


def check_distributed(body: dict) -> None:
    """What must hold before the server waits on a broadcast: a request that lists names, dtypes and
    shapes that do not line up would receive fewer or other bytes than the trainer sends."""
    names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
    for d in dtypes:
        if not isinstance(getattr(torch, str(d), None), torch.dtype):
            raise ValueError(f"dtype {d!r} is not a torch dtype name")
    for shape in shapes:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"shape {shape!r} is not a list of non-negative integers")


def receive_distributed(state, body: dict, group) -> int:
    dtypes = [getattr(torch, d) for d in body["dtypes"]]
    if body.get("load_format") == FLATTENED:
        metas, total = distributed_layout(body["names"], dtypes, body["shapes"])
        if state.recv_buffer is None or state.recv_buffer.numel() < total:  # reused: a bucket is loaded before the next
            state.recv_buffer = None
            state.recv_buffer = torch.empty(total, dtype=torch.uint8)
        flat = state.recv_buffer[:total]
        torch.distributed.broadcast(flat, group=group, group_src=0)
        named = unflatten(flat, metas)
    elif body.get("load_format") is None:
        named = []
        for name, dt, shape in zip(body["names"], dtypes, body["shapes"]):
            t = torch.empty(shape, dtype=dt)
            torch.distributed.broadcast(t, group=group, group_src=0)
            named.append((name, t))
    else:
        raise ValueError(f"load_format {body['load_format']!r} is not supported by the CPU server")
    return state.model.load(named)


def add_routes(app, state, body_of, result) -> None:
    def _done(body: dict, nbytes: int, what: str, t0: float) -> None:
        if body.get("weight_version") is not None:
            state.weight_version = body["weight_version"]
        log.info("%s: loaded %d bytes in %.3f s", what, nbytes, time.perf_counter() - t0)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await body_of(request, "/update_weights_from_tensor")
        if not state.session_open:
            return result(False, "update_weights_from_tensor must run between begin_weight_update() and "
                                 "end_weight_update()")
        t0 = time.perf_counter()
        try:
            nbytes = await state.on_model(receive_tensor, state, body)
        except Exception as e:  # noqa: BLE001 - SGLang answers a failed load with success=False
            log.exception("update_weights_from_tensor failed")
            return result(False, f"Failed to update weights: {type(e).__name__}: {e}")
        _done(body, nbytes, "update_weights_from_tensor", t0)
        return result(True, "Success")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await body_of(request, "/init_weights_update_group")
        name, backend = body.get("group_name", "weight_update_group"), body.get("backend", "nccl")
        if state.args.tp_size != 1:
            return result(False, f"the CPU server joins weight-update groups as one rank (--tp-size 1), "
                                 f"not {state.args.tp_size}")
        if backend != "gloo" and not torch.cuda.is_available():
            return result(False, f"backend {backend!r} needs CUDA; the CPU server joins over gloo "
                                 "(DistributedWeightSender(backend=None) picks gloo where there is no CUDA)")
        if name in state.groups:
            return result(False, f"Failed to init custom process group: group {name!r} already exists")
        world, rank, port = body["world_size"], body["rank_offset"], body["master_port"]
        if not (world >= 2 and 1 <= rank < world and 0 < port < 65536):
            # torch would fail on these only after a rendezvous timeout
            return result(False, f"Failed to init custom process group: rank_offset {rank}, world_size {world}, "
                                 f"master_port {port} (the engine joins as a rank in [1, world_size))")
        try:  # blocks until the trainer joins: off the model thread, so generation goes on meanwhile
            state.groups[name] = await asyncio.to_thread(
                receive.join_group, body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], name, backend)
        except Exception as e:  # noqa: BLE001
            log.exception("init_weights_update_group failed")
            return result(False, f"Failed to init custom process group: {type(e).__name__}: {e}")
        log.info("joined weight-update group %r as rank %d of %d (%s)", name, body["rank_offset"], body["world_size"],
                 backend)
        return result(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await body_of(request, "/update_weights_from_distributed")
        if not state.session_open:
            return result(False, "update_weights_from_distributed must run between begin_weight_update() and "
                                 "end_weight_update()")
        group = state.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return result(False, f"Failed to receive weights: no weight-update group {body.get('group_name')!r} "
                                 f"(have {sorted(state.groups)})")
        try:
            check_distributed(body)
        except ValueError as e:
            return result(False, f"Failed to receive weights: {e}")
        t0 = time.perf_counter()
        try:
            nbytes = await state.on_model(receive_distributed, state, body, group)
        except Exception as e:  # noqa: BLE001
            log.exception("update_weights_from_distributed failed")
            return result(False, f"Failed to receive weights: {type(e).__name__}: {e}")
        _done(body, nbytes, "update_weights_from_distributed", t0)
        return result(True, "Succeeded to update parameter online.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await body_of(request, "/destroy_weights_update_group")
        name = body.get("group_name", "weight_update_group")
        group = state.groups.pop(name, None)
        if group is None:
            return result(False, f"Failed to destroy custom process group: no group {name!r}")
        torch.distributed.destroy_process_group(group)
        log.info("destroyed weight-update group %r", name)
        return result(True, "Succeeded to destroy custom process group.")
