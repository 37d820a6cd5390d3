"""The CPU server's `/generate`: the body checked the way SGLang 0.5.23 checks it, turned into `Req`s, and
each finished `Req` turned into SGLang's answer.

SGLang's checks, with its messages: the JSON contract (sglang/api/v1/api_types.py, where the wheel is
installed), `SamplingParams.normalize/verify` (srt/sampling/sampling_params.py: temperature, top_p, top_k,
min_p, max_new_tokens; greedy below 1e-6; top_k -1 is the whole vocabulary; `stop` and `stop_regex`
normalised against the server's tokenizer, mgrpo/rollout/stops.py; one grammar of json_schema / regex / ebnf /
structural_tag, compiled by cpu/text.py with mgrpo/rollout/grammar.py), the context-length check
(tokenizer_manager.py::_validate_one_request), the sampling-mask checks (tokenizer_manager.py and
scheduler.py: a mask needs top_k=1 or a finite top_k up to --sampling-mask-max-tokens) and the
routed-experts start check (scheduler.py). Each failure is a `RequestError`, answered 400
{"error": {"message": ...}} as SGLang's `_create_error_response` does; a stop_regex Python cannot parse
raises re.error in SGLang's normalize, which its server does not catch: 500 "Internal Server Error". A request
SGLang's scheduler aborts with status 400 (a stop_regex that parses but does not compile) is answered as its
tokenizer manager does (`_handle_abort_finish_reason`): 400 {"error": {"message": ...}} for the call. Stricter
than SGLang: fields and sampling parameters the CPU server does not implement are refused when set, instead of being ignored.

The answer (tokenizer_manager.py::_handle_batch_output): `meta_info` with output_token_logprobs as
[logprob, token_id, None] (and, with top_logprobs_num, input_top_logprobs and output_top_logprobs: per position that many
[logprob, token_id, None], an input row None where its log-prob is), output_token_sampling_mask / _logprobs / _mask_length, and routed_experts as
base64 of int32 [rows, num_layers, top_k].
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from mgrpo.rollout.sglang.cpu.receive import RequestError
from mgrpo.rollout.sglang.cpu.text import grammar_key
from mgrpo.rollout.stops import StopError, StopStrings
from mgrpo.rollout.route_capture import routes_from_error
from mgrpo.rollout.sglang.protocol import wheel
from mgrpo.rollout.sglang.protocol.tables import SAMPLING_FIELDS

SAMPLING_EPS = 1e-6  # srt/sampling/sampling_params.py _SAMPLING_EPS
TOP_K_ALL = 1 << 30  # srt/sampling/sampling_params.py: top_k -1 = the whole vocabulary
DEFAULT_MAX_NEW_TOKENS = 128

# Sampling parameters the CPU server implements; those that only shape text (it returns token ids); and
# SGLang's defaults for the rest, which must stay at them.
SAMPLING_IMPLEMENTED = frozenset({"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids",
                                  "ignore_eos", "sampling_seed", "stop", "stop_regex", "json_schema", "regex",
                                  "ebnf", "structural_tag"})
SAMPLING_TEXT_ONLY = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                                "stream_interval"})
SAMPLING_DEFAULTS = {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                     "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "logit_bias": None,
                     "custom_params": None, "beam_width": None, "watermark": None, "choice": None}
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")

# Top-level fields of GenerateReqInput the CPU server implements (each with its checks below); any other
# field must be absent or at a false default. tests/rollout/sglang/test_sglang_schema.py checks every name against the
# wheel's class.
GENERATE_FIELDS = frozenset({"rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                             "top_logprobs_num", "stream", "return_text_in_logprobs", "log_metrics",
                             "return_sampling_mask", "sampling_logprobs_mode", "return_routed_experts",
                             "routed_experts_start_len", "lora_path"})


@dataclass(frozen=True)
class Limits:
    """What the server knows that bounds a request."""

    vocab_size: int
    context_len: int
    mask_max_tokens: int = 4096  # --sampling-mask-max-tokens
    routes: bool = False  # --enable-return-routed-experts


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_request(value, n: int, single: bool, name: str, ok, default):
    """A field given once for all requests or (in a batch) as a list with one entry per request."""
    if value is None:
        return [default] * n
    if isinstance(value, list) and not single:
        if len(value) != n:
            raise RequestError(f"/generate: {name} has {len(value)} entries for a batch of {n} requests")
        values = value
    else:
        values = [value] * n
    for v in values:
        if not ok(v):
            raise RequestError(f"/generate: {name} has the wrong type: {v!r}")
    return [default if v is None else v for v in values]


def check_sampling(sp: Any, index: int, tokenizer=None) -> dict:
    """SGLang's SamplingParams(**sp).normalize(tokenizer) and .verify(), for the parameters the CPU server knows
    (`tokenizer`: the server's, None as under --skip-tokenizer-init)."""
    if not isinstance(sp, dict):
        raise RequestError(f"/generate: sampling_params[{index}] must be an object, got {type(sp).__name__}")
    unknown = set(sp) - SAMPLING_FIELDS
    if unknown:
        raise RequestError(f"/generate: unknown sampling_params fields {sorted(unknown)}")
    for key, default in SAMPLING_DEFAULTS.items():
        if sp.get(key) is not None and sp[key] != default:
            raise RequestError(f"/generate: sampling_params.{key}={sp[key]!r} is not implemented by the CPU server "
                               f"(it samples with {sorted(SAMPLING_IMPLEMENTED)})")
    out = {"temperature": sp.get("temperature", 1.0), "top_p": sp.get("top_p", 1.0), "top_k": sp.get("top_k", -1),
           "min_p": sp.get("min_p", 0.0), "max_new_tokens": sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
           "ignore_eos": sp.get("ignore_eos", False), "seed": sp.get("sampling_seed")}
    out = {k: ({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "ignore_eos": False}.get(k)
               if v is None and k not in ("max_new_tokens", "seed") else v) for k, v in out.items()}
    for key in ("temperature", "top_p", "min_p"):
        if not _is_num(out[key]):
            raise RequestError(f"/generate: sampling_params.{key} must be a number, got {out[key]!r}")
    if not _is_int(out["top_k"]):
        raise RequestError(f"/generate: sampling_params.top_k must be an integer, got {out['top_k']!r}")
    if out["max_new_tokens"] is not None and not _is_int(out["max_new_tokens"]):
        raise RequestError(f"/generate: sampling_params.max_new_tokens must be an integer, got "
                           f"{out['max_new_tokens']!r}")
    if out["seed"] is not None and not _is_int(out["seed"]):
        raise RequestError(f"/generate: sampling_params.sampling_seed must be an integer, got {out['seed']!r}")
    if not isinstance(out["ignore_eos"], bool):
        raise RequestError(f"/generate: sampling_params.ignore_eos must be a boolean, got {out['ignore_eos']!r}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
        raise RequestError(f"/generate: sampling_params.stop_token_ids must be a list of integers, got {stops!r}")
    out["stop_token_ids"] = tuple(stops)
    stop, stop_regex = sp.get("stop"), sp.get("stop_regex")
    for key, v in (("stop", stop), ("stop_regex", stop_regex)):
        if v is not None and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            raise RequestError(f"/generate: sampling_params.{key} must be a string or a list of strings, got {v!r}")
    for key in GRAMMAR_FIELDS:
        if sp.get(key) is not None and not isinstance(sp[key], str):
            raise RequestError(f"/generate: sampling_params.{key} must be a string, got {type(sp[key]).__name__}")
    try:  # normalize(): stop strings and patterns (the longest each can match), before verify()
        out["stops"] = StopStrings.normalize(stop, tokenizer, stop_regex)
    except StopError as e:
        raise RequestError(str(e), 500 if e.internal else 400, internal=e.internal) from None
    # normalize(): greedy below _SAMPLING_EPS, top_k -1 = the whole vocabulary
    if 0 <= out["temperature"] < SAMPLING_EPS:
        out["temperature"], out["top_k"] = 1.0, 1
    if out["top_k"] == -1:
        out["top_k"] = TOP_K_ALL
    # verify(), with SGLang's messages
    t = out["temperature"]
    if not math.isfinite(t) or t < 0.0:
        raise RequestError(f"temperature must be a non-negative finite number, got {t}.")
    if not 0.0 < out["top_p"] <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {out['top_p']}.")
    if not 0.0 <= out["min_p"] <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {out['min_p']}.")
    if out["min_p"] > 0.0:
        raise RequestError("/generate: sampling_params.min_p > 0 is not implemented by the CPU server")
    if out["top_k"] < 1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {out['top_k']}.")
    if out["max_new_tokens"] is not None and out["max_new_tokens"] < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {out['max_new_tokens']}.")
    if sum(1 for key in GRAMMAR_FIELDS if sp.get(key)) > 1:  # empty values are unset (__post_init__)
        raise RequestError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    out["grammar_key"] = grammar_key(sp)
    return out


def parse(body: Any, limits: Limits, tokenizer=None):
    """The body of one POST /generate -> (Reqs, single, per-request return_logprob). Grammars are compiled
    afterwards, off the event loop (text.py::ServerText.compile)."""
    from mgrpo.rollout.sglang.cpu.model import Req

    if not isinstance(body, dict):
        raise RequestError(f"/generate: the body must be a JSON object, got {type(body).__name__}")
    # SGLang's router fills in some fields at their defaults (background, return_bytes, ... = false)
    extra = sorted(k for k, v in body.items() if k not in GENERATE_FIELDS and v not in (None, False, 0, "", [], {}))
    if extra:
        raise RequestError(f"/generate: {extra} not implemented by the CPU server (it takes {sorted(GENERATE_FIELDS)})")
    if body.get("stream"):
        raise RequestError("/generate: stream=true is not implemented by the CPU server")
    ids = body.get("input_ids")
    if ids is None:
        raise RequestError("/generate: the CPU server takes input_ids only (no tokenizer: send token ids)")
    if not isinstance(ids, list) or not ids:
        raise RequestError("/generate: input_ids must be a non-empty list of token ids or of token-id lists")
    single = not isinstance(ids[0], list)
    prompts = [ids] if single else ids
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
            raise RequestError(f"/generate: input_ids[{i}] must be a non-empty list of integers")
    n = len(prompts)
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif single and isinstance(rids, str):
        rids = [rids]
    elif single or not isinstance(rids, list) or not all(isinstance(r, str) for r in rids) or len(rids) != n:
        raise RequestError(f"/generate: rid must be one string per request ({n}), got {rids!r}")
    if not single and len(set(rids)) != n:
        raise RequestError("/generate: rids within one batch must differ")
    sps = body.get("sampling_params")
    sps = sps if isinstance(sps, list) else [sps or {}] * n
    if len(sps) != n:
        raise RequestError(f"/generate: sampling_params has {len(sps)} entries for a batch of {n} requests")
    logprob = _per_request(body.get("return_logprob"), n, single, "return_logprob", _bool, False)
    # SGLang's input-token log-probs (scheduler.py: ignored without return_logprob; -1 = none of the input's)
    starts = _per_request(body.get("logprob_start_len"), n, single, "logprob_start_len",
                          lambda v: v is None or _is_int(v), -1)
    tops = _per_request(body.get("top_logprobs_num"), n, single, "top_logprobs_num",
                        lambda v: v is None or (_is_int(v) and v >= 0), 0)
    mask = _per_request(body.get("return_sampling_mask"), n, single, "return_sampling_mask", _bool, False)
    modes = _per_request(body.get("sampling_logprobs_mode"), n, single, "sampling_logprobs_mode",
                         lambda v: v in (None, "selected", "support"), None)
    routes = body.get("return_routed_experts") or False
    start_routes = body.get("routed_experts_start_len") or 0
    if not isinstance(routes, bool) or not _is_int(start_routes):
        raise RequestError("/generate: return_routed_experts must be a boolean and routed_experts_start_len an "
                           "integer")
    reqs = []
    for i, (rid, prompt, sp) in enumerate(zip(rids, prompts, sps)):
        s = check_sampling(sp, i, tokenizer)
        if modes[i] is not None and not mask[i]:
            raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
        max_new = _check_length(len(prompt), s["max_new_tokens"], limits.context_len)
        start = starts[i] if logprob[i] else -1
        if start > len(prompt):  # scheduler.py's refusal, word for word
            raise RequestError(f"req.logprob_start_len={start} is higher than the number of input tokens "
                               f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller logprob_start_len.")
        if mask[i] and s["top_k"] != 1 and not 1 < s["top_k"] <= limits.mask_max_tokens:
            raise RequestError(f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
                               f"{limits.mask_max_tokens}; got top_k={s['top_k']}. Lower top_k or increase "
                               "--sampling-mask-max-tokens.")
        if routes and limits.routes:  # without the server flag SGLang ignores the request field
            err = routes_from_error(start_routes, len(prompt))
            if err is not None:
                raise RequestError(err)
        reqs.append(Req(rid=rid, input_ids=list(prompt), temperature=float(s["temperature"]),
                        top_p=float(s["top_p"]), top_k=min(s["top_k"], limits.vocab_size), max_new_tokens=max_new,
                        stop_token_ids=s["stop_token_ids"], ignore_eos=s["ignore_eos"], seed=s["seed"],
                        stops=s["stops"], grammar_key=s["grammar_key"],
                        top_logprobs_num=(tops[i] or 0) if logprob[i] else 0,
                        mask_mode=(modes[i] or "selected") if mask[i] else None,
                        routes_from=start_routes if routes and limits.routes else None,
                        logprob_start_len=start if start >= 0 else None))
    return reqs, single, logprob


def _bool(v) -> bool:
    return v is None or isinstance(v, bool)


def _check_length(prompt_len: int, max_new: Optional[int], context_len: int) -> int:
    """tokenizer_manager.py::_validate_one_request (no auto-truncation, SGLang's default)."""
    if prompt_len >= context_len:
        raise RequestError(f"The input ({prompt_len} tokens) is longer than the model's context length "
                           f"({context_len} tokens).")
    if max_new is None:
        return context_len - prompt_len
    if max_new + prompt_len > context_len:
        raise RequestError(f"Requested token count exceeds the model's maximum context length of {context_len} "
                           f"tokens. You requested a total of {max_new + prompt_len} tokens: {prompt_len} tokens "
                           f"from the input messages and {max_new} tokens for the completion. Please reduce the "
                           "number of tokens in the input messages or the completion to fit within the limit.")
    return max_new


def refusal(done) -> Optional[RequestError]:
    """tokenizer_manager.py::_handle_abort_finish_reason for a call's finished Reqs: the first one the scheduler
    aborted with status 400 fails the whole call (SGLang's ValueError -> 400 {"error": {"message": ...}})."""
    for r in done:
        if r.finish.get("type") == "abort" and r.finish.get("status_code") == 400:
            return RequestError(r.finish["message"])
    return None


def answer(r, weight_version: str, return_logprob: bool, t0: float) -> dict:
    """One finished Req -> one element of SGLang's /generate answer."""
    meta = {"id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.input_ids),
            "weight_version": weight_version, "num_retractions": 0, "completion_tokens": len(r.out),
            "cached_tokens": 0, "reasoning_tokens": 0, "e2e_latency": time.monotonic() - t0}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.out)]
        meta["output_token_logprobs_length"] = len(r.out)
        # tokenizer_manager.py::add_logprob_to_meta_info: (logprob, id, text) of input positions logprob_start_len..,
        # the first None (logprob_result_processor.py: [None] + values[:-1]); [] when none were asked
        meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.input_logprobs,
                                                                       r.input_ids[r.logprob_start_len or 0:])]
        if r.top_logprobs_num:  # tokenizer_manager.py::detokenize_top_logprobs_tokens, no text; None rows stay
            meta["input_top_logprobs"] = [None if row is None else [[v, t, None] for v, t in zip(*row)]
                                          for row in r.input_top_logprobs]
            meta["output_top_logprobs"] = [[[v, t, None] for v, t in zip(*row)] for row in r.top_logprobs]
    if r.mask_mode is not None:
        masks, values = mask_lists(r.masks, r.mask_logprobs, r.mask_mode == "support")
        meta["output_token_sampling_mask"] = masks
        meta["output_token_sampling_logprobs"] = values
        meta["output_token_sampling_mask_length"] = len(masks)
    if r.routes is not None:
        meta["routed_experts"] = base64.b64encode(r.routes.numpy().tobytes()).decode("utf-8")
    return {"text": "", "output_ids": list(r.out), "meta_info": meta}


def mask_lists(masks: list, logprobs: list, support: bool) -> tuple[list, list]:
    """A request's sampling masks as SGLang answers them: its rows packed into SGLang's SamplingMaskChunk
    (int32 ids, float32 log-probs) and read back with `to_lists`, where the wheel is installed."""
    import numpy as np

    mod = wheel.sampling_mask()
    if mod is None:
        return [list(m) for m in masks], list(logprobs)
    flat = [v for row in logprobs for v in row] if support else list(logprobs)
    chunk = mod.SamplingMaskChunk(lengths=np.array([len(m) for m in masks], dtype=np.int32),
                                  token_ids=np.array([t for m in masks for t in m], dtype=np.int32),
                                  logprobs=np.array(flat, dtype=np.float32))
    return chunk.to_lists(support_logprobs=support)
