"""Malformed input never hurts a rollout server or goes unnoticed by the client.

A bounded fuzz (fixed seed, a few hundred requests) against every endpoint of the CPU server: wrong JSON
types, missing and unknown fields, out-of-range sampling values, token ids at or past the vocabulary,
empty batches, mismatched list lengths, truncated and garbage base64 and serialized tensors (one of them
a pickle that would run code), oversized bodies, wrong methods. Every one is answered 4xx with a message;
afterwards the server is healthy, a good request gets exactly the tokens it got before, and its memory
did not grow with the number of requests. Then the client facing garbage, partial JSON, a wrong shape and
a hang: retries within its budget, counts them, and fails by name; nothing is dropped."""

from __future__ import annotations

import base64
import json
import os
import pickle
import random

import pytest
import requests
import torch

from mgrpo.rollout.sglang import SGLangEngine, SGLangRequestError
from mgrpo.rollout.sglang.cpu.guard import MAX_BODY_BYTES
from mgrpo.rollout.sglang.http import SGLangBadResponseError
from mgrpo.rollout.sglang.weights_tensor import serialize
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import VOCAB, FaultProxy, post

SEED = 1234
GOOD = {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["good-a", "good-b"], "return_logprob": True,
        "sampling_params": [{"temperature": 0.0, "max_new_tokens": 6},
                            {"temperature": 0.8, "top_k": 5, "max_new_tokens": 6, "sampling_seed": 9}]}
SINGLE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
BATCH = {"input_ids": [[1, 2], [3]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}

# Values that are wrong for a field whatever else the body says.
BAD = {
    "input_ids": ["x", 5, {"a": 1}, [], [[]], [1.5], [True], ["1"], [[1], "x"], [[1], []], [-1], [VOCAB], [2 ** 40],
                  [[VOCAB + 3]], [[1, 2], [3, 2 ** 70]], None],
    "rid": [5, {"a": 1}, [1, 2], ["a"] * 3],
    "sampling_params": ["x", 5, [{}] * 3, {"temperature": "hot"}, {"temperature": -1}, {"temperature": float("inf")},
                        {"top_p": 0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": -2}, {"top_k": 1.5},
                        {"max_new_tokens": -1}, {"max_new_tokens": 10 ** 9}, {"max_new_tokens": 2 ** 63},
                        {"max_new_tokens": 1.5}, {"min_p": 2}, {"min_p": 0.1}, {"n": 2}, {"stop": 5}, {"stop": [1]},
                        {"stop": ["x"] * 33}, {"structural_tag": "{not json"}, {"regex": "a+", "ebnf": 'root ::= "a"'},
                        {"frequency_penalty": 1.0}, {"temprature": 1.0}, {"stop_token_ids": "x"},
                        {"stop_token_ids": [1.5]}, {"sampling_seed": "x"}, {"ignore_eos": "yes"}, [[1]]],
    "return_logprob": ["yes", 2, [True] * 3, {"a": 1}],
    "return_sampling_mask": ["yes", 2],
    "sampling_logprobs_mode": ["all", 5],
    "return_routed_experts": ["yes", 2],
    "routed_experts_start_len": ["x", 1.5],
    "stream": [True], "logprob_start_len": ["x", 1.5], "top_logprobs_num": [-1, "x", 1.5], "text": ["hello", ["a", "b"]],
    "foo": [1, "bar", [1]], "input_embeds": [[[0.0]]],
}


def _message(r: requests.Response) -> str:
    body = r.json()
    if isinstance(body, dict):
        err = body.get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return msg or body.get("message") or body.get("detail") or ""
    return ""


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


class Fuzz:
    """Sends malformed requests; checks each answer (4xx, JSON, a message) and counts."""

    def __init__(self, url: str):
        self.url = url
        self.sent = 0
        self.statuses: dict[int, int] = {}

    def send(self, method: str, path: str, body=None, raw: bytes | None = None, headers=None, expect=None):
        data = raw if raw is not None else json.dumps(body).encode()
        r = requests.request(method, self.url + path, data=data, timeout=60,
                             headers={"Content-Type": "application/json", **(headers or {})})
        self.sent += 1
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert 400 <= r.status_code < 500, (method, path, (body if raw is None else raw[:80]), r.status_code, r.text)
        assert _message(r), (path, r.text)
        if expect is not None:
            assert expect in _message(r), (path, body, r.text)
        return r

    def oversized(self, claimed: int) -> None:
        """A body whose declared length is past the bound: answered 413 before a byte of it is read; and one
        sent in chunks (no length declared), cut off once it passes the bound."""
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", "/generate")
        conn.putheader("Content-Length", str(claimed))
        conn.putheader("Content-Type", "application/json")
        conn.endheaders()
        conn.send(b'{"input_ids": [')  # the rest never comes
        r = conn.getresponse()
        assert r.status == 413 and b"limit" in r.read()
        conn.close()
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", "/generate")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        chunk = b" " * 2 ** 20
        for _ in range(claimed // len(chunk) + 2):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
        r = conn.getresponse()
        assert r.status == 413 and b"limit" in r.read()
        conn.close()
        self.sent += 2
        self.statuses[413] = self.statuses.get(413, 0) + 2


def _generate_cases(rng: random.Random) -> list:
    """Fixed malformed bodies, then random ones: a valid base with 1-3 fields set to wrong values."""
    cases = [raw for raw in (b"", b"{", b'{"input_ids": [1,', b"\xff\xfe garbage", b"[]", b'"x"', b"5", b"null",
                             b'{"input_ids": NaN}')]
    for field, values in BAD.items():
        for v in values:
            for base in (SINGLE, BATCH):
                body = {**base, field: v}
                if v is None:
                    del body[field]
                cases.append(body)
    for _ in range(150):
        body = dict(rng.choice([SINGLE, BATCH]))
        for field in rng.sample(sorted(BAD), rng.randint(1, 3)):
            body[field] = rng.choice(BAD[field])
            if body[field] is None:
                del body[field]
        cases.append(body)
    return cases


def _tensor_payloads() -> list:
    """serialized_named_tensors entries that must be refused: a real payload cut short or garbled, not
    base64, base64 of junk, of the wrong objects, of a pickle that would run a command, and real payloads
    (tensors in shared memory, each sent once so the server releases it) of a wrong shape, an unknown name,
    or a good tensor next to a bad one (nothing may be loaded)."""
    empty = serialize([("model.norm.weight", torch.ones(0))])  # no shared-memory segment behind it
    b64 = lambda obj: base64.b64encode(pickle.dumps(obj)).decode()  # noqa: E731
    return [empty[: len(empty) // 2], empty[:-3] + "!!!", "not base64 at all",
            base64.b64encode(b"\x80\x04junk").decode(),
            b64([1, 2, 3]), b64({"a": 1}), b64([("model.norm.weight", 5)]), b64(_Evil()), b64(torch.ones(3)), empty,
            serialize([("model.norm.weight", torch.ones(7))]), serialize([("no.such.weight", torch.ones(128))]),
            serialize([("model.norm.weight", torch.zeros(128)), ("no.such.weight", torch.ones(1))]),
            serialize({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": "x"})]


MARKER = "/tmp/mgrpo-fuzz-marker-{pid}"


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER.format(pid=os.getpid())}",))


@pytest.mark.system
def test_fuzz_every_endpoint_answers_4xx_and_the_server_stays_healthy(engine):
    rng = random.Random(SEED)
    fuzz = Fuzz(engine.url)
    good_before = post(engine.url, "/generate", GOOD).json()
    pid = engine.process.pid
    marker = MARKER.format(pid=os.getpid())

    def one_round():
        for case in _generate_cases(rng):
            if isinstance(case, bytes):
                fuzz.send("POST", "/generate", raw=case)
            else:
                fuzz.send("POST", "/generate", case)
        for path, bodies in {
            "/update_weight_version": [{}, {"new_version": 3}, {"new_version": None}, [], "x",
                                       {"new_version": "1", "bogus": 1}],
            "/begin_weight_update": [{"selector": 5}, {"selectr": "all"}, [1]],
            "/end_weight_update": [{}, {"x": 1}],  # no session is open
            "/abort_request": [{"rid": 5}, {"abort_all": "maybe"}, {"rid": {"a": 1}}],
            "/release_memory_occupation": [{"tags": ["bogus"]}, {"tags": "weights"}, {"tags": [1]}],
            "/resume_memory_occupation": [{"tags": ["weights"]}, {"tags": 5}],
            "/update_weights_from_tensor": [{"serialized_named_tensors": ["x"]}, {}],  # no session: refused first
            "/update_weights_from_distributed": [{"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, {}],
            "/init_weights_update_group": [
                {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 0,
                 "group_name": "g", "backend": "gloo"},
                {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 9, "world_size": 2,
                 "group_name": "g", "backend": "gloo"},
                {"master_address": "127.0.0.1", "master_port": -5, "rank_offset": 1, "world_size": 2,
                 "group_name": "g", "backend": "gloo"},
                {"master_address": "127.0.0.1", "master_port": 2, "rank_offset": 1, "world_size": 2,
                 "group_name": "g", "backend": "nccl"},
                {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2}],
            "/destroy_weights_update_group": [{"group_name": "nope"}, {"group_name": 5}],
        }.items():
            for body in bodies:
                fuzz.send("POST", path, body)
            fuzz.send("POST", path, raw=b"{not json")
        # inside a weight-update session: what reaches the unpickler and the loader
        assert post(engine.url, "/begin_weight_update", {"selector": "all"}).status_code == 200
        for fmt in (None, "flattened_bucket", "direct"):
            for payload in _tensor_payloads():
                fuzz.send("POST", "/update_weights_from_tensor",
                          {"serialized_named_tensors": [payload], "load_format": fmt})
        fuzz.send("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "load_format": None})
        fuzz.send("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["x", "y"]})
        fuzz.send("POST", "/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float99"],
                                                               "shapes": [[1]]})
        fuzz.send("POST", "/begin_weight_update", {"selector": "all"}, expect="already open")
        assert post(engine.url, "/end_weight_update", {}).status_code == 200
        for method, path in [("GET", "/generate"), ("DELETE", "/update_weights_from_tensor"), ("PUT", "/abort_request"),
                             ("GET", "/update_weight_version"), ("POST", "/health"), ("PATCH", "/model_info"),
                             ("GET", "/no/such/route"), ("POST", "/v1/chat/completions")]:
            fuzz.send(method, path, raw=b"{}")
        fuzz.oversized(MAX_BODY_BYTES + 1)

    one_round()  # warms every path up (allocator pools, caches) before memory is measured
    rss0 = _rss_kib(pid)
    for _ in range(2):
        one_round()
    rss1 = _rss_kib(pid)
    assert not os.path.exists(marker), "the unpickler ran a payload's code"
    assert fuzz.sent >= 600 and set(fuzz.statuses) <= {400, 404, 405, 413}, fuzz.statuses
    assert requests.get(engine.url + "/health_generate", timeout=30).status_code == 200
    good_after = post(engine.url, "/generate", GOOD).json()
    for a, b in zip(good_before, good_after):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    assert engine.health().ok
    # two more rounds (>400 requests, 128 MiB of oversized bodies) left the server's memory where one round did
    assert rss1 - rss0 < 64 * 1024, (rss0, rss1)
    print(f"\nfuzz: {fuzz.sent} malformed requests, answers {dict(sorted(fuzz.statuses.items()))}, "
          f"server RSS {rss0 // 1024} -> {rss1 // 1024} MiB")


# --- the client facing a server that misbehaves ------------------------------------------------------------
REQS = [GenerateRequest(uid=i, prompt_ids=[1, 2 + i]) for i in range(3)]
SP = SamplingParams(temperature=0.0, max_new_tokens=3)


@pytest.mark.integration
@pytest.mark.parametrize("junk", [b"<html>502 Bad Gateway</html>", b'[{"text": "", "output_ids": [1',
                                  b'{"unexpected": true}', b'[1, 2, 3]', b"[]"],
                         ids=["garbage", "partial-json", "wrong-shape", "wrong-items", "too-few"])
def test_client_retries_bad_answers_then_fails_by_name(engine, junk):
    with FaultProxy(engine.url) as proxy:
        proxy.garbage["/generate"] = [junk]  # once: the retry gets the real answer
        eng = SGLangEngine.connect(proxy.url, max_retries=2, retry_backoff_s=0.01)
        out = eng.generate(REQS, SP)
        assert [r.uid for r in out] == [0, 1, 2] and all(len(r.token_ids) == 3 for r in out)  # nothing dropped
        assert eng.stats["bad_answer_retries"] == 1 and eng.retries >= 1
        proxy.garbage["/generate"] = [junk] * 3  # every attempt of a budget of 2 retries
        eng = SGLangEngine.connect(proxy.url, max_retries=2, retry_backoff_s=0.01)
        with pytest.raises(SGLangBadResponseError, match=r"failed after 3 attempts \(retry budget 2\)"):
            eng.generate(REQS, SP)
        assert eng.stats["bad_answer_retries"] == 2


@pytest.mark.integration
def test_client_facing_a_hang_aborts_retries_then_fails(engine):
    with FaultProxy(engine.url) as proxy:
        proxy.delay["/generate"] = [2.0, 2.0]
        eng = SGLangEngine.connect(proxy.url, max_retries=1, request_timeout_s=0.5, retry_backoff_s=0.01)
        with pytest.raises(SGLangRequestError, match=r"failed after 2 attempts \(retry budget 1\).*Timeout") as e:
            eng.generate(REQS[:1], SP)
        assert e.value.timeout and eng.stats["generate_retries"] == 1
        assert proxy.seen.count("/abort_request") == 2  # each timed-out attempt was aborted on the server
