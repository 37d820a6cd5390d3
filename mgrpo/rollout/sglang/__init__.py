"""The SGLang rollout path: one client for SGLang's HTTP server (GPU) and for the CPU server that
speaks its protocol over transformers.

- `http.py`      HTTP client with bounded retries, errors, capability checks
- `server.py`    which server to run, its command line, start/readiness/watchdog/stop
- `client.py`    `SGLangEngine`: generate, health, memory release/resume, abort, finish_weight_update
- `session.py`   the weight-update session (begin/end, version, cache flush)
- `buckets.py`   flattened weight buckets as SGLang lays them out
- `weights_tensor.py`       colocated sync: `update_weights_from_tensor` (CUDA IPC / shared memory)
- `weights_distributed.py`  disaggregated sync: a process group (NCCL / gloo) + broadcasts
- `schema.py`    SGLang's own request classes and unpickler, read from the installed wheel
- `cpu_server.py` (HTTP, arguments), `cpu_model.py` (sampling, weights, memory), `cpu_weights.py`
  (both weight transports, receiving side): the CPU server, `python -m mgrpo.rollout.sglang.cpu_server`
"""

from mgrpo.rollout.sglang.client import SGLangEngine
from mgrpo.rollout.sglang.http import SGLangRequestError, SGLangUnavailableError
from mgrpo.rollout.sglang.session import WeightSession
from mgrpo.rollout.sglang.weights_distributed import DistributedWeightSender
from mgrpo.rollout.sglang.weights_tensor import IPCWeightSender, TensorWeightSender

__all__ = ["SGLangEngine", "SGLangRequestError", "SGLangUnavailableError", "WeightSession", "DistributedWeightSender",
           "IPCWeightSender", "TensorWeightSender"]
