"""The SGLang engine client against a stand-in server speaking SGLang's HTTP JSON.

SGLang itself needs CUDA, so `FakeSGLang` (standard-library http.server on 127.0.0.1, in a
thread) implements the request/response shapes read in sglang 0.5.23:
- routes and status codes: sglang/srt/entrypoints/http_server.py (generate_request, health_generate,
  flush_cache, update_weights_from_tensor, update_weights_from_distributed, init/destroy
  weights_update_group, begin/end_weight_update, update_weight_version, release/resume
  memory_occupation, model_info, abort_request);
- request fields: sglang/srt/managers/io_struct.py, and the strict /generate schema in
  sglang/api/v1/api_types.py (`_FIELDS_SamplingParams`; unknown fields are refused with 400);
- the answer of /generate: sglang/srt/managers/tokenizer_manager.py (`text`, `output_ids`,
  `meta_info` with `finish_reason` dicts from managers/schedule_batch.py FINISH_*.to_json,
  `weight_version` as a string, `output_token_logprobs` as (logprob, token_id, text) triples);
- the weight-update session rules and messages: managers/scheduler_components/weight_updater.py.
Where the installed sglang wheel is present, its own code is used to check our side: the JSON
contract decoder (needs msgspec), `MultiprocessingSerializer`/`SafeUnpickler` and
`init_custom_process_group` (taken out of sglang/srt/utils/common.py by `ast`, because importing
sglang pulls in CUDA-only packages).
"""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import importlib.util
import io
import json
import os
import pickle
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Union

import pytest
import torch

from mgrpo.rollout.sglang.client import (SGLangEngine, build_generate_payload, checkpoint_tensor_names,
                                         parse_generate_item)
from mgrpo.rollout.sglang.http import SGLangRequestError, SGLangUnavailableError
from mgrpo.rollout.sglang.server import check_host, start_server
from mgrpo.rollout.types import GenerateRequest, SamplingParams

EOS = 2
VOCAB = 50

# sglang/api/v1/api_types.py::_FIELDS_SamplingParams (0.5.23)
SAMPLING_FIELDS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                   "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                   "custom_params", "beam_width", "watermark", "choice"}
# sglang/srt/managers/io_struct.py request structs (0.5.23): the fields each endpoint accepts.
FIELDS = {
    "/update_weights_from_tensor": {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                    "weight_version", "selector", "torch_empty_cache", "rid"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format", "selector",
                                         "torch_empty_cache", "rid"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                   "backend", "rid"},
    "/destroy_weights_update_group": {"group_name", "rid"},
    "/begin_weight_update": {"selector", "old_role", "new_role", "safe_to_restore", "rid"},
    "/end_weight_update": {"rid"},
    "/update_weight_version": {"new_version", "abort_all_requests", "rid"},
    "/release_memory_occupation": {"tags", "rid"},
    "/resume_memory_occupation": {"tags", "rid"},
    "/abort_request": {"abort_all", "finished_reason", "abort_message", "weight_versions", "rid"},
}


# --- SGLang's own code, where the wheel is installed ------------------------------------------------------
def _sglang_dir():
    spec = importlib.util.find_spec("sglang")
    return os.path.dirname(spec.origin) if spec and spec.origin else None


@functools.lru_cache(None)
def sglang_common():
    """MultiprocessingSerializer, SafeUnpickler and init_custom_process_group from the installed
    sglang/srt/utils/common.py, executed on their own (None without the wheel)."""
    d = _sglang_dir()
    path = d and os.path.join(d, "srt", "utils", "common.py")
    if not path or not os.path.exists(path):
        return None
    tree = ast.parse(open(path).read())
    wanted = {"_safe_load_torch_storage", "SafeUnpickler", "MultiprocessingSerializer", "init_custom_process_group"}
    body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in wanted]
    from multiprocessing.reduction import ForkingPickler

    ns = {"io": io, "pickle": pickle, "torch": torch, "binascii": binascii, "ForkingPickler": ForkingPickler,
          "pybase64": base64, "Union": Union, "List": List, "functools": functools,
          "torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return types.SimpleNamespace(**{k: ns[k] for k in wanted if k in ns})


@functools.lru_cache(None)
def sglang_contract():
    """sglang/api/v1/api_types.py (needs only msgspec), or None."""
    d = _sglang_dir()
    path = d and os.path.join(d, "api", "v1", "api_types.py")
    if not path or not os.path.exists(path) or importlib.util.find_spec("msgspec") is None:
        return None
    spec = importlib.util.spec_from_file_location("_sglang_api_types", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def deserialize_payload(data: str):
    """What an SGLang TP rank does with its entry of serialized_named_tensors."""
    common = sglang_common()
    if common is not None:
        return common.MultiprocessingSerializer.deserialize(data)
    from mgrpo.rollout.sglang.weights_tensor import PAYLOAD_GLOBALS

    class Restricted(pickle.Unpickler):  # same idea, our declared globals only
        def find_class(self, module, name):
            if (module, name) not in PAYLOAD_GLOBALS:
                raise RuntimeError(f"Blocked unsafe global ({module}.{name})")
            return super().find_class(module, name)

    return Restricted(io.BytesIO(base64.b64decode(data, validate=True))).load()


def join_group(master_address, master_port, rank, world_size, group_name, backend):
    common = sglang_common()
    if common is not None:  # SGLang's own group construction
        return common.init_custom_process_group(backend=backend, init_method=f"tcp://{master_address}:{master_port}",
                                                world_size=world_size, rank=rank, group_name=group_name)
    from mgrpo.rollout.sglang.weights_distributed import new_weight_update_group

    return new_weight_update_group(master_address, master_port, world_size, group_name, backend=backend, rank=rank)


# --- the stand-in server -------------------------------------------------------------------------------------
class FakeSGLang:
    """A bounded, self-stopping stand-in for one SGLang server (TP size `tp`)."""

    def __init__(self, tp: int = 1, lifetime_s: float = 60.0):
        self.tp = tp
        self.calls: list[tuple[str, object]] = []
        self.fail_generate: list[int] = []  # statuses to answer /generate with before succeeding
        self.delay_generate: list[float] = []  # seconds to stall /generate calls, first ones first
        self.abort_uids: set[int] = set()  # uids aborted once
        self.health_status = 200
        self.weight_version = "0"
        self.session_open = False
        self.weights: dict[str, torch.Tensor] = {}
        self.offloaded: set[str] = set()
        self.groups: dict = {}
        self.errors: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body=None, text=None):
                data = (json.dumps(body) if text is None else text).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if text is None else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append((self.path, None))
                if self.path in ("/health", "/health_generate"):
                    return self._send(fake.health_status, text="")
                if self.path == "/model_info":
                    return self._send(200, {"weight_version": fake.weight_version, "model_path": "fake"})
                return self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"null")
                fake.calls.append((self.path, body))
                try:
                    status, out = fake.handle(self.path, body)
                except Exception as e:  # noqa: BLE001 - surfaced to the test
                    fake.errors.append(f"{self.path}: {type(e).__name__}: {e}")
                    status, out = 400, {"success": False, "message": str(e)}
                if isinstance(out, str):
                    return self._send(status, text=out)
                return self._send(status, out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self._timer = threading.Timer(lifetime_s, self.stop)  # never outlives a stuck test
        self._timer.daemon = True
        self._timer.start()

    def stop(self):
        self._timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def bodies(self, path):
        return [b for p, b in self.calls if p == path]

    # --- behaviour --------------------------------------------------------------------------------------
    @staticmethod
    def tokens_for(prompt: list[int], max_new: int) -> tuple[list[int], str]:
        """Deterministic 'model': counts up from sum(prompt); EOS after (sum % 5) + 1 tokens."""
        stop_after = sum(prompt) % 5 + 1
        toks = [(sum(prompt) + k) % (VOCAB - 3) + 3 for k in range(stop_after)] + [EOS]
        if len(toks) > max_new:
            return toks[:max_new], "length"
        return toks, "stop"

    def handle(self, path, body):
        if path in FIELDS:
            unknown = set(body or {}) - FIELDS[path]
            if unknown:
                return 400, {"success": False, "message": f"unknown fields {sorted(unknown)}"}
        if path == "/generate":
            return self.generate(body)
        if path == "/begin_weight_update":
            if self.session_open:
                return 400, {"success": False, "message": "a weight-update session is already open; "
                                                          "call end_weight_update() first"}
            self.session_open = True
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update":
            if not self.session_open:
                return 400, {"success": False, "message": "no weight-update session is open; "
                                                          "call begin_weight_update() first"}
            self.session_open = False
            return 200, {"success": True, "message": "Success"}
        if path == "/update_weights_from_tensor":
            if not self.session_open:
                return 400, {"success": False, "message": "update_weights_from_tensor must run "
                                               "between begin_weight_update() and end_weight_update()"}
            payloads = body["serialized_named_tensors"]
            assert len(payloads) == self.tp, f"{len(payloads)} payloads for tp={self.tp}"
            for rank in range(self.tp):  # every rank decodes its own entry
                data = deserialize_payload(payloads[rank])
                if body.get("load_format") == "flattened_bucket":
                    flat = data["flattened_tensor"]
                    named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                             for m in data["metadata"]]
                else:
                    named = list(data)
                for name, t in named:
                    self.weights[name] = t.clone()
            return 200, {"success": True, "message": "Success"}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                         "new_version": body["new_version"]}
        if path == "/flush_cache":
            return 200, "Cache flushed.\n"
        if path == "/release_memory_occupation":
            self.offloaded |= set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
            return 200, None
        if path == "/resume_memory_occupation":
            for t in body.get("tags") or ["weights", "kv_cache", "cuda_graph"]:
                self.offloaded.remove(t)  # KeyError -> 400, as SGLang's set.remove would
            return 200, None
        if path == "/abort_request":
            return 200, ""
        if path == "/init_weights_update_group":
            assert self.tp == 1, "the stand-in joins as a single rank"
            self.groups[body["group_name"]] = join_group(body["master_address"], body["master_port"],
                                                         body["rank_offset"], body["world_size"], body["group_name"],
                                                         body["backend"])
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path == "/destroy_weights_update_group":
            pg = self.groups.pop(body["group_name"])
            torch.distributed.destroy_process_group(pg)
            return 200, {"success": True, "message": "Succeeded to destroy custom process group."}
        if path == "/update_weights_from_distributed":
            return self.receive_distributed(body)
        return 404, {"detail": "Not Found"}

    def generate(self, body):
        contract = sglang_contract()
        if contract is not None:
            try:
                contract.GenerateRequest.from_json_value(body)
            except contract.JsonContractError as e:
                return 400, {"error": str(e)}
        if self.fail_generate:
            return self.fail_generate.pop(0), {"error": "fake transient failure"}
        if self.delay_generate:
            time.sleep(self.delay_generate.pop(0))
        sps = body["sampling_params"]
        out = []
        for i, (rid, prompt) in enumerate(zip(body["rid"], body["input_ids"])):
            sp = sps[i] if isinstance(sps, list) else sps
            unknown = set(sp) - SAMPLING_FIELDS
            if unknown:
                return 400, {"error": f"unknown sampling fields {sorted(unknown)}"}
            uid = int(rid.rsplit("-", 1)[1])
            if uid in self.abort_uids:
                self.abort_uids.discard(uid)
                meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort before prefill",
                                                     "status_code": None, "err_type": None},
                        "prompt_tokens": len(prompt), "weight_version": self.weight_version,
                        "output_token_logprobs": [], "completion_tokens": 0}
                out.append({"text": "", "output_ids": [], "meta_info": meta})
                continue
            toks, kind = self.tokens_for(prompt, sp["max_new_tokens"])
            finish = {"type": "stop", "matched": EOS} if kind == "stop" else {"type": "length",
                                                                              "length": sp["max_new_tokens"]}
            lps = [[-0.125 * (k + 1), t, None] for k, t in enumerate(toks)]
            meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                    "weight_version": self.weight_version, "num_retractions": 0, "input_token_logprobs": [],
                    "output_token_logprobs": lps, "output_token_logprobs_length": len(lps),
                    "reasoning_tokens": 0, "completion_tokens": len(toks), "cached_tokens": 0}
            out.append({"text": " ".join(map(str, toks)), "output_ids": toks, "meta_info": meta})
        return 200, out if isinstance(body["input_ids"][0], list) else out[0]

    def receive_distributed(self, body):
        if not self.session_open:
            return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                      "begin_weight_update() and end_weight_update()"}
        group = self.groups[body["group_name"]]
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        if body.get("load_format") == "flattened_bucket":
            # weight_sync/tensor_bucket.py::FlattenedTensorBucket.empty, then one broadcast from rank 0
            metas, offset = [], 0
            for name, dt, shape in zip(body["names"], dtypes, body["shapes"]):
                if offset % dt.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dt}")
                size = torch.Size(shape).numel() * dt.itemsize
                metas.append((name, dt, shape, offset, offset + size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8)
            torch.distributed.broadcast(flat, src=0, group=group)
            named = [(n, flat[a:b].view(dt).reshape(shape)) for n, dt, shape, a, b in metas]
        else:
            named = []
            for name, dt, shape in zip(body["names"], dtypes, body["shapes"]):
                t = torch.empty(shape, dtype=dt)
                torch.distributed.broadcast(t, src=0, group=group)
                named.append((name, t))
        for n, t in named:
            self.weights[n] = t.clone()
        return 200, {"success": True, "message": "Succeeded to update parameter online."}


# --- tests --------------------------------------------------------------------------------------------------
def _requests(n=4):
    return [GenerateRequest(uid=i, prompt_ids=[1, i + 3, 5]) for i in range(n)]


def _engine(fake, **kw):
    kw.setdefault("retry_backoff_s", 0.01)
    return SGLangEngine.connect(fake.url, tp=fake.tp, **kw)


def test_generate_request_fields_and_results():
    with FakeSGLang() as fake:
        eng = _engine(fake, stop_token_ids=[EOS])
        reqs = _requests(4)
        out = eng.generate(reqs, SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=4, seed=11))
        (body,) = fake.bodies("/generate")
        assert body["input_ids"] == [r.prompt_ids for r in reqs]
        assert body["return_logprob"] is True
        assert len(set(body["rid"])) == 4
        sps = body["sampling_params"]
        assert [sp["temperature"] for sp in sps] == [0.7] * 4
        assert sps[0]["top_p"] == 0.9 and sps[0]["top_k"] == -1 and sps[0]["max_new_tokens"] == 4
        assert sps[0]["no_stop_trim"] is True and sps[0]["skip_special_tokens"] is False
        assert sps[0]["stop_token_ids"] == [EOS]
        assert len({sp["sampling_seed"] for sp in sps}) == 4  # n copies of a prompt must not share a seed
        assert [r.uid for r in out] == [0, 1, 2, 3]
        for r, req in zip(out, reqs):
            toks, kind = FakeSGLang.tokens_for(req.prompt_ids, 4)
            assert r.token_ids == toks and r.finish_reason == kind
            assert r.logprobs == [-0.125 * (k + 1) for k in range(len(toks))]
            assert r.weight_version == 0
        # prompt sums 9..12 stop after 5, 1, 2, 3 tokens (+EOS): uid 0 is cut by max_new_tokens
        assert [r.finish_reason for r in out] == ["length", "stop", "stop", "stop"]
        assert out[1].token_ids[-1] == EOS
        assert eng.retries == 0


def test_generate_without_seed_sends_one_sampling_dict_and_greedy_as_temperature_zero():
    with FakeSGLang() as fake:
        eng = _engine(fake)
        eng.generate(_requests(2), SamplingParams(temperature=0.0, max_new_tokens=3))
        (body,) = fake.bodies("/generate")
        assert isinstance(body["sampling_params"], dict)
        assert body["sampling_params"]["temperature"] == 0.0 and "sampling_seed" not in body["sampling_params"]
        assert "stop_token_ids" not in body["sampling_params"]


def test_payload_passes_sglang_json_contract():
    contract = sglang_contract()
    if contract is None:
        pytest.skip("sglang wheel or msgspec not installed: the JSON contract decoder is unavailable")
    body = build_generate_payload(_requests(3), SamplingParams(temperature=1.0, top_k=5, seed=3), rids=["a", "b", "c"],
                                  stop_token_ids=[EOS])
    req = contract.GenerateRequest.from_json_value(body)
    assert req.input_ids == [[1, 3, 5], [1, 4, 5], [1, 5, 5]]
    with pytest.raises(contract.JsonContractError):  # the decoder is strict: this check can fail
        contract.GenerateRequest.from_json_value({**body, "sampling_params": {"temprature": 1.0}})


def test_retries_transient_503_and_counts_them():
    with FakeSGLang() as fake:
        fake.fail_generate = [503, 502]
        eng = _engine(fake, max_retries=3)
        out = eng.generate(_requests(3), SamplingParams(max_new_tokens=8))
        assert len(out) == 3 and all(r.finish_reason == "stop" for r in out)
        assert len(fake.bodies("/generate")) == 3
        assert eng.retries == 2 and eng.stats["generate_retries"] == 2 and eng.health().detail["retries"] == 2


def test_gives_up_after_the_retry_budget_with_a_clear_error():
    with FakeSGLang() as fake:
        fake.fail_generate = [503] * 10
        eng = _engine(fake, max_retries=2)
        with pytest.raises(SGLangRequestError, match=r"failed after 3 attempts \(retry budget 2\).*HTTP 503"):
            eng.generate(_requests(2), SamplingParams())
        assert len(fake.bodies("/generate")) == 3 and eng.retries == 2


def test_timed_out_batch_is_aborted_on_the_server_then_resent():
    with FakeSGLang() as fake:
        fake.delay_generate = [1.5]
        eng = _engine(fake, max_retries=1, request_timeout_s=0.3)
        out = eng.generate(_requests(2), SamplingParams(max_new_tokens=8))
        assert [r.uid for r in out] == [0, 1]
        first, second = fake.bodies("/generate")
        assert fake.bodies("/abort_request") == [{"rid": rid} for rid in first["rid"]]
        assert not set(first["rid"]) & set(second["rid"])
        assert eng.stats["generate_retries"] == 1


def test_client_error_is_not_retried():
    with FakeSGLang() as fake:
        fake.fail_generate = [400]
        eng = _engine(fake, max_retries=3)
        with pytest.raises(SGLangRequestError, match="HTTP 400.*fake transient failure") as e:
            eng.generate(_requests(1), SamplingParams())
        assert e.value.status == 400 and eng.retries == 0


def test_connection_refused_is_retried_then_reported():
    with FakeSGLang() as fake:
        url = fake.url
    eng = SGLangEngine.connect(url, max_retries=1, retry_backoff_s=0.01)
    with pytest.raises(SGLangRequestError, match="failed after 2 attempts.*ConnectionError"):
        eng.generate(_requests(1), SamplingParams())
    assert eng.retries == 1
    assert eng.health().ok is False


def test_aborted_requests_are_retried_not_dropped():
    with FakeSGLang() as fake:
        fake.abort_uids = {1, 3}
        eng = _engine(fake, max_retries=2)
        out = eng.generate(_requests(4), SamplingParams(max_new_tokens=8))
        assert [r.uid for r in out] == [0, 1, 2, 3]
        second = fake.bodies("/generate")[1]
        assert second["input_ids"] == [[1, 4, 5], [1, 6, 5]]  # only the aborted ones went again
        assert eng.stats["aborted_retries"] == 2 and eng.retries == 2


def test_batches_split_and_reassemble_in_uid_order():
    with FakeSGLang() as fake:
        eng = _engine(fake, batch_size=3, concurrency=2)
        reqs = _requests(8)[::-1]
        out = eng.generate(reqs, SamplingParams(max_new_tokens=8, seed=1))
        assert [r.uid for r in out] == list(range(8))
        assert sorted(len(b["input_ids"]) for b in fake.bodies("/generate")) == [2, 3, 3]


def test_parse_rejects_inconsistent_answers():
    item = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                "output_token_logprobs": [[-0.5, 5, None]], "weight_version": "7"}}
    with pytest.raises(SGLangRequestError, match="disagree"):
        parse_generate_item(item, 0, 0)
    item["output_ids"] = [5]
    assert parse_generate_item(item, 0, 0).weight_version == 7
    item["meta_info"]["weight_version"] = "default"
    assert parse_generate_item(item, 0, 4).weight_version == 4
    item["meta_info"]["finish_reason"] = {"type": "weird"}
    with pytest.raises(SGLangRequestError, match="unexpected finish_reason"):
        parse_generate_item(item, 0, 0)


def test_weight_update_through_engine_then_version_in_results():
    bucket1 = [("model.embed_tokens.weight", torch.randn(6, 4)), ("model.norm.weight", torch.randn(4).bfloat16())]
    bucket2 = [("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, dtype=torch.float16))]
    with FakeSGLang(tp=2) as fake:
        eng = _engine(fake, expected_names={n for n, _ in bucket1 + bucket2})
        eng.update_weights(bucket1)
        eng.update_weights(bucket2)
        eng.finish_weight_update(3)
        paths = [p for p, _ in fake.calls]
        assert paths == ["/begin_weight_update", "/update_weights_from_tensor", "/update_weights_from_tensor",
                         "/end_weight_update", "/update_weight_version", "/flush_cache"]
        upd = fake.bodies("/update_weights_from_tensor")[0]
        assert upd["load_format"] == "flattened_bucket" and upd["flush_cache"] is False
        assert upd["abort_all_requests"] is False and len(upd["serialized_named_tensors"]) == 2
        assert fake.bodies("/update_weight_version") == [{"new_version": "3", "abort_all_requests": False}]
        for name, t in bucket1 + bucket2:
            assert fake.weights[name].dtype == t.dtype and torch.equal(fake.weights[name], t), name
        assert eng.weight_version == 3 and not fake.errors
        out = eng.generate(_requests(1), SamplingParams())
        assert out[0].weight_version == 3  # from the server's meta_info


def test_incomplete_weight_sync_is_an_error_and_closes_the_session():
    with FakeSGLang() as fake:
        eng = _engine(fake, expected_names={"a", "b", "c"}, load_format=None)
        eng.update_weights([("a", torch.ones(2)), ("b", torch.zeros(3))])
        with pytest.raises(RuntimeError, match=r"incomplete: 1 tensors never arrived.*\['c'\]"):
            eng.finish_weight_update(1)
        assert fake.session_open is False and eng.weight_version == 0
        assert torch.equal(fake.weights["b"], torch.zeros(3))
        with pytest.raises(RuntimeError, match="no bucket reached"):
            eng.finish_weight_update(2)


def test_release_resume_and_health_while_released():
    with FakeSGLang() as fake:
        eng = _engine(fake)
        assert eng.health().ok and fake.calls[-2][0] == "/health_generate"
        eng.release_memory()
        assert fake.offloaded == {"weights", "kv_cache", "cuda_graph"}
        h = eng.health()
        assert h.ok and h.detail["released"] == ["cuda_graph", "kv_cache", "weights"]
        assert ("/health_generate", None) not in fake.calls[-2:]  # no generation while memory is released
        eng.update_weights([("w", torch.ones(1))])  # resumes the weights before loading into them
        assert fake.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}]
        eng.resume_memory()
        assert fake.bodies("/resume_memory_occupation")[-1] == {"tags": ["kv_cache", "cuda_graph"]}
        eng.resume_memory()  # nothing left: no call (SGLang fails on resuming what is not released)
        assert len(fake.bodies("/resume_memory_occupation")) == 2 and not fake.offloaded


def test_health_reports_server_weight_version_and_failure():
    with FakeSGLang() as fake:
        eng = _engine(fake)
        h = eng.health()
        assert h.ok and h.detail["server_weight_version"] == "0"
        fake.health_status = 503
        assert eng.health().ok is False


# --- launch ----------------------------------------------------------------------------------------------
def test_launch_refuses_wildcard_addresses():
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="cluster address"):
            SGLangEngine.launch("/nonexistent", host=host)
    assert check_host("10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError, match="host="):
        SGLangEngine.launch("/nonexistent", host="127.0.0.1", extra_args=["--host", "0.0.0.0"])


def test_forcing_sglang_where_it_cannot_run_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SGLangUnavailableError, match=r"(?s)cannot run here.*rollout\.engine=sglang"):
        SGLangEngine.launch("/nonexistent", host="127.0.0.1", server="sglang")
    with pytest.raises(ValueError, match="one of"):
        SGLangEngine.launch("/nonexistent", host="127.0.0.1", server="tpu")


def test_dead_server_reports_its_log_tail(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('loading...'); print('RuntimeError: CUDA out of memory', "
           "flush=True); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        start_server(cmd, "http://127.0.0.1:9", str(tmp_path / "s.log"), startup_timeout_s=30, poll_s=0.1)


def test_server_that_never_gets_healthy_is_killed(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('stuck', flush=True); time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"(?s)startup_timeout_s=1.*stuck"):
        start_server(cmd, "http://127.0.0.1:9", str(tmp_path / "s.log"), startup_timeout_s=1, poll_s=0.1)
    assert time.monotonic() - t0 < 20


_MINI_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == '/health_generate' else 404); self.end_headers()
HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def test_started_server_is_owned_and_shut_down(tmp_path):
    from mgrpo.rollout.sglang.server import free_port

    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    proc = start_server([sys.executable, "-c", _MINI_SERVER, str(port)], url, str(tmp_path / "s.log"),
                        startup_timeout_s=30, poll_s=0.1)
    eng = SGLangEngine(url, process=proc, log_path=str(tmp_path / "s.log"))
    assert eng.health().ok
    eng.shutdown()
    assert proc.poll() is not None
    h = eng.health()
    assert not h.ok and "exited" in h.detail["error"]


def test_checkpoint_tensor_names(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert checkpoint_tensor_names(str(tmp_path)) == {"model.embed_tokens.weight"}
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert checkpoint_tensor_names(str(tmp_path)) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert checkpoint_tensor_names(str(tmp_path / "missing")) is None
