"""`POST /generate` as the client writes and reads it (pure functions, tested against SGLang's shapes).

Request: io_struct.GenerateReqInput through SGLang's JSON contract (sglang/api/v1/api_types.py).
Answer: `meta_info` as tokenizer_manager.py::_handle_batch_output builds it:
- `output_token_logprobs`: [logprob, token_id, text-or-None] per generated token (EOS included);
- with `return_sampling_mask` (and `sampling_logprobs_mode`, default "selected"):
  `output_token_sampling_mask` (each token's support: the ids the sampler kept, by decreasing
  probability) and `output_token_sampling_logprobs` (the sampled token's log-prob renormalised over that
  support). SGLang refuses the mask unless top_k is 1 (greedy) or finite and at most
  --sampling-mask-max-tokens (scheduler.py); sampling from the whole vocabulary (no top-k, no top-p) needs
  no mask: the support is everything and the behaviour log-prob is the plain one;
- with `return_routed_experts` and a server started with --enable-return-routed-experts: `routed_experts`,
  base64 of int32 [prompt + output - 1 - routed_experts_start_len, num_layers, top_k]
  (srt/state_capturer/base.py::get_topk over positions [start_len, seqlen - 1); start_len is one value per
  batched request, in [0, prompt tokens], 0 by default); absent without the server flag, so its absence when
  asked is an error here.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, Optional, Sequence

import numpy as np

from mgrpo.config.seeds import request_seed
from mgrpo.rollout.sglang.http import SGLangBadResponseError, SGLangRequestError
from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams

MASK_MAX_TOKENS = 4096
"""SGLang's default --sampling-mask-max-tokens: the largest top_k a support can be asked for."""


def whole_vocabulary(sampling: SamplingParams) -> bool:
    """Sampled from the whole tempered distribution: no top-k, no top-p, not greedy."""
    return not sampling.greedy and sampling.top_k == -1 and sampling.top_p >= 1.0


def needs_mask(sampling: SamplingParams) -> bool:
    """Whether SGLang must be asked for the sampling mask to know each token's support."""
    if not sampling.return_support or whole_vocabulary(sampling):
        return False
    if not sampling.greedy and sampling.top_k != 1 and not 1 < sampling.top_k <= MASK_MAX_TOKENS:
        raise ValueError(f"SamplingParams.return_support with top_p={sampling.top_p} and top_k={sampling.top_k}: "
                         f"SGLang 0.5.23 returns a token's sampling support only for top_k=1 or 1 < top_k <= "
                         f"{MASK_MAX_TOKENS} (--sampling-mask-max-tokens); set rollout.top_k, or top_p=1 and top_k=-1 "
                         "(the whole vocabulary)")
    return True


def _seed(sampling: SamplingParams, r: GenerateRequest) -> Optional[int]:
    if r.seed is not None:
        return int(r.seed)
    return request_seed(sampling.seed, r.uid) if sampling.seed is not None else None


def build_generate_payload(requests: Sequence[GenerateRequest], sampling: SamplingParams, *, rids: Sequence[str],
                           stop_token_ids: Optional[Sequence[int]] = None, send_seed: bool = True,
                           single: bool = False) -> dict:
    """The JSON body of one batched `POST /generate` (io_struct.GenerateReqInput); with `single`, of one
    request in the unbatched form (scalar rid, flat input_ids), which is what SGLang's router accepts."""
    params: dict[str, Any] = {
        "temperature": float(sampling.temperature),  # 0 -> SGLang samples greedily (top_k=1)
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),  # -1 = whole vocabulary
        "max_new_tokens": int(sampling.max_new_tokens),
        "skip_special_tokens": False,  # only the text is affected; ids are what we use
        "no_stop_trim": True,  # keep the matched stop (EOS) token: the trainer scores it
    }
    if stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if sampling.structural_tag is not None and single:
        # through SGLang's router: sglang-router 0.3.2's /generate request type has no structural_tag (the
        # router drops it, silently) but passes ebnf: the same grammar, printed by xgrammar (rollout/grammar.py)
        from mgrpo.rollout.grammar import structural_tag_ebnf

        params["ebnf"] = structural_tag_ebnf(sampling.structural_tag)
    elif sampling.structural_tag is not None:  # the grammar SGLang's xgrammar backend enforces
        params["structural_tag"] = sampling.structural_tag
    if sampling.stop:
        params["stop"] = list(sampling.stop)  # kept in the output (no_stop_trim)
    if sampling.stop_regex:
        # sglang-router 0.3.2's /generate request type has no stop_regex: it drops it, silently (stop_regex="."
        # through it ran to max_new_tokens; sent to the server, it stops at the first token)
        if single:
            raise ValueError("stop_regex cannot go through SGLang's router (sglang-router 0.3.2 drops the field); "
                             "send it to the servers directly")
        params["stop_regex"] = list(sampling.stop_regex)
    if send_seed and (sampling.seed is not None or any(r.seed is not None for r in requests)):
        # Honoured by SGLang's deterministic sampler (--enable-deterministic-inference), ignored otherwise.
        # A request's own seed (a multi-turn turn's) wins over the one derived from the call's seed and uid.
        sampling_params: Any = [{**params, **({"sampling_seed": _seed(sampling, r)} if _seed(sampling, r) is not None
                                              else {})} for r in requests]
    else:
        sampling_params = params
    extra: dict[str, Any] = {"return_logprob": True}
    if needs_mask(sampling):
        extra.update(return_sampling_mask=True, sampling_logprobs_mode="selected")
    if sampling.return_routed_experts:
        if single:
            # sglang-router 0.3.2's /generate request type has neither return_routed_experts nor
            # routed_experts_start_len: it drops both, silently (measured: tests/rollout/sglang/test_sglang_moe.py)
            raise ValueError("return_routed_experts cannot go through SGLang's router (sglang-router 0.3.2 drops "
                             "the field); send it to the servers directly")
        extra["return_routed_experts"] = True
        starts = {int(r.routes_from) for r in requests}
        if len(starts) > 1:  # GenerateReqInput has one routed_experts_start_len for its whole batch
            raise ValueError(f"one batched /generate has one routed_experts_start_len; this batch asks for "
                             f"{sorted(starts)} (send one batch per value)")
        if starts != {0}:  # sent only when set: 0 is SGLang's default (the whole sequence)
            extra["routed_experts_start_len"] = starts.pop()
    if single:
        if len(requests) != 1:
            raise ValueError(f"single=True takes one request, got {len(requests)}")
        return {"rid": rids[0], "input_ids": list(map(int, requests[0].prompt_ids)),
                "sampling_params": sampling_params[0] if isinstance(sampling_params, list) else sampling_params,
                **extra}
    return {"rid": list(rids), "input_ids": [list(map(int, r.prompt_ids)) for r in requests],
            "sampling_params": sampling_params, **extra}


def parse_weight_version(value: Any, default: int) -> int:
    """SGLang reports weight_version as a string ('default' until set); ours are integers."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def parse_generate_item(item: Any, uid: int, default_version: int, *, sampling: Optional[SamplingParams] = None,
                        prompt_len: Optional[int] = None,
                        moe_shape: Optional[tuple[int, int]] = None,
                        routes_from: int = 0) -> Optional[GenerateResult]:
    """One element of the /generate answer -> GenerateResult; None when SGLang aborted the request
    (finish_reason type 'abort'), which the caller retries. An answer of the wrong shape raises
    SGLangBadResponseError (the caller retries it within its budget)."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info", {}), dict):
        raise SGLangBadResponseError(f"request {uid}: the answer is not an SGLang result: {str(item)[:200]}")
    meta = item.get("meta_info") or {}
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        return None
    if kind not in ("stop", "length"):
        raise SGLangRequestError(f"request {uid}: unexpected finish_reason {finish!r}")
    lp = meta.get("output_token_logprobs")
    if lp is None:
        raise SGLangRequestError(f"request {uid}: meta_info has no output_token_logprobs (return_logprob ignored?)")
    try:  # entries are (logprob, token_id, text-or-None), one per generated token, EOS included
        token_ids = [int(e[1]) for e in lp]
        logprobs = [float(e[0]) if e[0] is not None else float("nan") for e in lp]
    except (TypeError, ValueError, IndexError) as e:
        raise SGLangBadResponseError(f"request {uid}: malformed output_token_logprobs: {e}") from e
    out_ids = item.get("output_ids")
    if out_ids is not None and list(out_ids) != token_ids:
        raise SGLangRequestError(f"request {uid}: output_ids ({len(out_ids)}) and output_token_logprobs "
                                 f"({len(token_ids)}) disagree")
    result = GenerateResult(uid=uid, token_ids=token_ids, logprobs=logprobs, finish_reason=kind,
                            weight_version=parse_weight_version(meta.get("weight_version"), default_version))
    if sampling is not None and sampling.return_support:
        _add_support(result, meta, sampling)
    if sampling is not None and sampling.return_routed_experts:
        result.routed_experts = decode_routed_experts(meta, uid, prompt_len, len(token_ids), moe_shape, routes_from)
    return result


def _add_support(result: GenerateResult, meta: dict, sampling: SamplingParams) -> None:
    n = len(result.token_ids)
    if not needs_mask(sampling):  # the whole vocabulary: no mask, the plain log-probs are the behaviour's
        result.support = [None] * n
        return
    masks, lps = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
    if masks is None or lps is None:
        raise SGLangRequestError(f"request {result.uid}: return_sampling_mask was asked but meta_info has no "
                                 "output_token_sampling_mask (a server older than SGLang 0.5.23?)")
    if len(masks) != n or len(lps) != n:
        raise SGLangBadResponseError(f"request {result.uid}: {len(masks)} sampling masks and {len(lps)} sampling "
                                     f"log-probs for {n} tokens")
    support = []
    for tok, mask in zip(result.token_ids, masks):
        ids = sorted(int(t) for t in mask)
        if tok not in ids:
            raise SGLangBadResponseError(f"request {result.uid}: token {tok} is outside its sampling support {ids}")
        support.append(ids)
    result.support = support
    result.logprobs = [float(v) for v in lps]


def decode_routed_experts(meta: dict, uid: int, prompt_len: Optional[int], out_len: int,
                          moe_shape: Optional[tuple[int, int]], routes_from: int = 0) -> np.ndarray:
    """meta_info["routed_experts"] -> int32 [prompt + output - 1 - routes_from, num_layers, top_k] (the
    positions [routes_from, prompt + output - 1) the request asked for)."""
    raw = meta.get("routed_experts")
    if raw is None:
        raise SGLangRequestError(f"request {uid}: return_routed_experts was asked but the answer has no "
                                 "routed_experts: the server was started without --enable-return-routed-experts "
                                 "(SGLang then drops the field silently)")
    if moe_shape is None:
        raise ValueError("routed experts need the model's (num_hidden_layers, num_experts_per_tok): launch or "
                         "connect the engine with hf_dir of an MoE checkpoint")
    try:
        flat = np.frombuffer(base64.b64decode(raw, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError, TypeError) as e:
        raise SGLangBadResponseError(f"request {uid}: routed_experts is not base64 of int32: {e}") from e
    layers, top_k = moe_shape
    if flat.size % (layers * top_k):
        raise SGLangBadResponseError(f"request {uid}: {flat.size} routed-expert ids do not fill rows of "
                                     f"{layers} layers x top-{top_k}")
    routes = flat.reshape(-1, layers, top_k).copy()
    if prompt_len is not None and routes.shape[0] != max(0, prompt_len + out_len - 1 - routes_from):
        raise SGLangBadResponseError(f"request {uid}: {routes.shape[0]} routed-expert rows for {prompt_len} prompt and "
                                     f"{out_len} output tokens from position {routes_from} (SGLang returns prompt + "
                                     "output - 1 - routed_experts_start_len)")
    return routes


def checkpoint_moe_shape(hf_dir: Optional[str]) -> Optional[tuple[int, int]]:
    """(num_hidden_layers, num_experts_per_tok) from an HF config of an MoE model, else None."""
    path = os.path.join(hf_dir, "config.json") if hf_dir else None
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    top_k = cfg.get("num_experts_per_tok")
    return (int(cfg["num_hidden_layers"]), int(top_k)) if top_k else None


def checkpoint_tensor_names(hf_dir: str) -> Optional[set[str]]:
    """Names of the tensors an HF checkpoint holds (what a complete weight sync must deliver),
    read from the safetensors index or headers; lm_head.weight is dropped for tied embeddings
    (the trainer sends only the embedding then). None when the folder has no safetensors."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    names: set[str] = set()
    if os.path.exists(index):
        with open(index) as f:
            names = set(json.load(f)["weight_map"])
    else:
        files = [f for f in sorted(os.listdir(hf_dir)) if f.endswith(".safetensors")] if os.path.isdir(hf_dir) else []
        if not files:
            return None
        for fn in files:
            with open(os.path.join(hf_dir, fn), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                names |= {k for k in json.loads(f.read(n)) if k != "__metadata__"}
    cfg = os.path.join(hf_dir, "config.json")
    if os.path.exists(cfg):
        with open(cfg) as f:
            if json.load(f).get("tie_word_embeddings", False):
                names.discard("lm_head.weight")
    return names
