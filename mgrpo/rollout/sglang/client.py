"""The SGLang rollout engine: a client for one SGLang HTTP server, optionally launched and owned.

It implements `RolloutEngine` (types.py), so the rollout group does not care which engine it
hosts. The server is SGLang itself on GPU or the CPU server speaking its protocol
(`cpu/server.py`); `SGLangEngine.launch` picks one by capability, and this client is the same
for both. Request and response shapes are SGLang 0.5.23's (`sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`, the JSON contract in
`sglang/api/v1/api_types.py`, and `meta_info` as built in `managers/tokenizer_manager.py`).

One client talks to one server. With several engines the rollout group starts SGLang's router in front of
them (`router.py`) and sends generation through it; weight updates and health checks still go to each
server through its own client. Left out, on purpose: streaming (rollouts want whole responses) and text
prompts (the trainer owns tokenisation).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from mgrpo.net import node_ip
from mgrpo.rollout.sglang.auth import key_config_file, remove_key_config
from mgrpo.rollout.sglang.generate_io import (build_generate_payload, checkpoint_moe_shape, checkpoint_tensor_names,
                                              parse_generate_item)
from mgrpo.rollout.sglang.http import HTTPClient, SGLangBadResponseError, SGLangRequestError
from mgrpo.rollout.sglang.protocol.buckets import FLATTENED, bucket_bytes
from mgrpo.rollout.sglang.protocol.tables import MEMORY_TAGS, ROUTING_KEY
from mgrpo.rollout.sglang.server import (CPU_MODULE, check_host, choose_server, launch_command, log_tail,
                                         start_on_free_port, start_server, terminate_group, url_of)
from mgrpo.rollout.sglang.session import WeightSession
from mgrpo.rollout.sglang.weights_tensor import payload_object, serialize, staging_buffer, tensor_payloads
from mgrpo.rollout.types import EngineDefaults, EngineHealth, GenerateRequest, GenerateResult, SamplingParams

log = logging.getLogger(__name__)

MAX_SPLIT = 64
"""POSTs at once for one call split by routed_experts_start_len (multi-turn routes: one value per batch)."""


# --- the engine ----------------------------------------------------------------------------------------
class SGLangEngine(EngineDefaults):
    """`RolloutEngine` over one SGLang server. Make it with `launch` (start and own a server) or
    `connect` (use a running one)."""

    releases_memory = True
    """The server's weights and KV cache (SGLang's memory saver) go to the trainer between generations."""

    def __init__(self, url: str, *, tp: int = 1, process: Optional[subprocess.Popen] = None,
                 log_path: Optional[str] = None, expected_names: Optional[set[str]] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, max_retries: int = 3, retry_backoff_s: float = 0.5,
                 request_timeout_s: float = 600.0, health_timeout_s: float = 25.0, batch_size: int = 256,
                 concurrency: int = 4, send_seed: bool = True, load_format: Optional[str] = FLATTENED,
                 weight_version: int = 0, unbatched: bool = False, api_key: Optional[str] = None,
                 moe_shape: Optional[tuple[int, int]] = None):
        self.url = url.rstrip("/")
        self.moe_shape = moe_shape
        """(num_layers, top_k) of the model's routed experts (MoE), to decode `routed_experts`."""
        self.tp = tp
        self.process = process
        self.log_path = log_path
        self.expected_names = expected_names
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self.max_retries = max_retries
        self.health_timeout_s = health_timeout_s
        self.unbatched = unbatched
        """One request per POST (SGLang's router takes no batches; it places each request itself)."""
        self.batch_size = 1 if unbatched else batch_size
        self.concurrency = concurrency
        self.send_seed = send_seed
        self.load_format = load_format
        self.weight_version = weight_version
        self.client = HTTPClient(self.url, timeout_s=request_timeout_s, max_retries=max_retries,
                                 backoff_s=retry_backoff_s, alive=self._dead_message, api_key=api_key)
        self.session = WeightSession(self.client)
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._released: set[str] = set()
        self._staging: Optional[torch.Tensor] = None  # shared memory the CPU buckets are flattened into
        self.server_module: Optional[str] = None
        """The module `launch` ran (sglang.launch_server or the CPU server); None for `connect`."""
        self.stats = {"generated": 0, "generate_retries": 0, "aborted_retries": 0, "bad_answer_retries": 0,
                      "weight_buckets": 0, "weight_bytes": 0, "cut": 0, "launch_port_retries": 0}
        self.lora_name: Optional[str] = None
        """The LoRA adapter every generate request names (SGLang's lora_path); None: the base weights."""
        self._cut_at = float("-inf")
        """When `abort_all(cut=True)` last cut the requests in flight (monotonic): SGLang's abort answers of
        requests sent before it are what was asked for, not a failure to retry."""

    @property
    def retries(self) -> int:
        """Every retry: resent /generate batches, requests SGLang aborted, answers that were not SGLang's,
        other HTTP calls retried, starts repeated on another port."""
        return (self.client.retries + self.stats["generate_retries"] + self.stats["aborted_retries"]
                + self.stats["bad_answer_retries"] + self.stats["launch_port_retries"])

    def refused_requests(self) -> Optional[int]:
        """Requests the server refused for a missing or wrong key, from its /metrics (the CPU server counts
        them; SGLang's server does not export such a count: None)."""
        try:
            text = self.client.get("/metrics", timeout_s=self.health_timeout_s, max_retries=0).text
        except SGLangRequestError:
            return None
        counts = re.findall(r'^mgrpo_cpu_server_refused_total\{[^}]*status="40[13]"\} (\d+)', text, re.M)
        return sum(map(int, counts)) if counts or "mgrpo_cpu_server_refused_total" in text else None

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def launch(cls, hf_dir: str, *, tp: int = 1, host: Optional[str] = None, port: Optional[int] = None,
               mem_fraction_static: float = 0.7, extra_args: Sequence[str] = (), startup_timeout_s: float = 900.0,
               enable_memory_saver: bool = True, log_dir: Optional[str] = None, env: Optional[dict] = None,
               server: Optional[str] = None, api_key: Optional[str] = None, ep: int = 1,
               return_routed_experts: bool = False, **engine_kwargs) -> "SGLangEngine":
        """Start a rollout server on this node's cluster address and wait until /health_generate
        answers: `python -m sglang.launch_server` where SGLang can run (its package and kernels, a
        CUDA device), else `python -m mgrpo.rollout.sglang.cpu.server`, with the same arguments.
        `server` forces one ('sglang' | 'cpu'). `api_key`: the server's API and admin key, handed over in
        a private file its `--config` reads (never on the command line), and sent by this client.
        `ep`: SGLang's --ep-size. `return_routed_experts`: --enable-return-routed-experts.
        `engine_kwargs` go to the constructor."""
        host = check_host(host if host is not None else node_ip())
        if "--host" in extra_args or "--port" in extra_args:
            raise ValueError("pass host=/port= to SGLangEngine.launch, not --host/--port in extra_args")
        if any(a.startswith(("--api-key", "--admin-api-key")) for a in extra_args):
            raise ValueError("pass api_key= to SGLangEngine.launch: a key in extra_args would be on the command line")
        module = choose_server(server)
        log_dir = log_dir or tempfile.mkdtemp(prefix="mgrpo-sglang-")

        def start(port: int) -> tuple[subprocess.Popen, str, str]:
            key_file = key_config_file(api_key) if api_key else None
            try:
                cmd = launch_command(module, hf_dir, tp=tp, host=host, port=port,
                                     mem_fraction_static=mem_fraction_static,
                                     weight_version=engine_kwargs.get("weight_version", 0),
                                     enable_memory_saver=enable_memory_saver, extra_args=extra_args, ep=ep,
                                     return_routed_experts=return_routed_experts, key_file=key_file)
                log_path = os.path.join(log_dir, f"sglang-{host}-{port}.log")
                url = url_of(host, port)
                log.info("starting the rollout server: %s (log: %s)", " ".join(cmd), log_path)
                return start_server(cmd, url, log_path, startup_timeout_s=startup_timeout_s, env=env,
                                    key_file=key_file), url, log_path
            finally:
                remove_key_config(key_file)  # read once at startup; a restart writes a new one

        (proc, url, log_path), port, port_retries = start_on_free_port(start, host, port)
        engine_kwargs.setdefault("moe_shape", checkpoint_moe_shape(hf_dir))
        engine = cls(url, tp=tp, process=proc, log_path=log_path, expected_names=checkpoint_tensor_names(hf_dir),
                     api_key=api_key, **engine_kwargs)
        engine.server_module = module
        engine.stats["launch_port_retries"] = port_retries
        return engine

    @classmethod
    def connect(cls, url: str, *, tp: int = 1, hf_dir: Optional[str] = None, **engine_kwargs) -> "SGLangEngine":
        """A client for a server someone else runs (`hf_dir`, when given, enables the completeness
        check of weight syncs)."""
        if hf_dir:
            engine_kwargs.setdefault("expected_names", checkpoint_tensor_names(hf_dir))
            engine_kwargs.setdefault("moe_shape", checkpoint_moe_shape(hf_dir))
        return cls(url, tp=tp, **engine_kwargs)

    def _dead_message(self) -> Optional[str]:
        if self.process is None or self.process.poll() is None:
            return None
        return f"server process exited with code {self.process.returncode}; last lines of {self.log_path}:\n" \
               f"{log_tail(self.log_path)}"

    # --- generation ---------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        if not requests:
            return []
        # SGLang takes one routed_experts_start_len per batched request: one batch per value (a multi-turn
        # dispatch mixes trajectories of every length; without routes every request has 0)
        groups: dict[int, list[GenerateRequest]] = {}
        for r in requests:
            groups.setdefault(r.routes_from if sampling.return_routed_experts else 0, []).append(r)
        batches = [g[i:i + self.batch_size] for _, g in sorted(groups.items())
                   for i in range(0, len(g), self.batch_size)]
        if len(batches) == 1:
            parts = [self._generate_batch(batches[0], sampling)]
        else:
            # the parts of one split batch go together (the server batches them again), up to MAX_SPLIT at once
            workers = min(len(batches), max(self.concurrency, min(len(groups), MAX_SPLIT)))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                parts = list(pool.map(lambda b: self._generate_batch(b, sampling), batches))
        results = sorted((r for part in parts for r in part), key=lambda r: r.uid)
        with self._lock:
            self.stats["generated"] += len(results)
        return results

    def _generate_batch(self, batch: list[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        """One batched POST. Transient failures resend the batch, requests SGLang aborted go again;
        both bounded by max_retries and counted."""
        done: list[GenerateResult] = []
        pending, attempt = batch, 0
        while pending:
            tag = uuid.uuid4().hex[:12]  # fresh rids per attempt: SGLang rejects a rid still in flight
            rids = [f"mgrpo-{tag}-{r.uid}" for r in pending]
            body = build_generate_payload(pending, sampling, rids=rids, stop_token_ids=self.stop_token_ids,
                                          single=self.unbatched,
                                          send_seed=self.send_seed)
            if self.lora_name is not None:
                body["lora_path"] = self.lora_name if self.unbatched else [self.lora_name] * len(pending)
            # one request through SGLang's router: its session key keeps a trajectory's turns on one engine
            session = pending[0].session if self.unbatched else None
            sent = time.monotonic()
            try:
                resp = self.client.post("/generate", body, max_retries=0,
                                        headers={ROUTING_KEY: session} if session else None)
                items, parsed = self._parse(resp, pending, sampling)
            except SGLangRequestError as e:
                dead = self._dead_message()
                bad = isinstance(e, SGLangBadResponseError)
                if (e.timeout or bad) and not dead:  # the server may still hold them: do not let two copies run
                    self._abort(rids)
                if dead or not (e.transient or bad) or attempt >= self.max_retries:
                    err = type(e)(f"/generate of {len(pending)} requests failed after {attempt + 1} attempts (retry "
                                  f"budget {self.max_retries}): {e}" + (f"\n{dead}" if dead else ""),
                                  status=e.status, transient=e.transient)
                    err.timeout = e.timeout
                    raise err from e
                attempt += 1
                self._count("bad_answer_retries" if bad else "generate_retries", 1)
                log.warning("SGLang /generate failed (%s); retry %d of %d", e, attempt, self.max_retries)
                time.sleep(min(self.client.backoff_s * 2 ** (attempt - 1), self.client.max_backoff_s))
                continue
            aborted = []
            for r, res in zip(pending, parsed):
                if res is None:
                    aborted.append(r)
                else:
                    done.append(res)
            if aborted and sent < self._cut_at:  # cut on purpose (the long tail): answered as aborted, no retry
                self._count("cut", len(aborted))
                done.extend(GenerateResult(uid=r.uid, token_ids=[], logprobs=[], finish_reason="abort",
                                           weight_version=self.weight_version) for r in aborted)
                aborted = []
            if aborted:
                if attempt >= self.max_retries:
                    reason = next((it.get("meta_info") or {}).get("finish_reason") for it in items
                                  if ((it.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort")
                    raise SGLangRequestError(f"{len(aborted)} requests were aborted by SGLang after {attempt + 1} "
                                             f"attempts (retry budget {self.max_retries}); e.g. {reason}")
                attempt += 1
                self._count("aborted_retries", len(aborted))
                log.warning("SGLang aborted %d of %d requests; retrying them (attempt %d)", len(aborted),
                            len(pending), attempt)
            pending = aborted
        return done

    def _parse(self, resp, pending: list[GenerateRequest], sampling: SamplingParams) -> tuple[list, list]:
        """The answer to one POST: its items and one result (None: aborted) per request, or
        SGLangBadResponseError."""
        try:
            items = resp.json()
        except ValueError as e:
            raise SGLangBadResponseError(f"the answer is not JSON ({e}): {resp.text[:200]!r}") from e
        if isinstance(items, dict) and self.unbatched:
            items = [items]
        if not isinstance(items, list) or len(items) != len(pending):
            got = f"{len(items)} results" if isinstance(items, list) else type(items).__name__
            raise SGLangBadResponseError(f"/generate answered {got} for {len(pending)} requests")
        return items, [parse_generate_item(item, r.uid, self.weight_version, sampling=sampling,
                                           prompt_len=len(r.prompt_ids), moe_shape=self.moe_shape,
                                           routes_from=r.routes_from)
                       for r, item in zip(pending, items)]

    # --- reward models (a server launched with --is-embedding) ------------------------------------------
    def classify(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """SGLang's reward endpoint (`/classify`, http_server.py): the score head's output for each token-id
        input, in order (a Bradley-Terry reward model: one float each). Transient failures are retried within
        the client's budget; an answer that is not SGLang's (not a list of {"embedding": [finite floats]} of the
        right length) raises SGLangBadResponseError."""
        import math

        if not inputs:
            return []
        items = self.client.json("POST", "/classify", {"input_ids": [list(x) for x in inputs]})
        if not isinstance(items, list) or len(items) != len(inputs):
            got = f"{len(items)} results" if isinstance(items, list) else type(items).__name__
            raise SGLangBadResponseError(f"/classify answered {got} for {len(inputs)} inputs")
        out = []
        for item in items:
            emb = item.get("embedding") if isinstance(item, dict) else None
            if not (isinstance(emb, list) and emb and all(isinstance(v, (int, float)) and math.isfinite(v)
                                                          for v in emb)):
                raise SGLangBadResponseError(f"/classify answered an item without a finite 'embedding': "
                                             f"{str(item)[:200]}")
            out.append([float(v) for v in emb])
        return out

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.stats[key] += n

    def _abort(self, rids: Sequence[str]) -> None:
        for rid in rids:  # best effort: a server that does not answer has nothing to abort
            try:
                self.client.post("/abort_request", {"rid": rid}, timeout_s=10, max_retries=0)
            except SGLangRequestError:
                return

    # --- weight sync (buckets arriving in this process, e.g. through the rollout group's Ray actor) ---
    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        bucket = list(named_tensors)
        if not bucket:
            return
        if "weights" in self._released:
            self.resume_memory(["weights"])  # loading into released weight memory would be lost
        if torch.cuda.is_available() and self.server_module != CPU_MODULE:
            # Handles to GPU memory: the server copies from it over CUDA IPC (same node, same GPUs).
            # Otherwise CPU tensors go as named shared memory (weights_tensor.py).
            bucket = [(n, t.to("cuda", non_blocking=True)) for n, t in bucket]
        self.session.begin()
        self._staging = staging_buffer(self._staging, bucket, self.load_format)
        keep_alive = payload_object(bucket, self.load_format, self._staging)
        self.client.post_result("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize(keep_alive) for _ in range(self.tp)],
            "load_format": self.load_format, "flush_cache": False, "abort_all_requests": False})
        del keep_alive
        with self._lock:
            self._received.update(n for n, _ in bucket)
            self.stats["weight_buckets"] += 1
            self.stats["weight_bytes"] += bucket_bytes(bucket)

    def load_lora_adapter(self, name: str, tensors: dict, config: dict, *, use: bool = True) -> int:
        """`POST /load_lora_adapter_from_tensors`: a PEFT adapter (`{PEFT name: tensor}`, adapter_config.json's
        fields) under `name`, one flattened payload per TP rank (node-local handles, as the tensor weight path);
        `use`: generate requests name it from now on. Returns the bytes sent."""
        bucket = sorted(tensors.items())
        if torch.cuda.is_available() and self.server_module != CPU_MODULE:
            bucket = [(n, t.to("cuda")) for n, t in bucket]
        payloads, keep_alive = tensor_payloads(bucket, self.tp, FLATTENED)
        self.client.post_result("/load_lora_adapter_from_tensors", {
            "lora_name": name, "config_dict": config, "serialized_named_tensors": payloads,
            "load_format": FLATTENED})
        del keep_alive
        if use:
            self.lora_name = name
        return bucket_bytes(bucket)

    def use_lora_adapter(self, name: str, tensors: dict, config: dict, version: int) -> int:
        """Load `name`, name it in every request from now on, unload the adapter used before, and set the server's
        weight version (what its answers report); the bytes sent."""
        before = self.lora_name
        sent = self.load_lora_adapter(name, tensors, config)
        if before is not None and before != name:
            self.unload_lora_adapter(before)
        self.session.set_version(version)
        self.weight_version = version
        return sent

    def unload_lora_adapter(self, name: str) -> None:
        self.client.post_result("/unload_lora_adapter", {"lora_name": name})
        if self.lora_name == name:
            self.lora_name = None

    def finish_weight_update(self, version: int) -> None:
        """Close the session, check completeness (for buckets that came through this object), set
        the server's weight version, flush the prefix cache (it holds KV of the old weights)."""
        with self._lock:
            received, self._received = self._received, set()
        had_session = self.session.end()
        if not had_session:
            raise RuntimeError(f"weight sync to version {version}: no bucket reached the SGLang server at {self.url}")
        if received and self.expected_names is not None:
            missing = sorted(self.expected_names - received)
            if missing:
                raise RuntimeError(f"weight sync to version {version} is incomplete: {len(missing)} tensors never "
                                   f"arrived at {self.url}, e.g. {missing[:5]}")
        self.session.set_version(version)
        self.session.flush_cache()
        self.weight_version = version

    # --- lifecycle ----------------------------------------------------------------------------------
    def health(self) -> EngineHealth:
        detail: dict[str, Any] = {"url": self.url, "retries": self.retries, "http_retries": self.client.retries,
                                  **self.stats, "released": sorted(self._released)}
        dead = self._dead_message()
        if dead:
            return EngineHealth(ok=False, weight_version=self.weight_version, detail={**detail, "error": dead})
        # /health_generate runs a one-token generation; with memory released that must not happen.
        path = "/health" if self._released else "/health_generate"
        try:
            ok = self.client.get(path, timeout_s=self.health_timeout_s, max_retries=0).status_code == 200
        except SGLangRequestError as e:
            return EngineHealth(ok=False, weight_version=self.weight_version, detail={**detail, "error": str(e)})
        try:
            info = self.client.get("/model_info", timeout_s=self.health_timeout_s, max_retries=0).json()
            detail["server_weight_version"] = info.get("weight_version")
        except (SGLangRequestError, ValueError):
            pass
        return EngineHealth(ok=ok, weight_version=self.weight_version, detail=detail)

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Colocated mode: free the server's GPU memory (all of it by default) while the trainer runs.
        Needs the server started with --enable-memory-saver and no request in flight."""
        todo = [t for t in (tags or MEMORY_TAGS) if t not in self._released]
        if not todo:
            return
        self.client.post("/release_memory_occupation", {"tags": todo})
        self._released.update(todo)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take back what was released (all by default; `["weights"]` first when weights are about to
        be synced, then the rest before generating). Resuming what is not released is a no-op:
        SGLang would fail on it."""
        todo = [t for t in (tags or MEMORY_TAGS) if t in self._released]
        if not todo:
            return
        self.client.post("/resume_memory_occupation", {"tags": todo})
        self._released.difference_update(todo)

    def abort_all(self, cut: bool = False) -> None:
        """SGLang's /abort_request with abort_all. `cut`: the requests in flight are being cut on purpose
        (rollout.over_sample_rate): their abort answers come back as results with finish_reason 'abort'
        (no tokens) instead of being retried."""
        if cut:
            self._cut_at = time.monotonic()
        self.client.post("/abort_request", {"abort_all": True})

    def shutdown(self) -> None:
        """Stop the server this object launched (its whole process group); no-op for `connect`."""
        if self.process is not None:
            terminate_group(self.process)
