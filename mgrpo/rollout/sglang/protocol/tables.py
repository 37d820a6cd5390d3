"""SGLang's protocol as tables written from sglang 0.5.23: what a server accepts, and what it lets through.

Standard library only. The tests compare every table with the installed wheel
(tests/rollout/sglang/test_sglang_schema.py, test_sglang_auth.py, test_sglang_weights.py); the CPU server uses
them where the wheel is missing.
- `SAMPLING_FIELDS`, `REQUESTS`, `BASE_FIELDS`: the fields of `/generate`'s sampling parameters and of
  every control endpoint's request class;
- `MEMORY_TAGS`: what `/release_memory_occupation` and `/resume_memory_occupation` name;
- `ALWAYS_OPEN_PREFIXES`, `ADMIN_OPTIONAL`: which routes need no key, and which take the admin key;
- `PAYLOAD_GLOBALS`: the globals a weight payload may hold (a subset of SGLang's unpickler allow-list).
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
"""The version the shapes here were read from (requirements-sglang.txt pins it)."""

ROUTING_KEY = "x-smg-routing-key"
"""sglang-router's header for its `manual` policy (0.3.x): requests with the same key go to the same worker
(sticky), a new key to the worker `--assignment-mode` picks. tests/cluster/test_router_sessions.py checks it."""

# sglang/api/v1/api_types.py::SamplingParams (0.5.23): /generate refuses other keys.
SAMPLING_FIELDS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice"})

# Endpoint -> io_struct request class and its fields (0.5.23; `rid` and `http_worker_ipc` come from
# BaseReq). SGLang ignores unknown fields here; the CPU server refuses them, so that a misspelt
# field (silently defaulted by SGLang) fails our tests. tests/rollout/sglang/test_sglang_schema.py compares this
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
    "/load_lora_adapter": ("LoadLoRAAdapterReqInput", {"lora_name", "lora_path", "pinned", "lora_id"}),
    "/load_lora_adapter_from_tensors": ("LoadLoRAAdapterFromTensorsReqInput", {
        "lora_name", "config_dict", "serialized_named_tensors", "pinned", "added_tokens_config", "lora_id",
        "load_format", "expected_checksums"}),
    "/unload_lora_adapter": ("UnloadLoRAAdapterReqInput", {"lora_name", "lora_id"}),
}
BASE_FIELDS = frozenset({"rid", "http_worker_ipc"})
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES

ALWAYS_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""SGLang lets these through without a key (probes and Prometheus), matched by prefix."""

ADMIN_OPTIONAL = frozenset({
    "/flush_cache", "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_tensor",
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed", "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation", "/abort_request", "/load_lora_adapter",
    "/load_lora_adapter_from_tensors", "/unload_lora_adapter"})
"""SGLang 0.5.23 (entrypoints/http_server.py): `@auth_level(AuthLevel.ADMIN_OPTIONAL)` routes the CPU server
serves. With an admin key set they take only that key; the others (/generate, /model_info) take the API key."""

PAYLOAD_DTYPES = ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool",
                  "float8_e4m3fn", "float8_e5m2")
"""The torch dtypes a weight payload may carry (torch.<name>)."""

# Globals our payloads may contain; each is in SGLang's SafeUnpickler.ALLOWED_GLOBALS
# (utils/common.py). tests/rollout/sglang/test_sglang_weights.py checks both statements.
PAYLOAD_GLOBALS = frozenset({
    ("types", "SimpleNamespace"), ("torch", "Size"), ("torch", "Tensor"),
    ("torch.storage", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("multiprocessing.resource_sharer", "DupFd"),
}) | frozenset(("torch", d) for d in PAYLOAD_DTYPES)
