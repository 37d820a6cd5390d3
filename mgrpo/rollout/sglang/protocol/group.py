"""The weight-update process group, made the way SGLang makes its side (utils/common.py::
init_custom_process_group): our trainer-side sender (rank 0, weights_distributed.py) makes it with this, and so
does the CPU server where the wheel is missing (cpu/receive.py::join_group)."""

from __future__ import annotations

from datetime import timedelta


def new_weight_update_group(master_address: str, master_port: int, world_size: int, group_name: str, *,
                            backend: str = "nccl", rank: int = 0, timeout_s: float = 600.0):
    """A process group outside the default one, made the way SGLang makes its side
    (utils/common.py::init_custom_process_group): tcp rendezvous (rank 0 hosts the TCPStore),
    a PrefixStore named after the group, `_new_process_group_helper`, identity rank map."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    rendezvous)

    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
