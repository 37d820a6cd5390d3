"""The SGLang rollout path: our client for SGLang's HTTP server (GPU), the CPU stand-in for that server, and
SGLang's protocol that both speak.

Our client (this folder):
- `http.py`      HTTP client with bounded retries, errors, capability checks
- `auth.py`      the run's key: resolved from rollout.api_key, delivered in a private file, sent as a header
- `server.py`    which server to run, its command line, start/readiness/watchdog/stop
- `client.py`    `SGLangEngine`: generate, health, memory release/resume, abort, finish_weight_update
- `generate_io.py`  /generate payloads and answers (sampling masks, routed experts, weight versions)
- `session.py`   the weight-update session (begin/end, version, cache flush)
- `weights_tensor.py`       colocated sync: `update_weights_from_tensor` (CUDA IPC / shared memory)
- `weights_distributed.py`  disaggregated sync: a process group (NCCL / gloo) + broadcasts
- `router.py`    SGLang's router in front of several engines, and a client through it
`protocol/`: SGLang's protocol, what both sides read (the leaf: it imports nothing else of this folder;
  protocol/__init__.py lists its files: request fields, SGLang's own classes read from the wheel, weight
  buckets, the weight-update group)
`cpu/`: the CPU server, SGLang's HTTP server over transformers: `python -m mgrpo.rollout.sglang.cpu.server`
  (cpu/__init__.py lists its files). It imports protocol/, never the client; the client launches it by
  module name only.
"""

from mgrpo.config.registry import lazy_exports

# Imported on first use, not with the package: the client's modules import torch, and a driver that only resolves
# the run's key (auth.py) or reads the protocol must not (torch is ~136 MiB).
_EXPORTS = {
    "SGLangEngine": "client",
    "SGLangRequestError": "http",
    "SGLangUnavailableError": "http",
    "WeightSession": "session",
    "DistributedWeightSender": "weights_distributed",
    "IPCWeightSender": "weights_tensor",
    "TensorWeightSender": "weights_tensor",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
