"""SGLang 0.5.23's own finish and sampling-parameter rules, taken out of the installed wheel's files (importing
`sglang` needs its GPU runtime), as independent references for the CPU engines' (mgrpo/rollout/stops.py,
cpu/generate.py::check_sampling):
- `sampling_params_class()`: srt/sampling/sampling_params.py's SamplingParams (normalize, verify), and
  `get_max_seq_length` (a stop_regex's stop_regex_max_len);
- `finish_req_class()`: the methods of srt/managers/schedule_batch.py's Req that decide when a response ends
  (update_finish_state and what it calls), on a bare class the test fills with the attributes they read."""

from __future__ import annotations

import __future__
import ast
import functools
import logging
import re
import typing
from http import HTTPStatus
from typing import Any, Optional

import pytest

from mgrpo.rollout.sglang.protocol import wheel

FINISH_METHODS = {"finished", "_stop_match_tail_len", "tail_str", "_check_token_based_finish",
                  "_locate_str_stop_finished_len", "_check_str_based_finish", "_check_vocab_boundary_finish",
                  "_cap_finished_len_at_max_new_tokens", "update_finish_state"}
FINISH_CLASSES = {"BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR", "FINISHED_MATCHED_REGEX",
                  "FINISH_LENGTH", "FINISH_ABORT"}


def _path(*parts: str) -> str:
    path = wheel.wheel_file(*parts)
    if path is None:
        pytest.skip("the sglang wheel is not installed (pip install --no-deps -r requirements-sglang.txt)")
    return path


@functools.lru_cache(None)
def finish_req_class() -> type:
    path = _path("srt", "managers", "schedule_batch.py")
    tree = ast.parse(open(path).read())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in FINISH_CLASSES]
    req = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Req")
    methods = [n for n in req.body if isinstance(n, ast.FunctionDef) and n.name in FINISH_METHODS]
    assert {c.name for c in classes} == FINISH_CLASSES and {m.name for m in methods} == FINISH_METHODS, \
        "sglang's schedule_batch.py layout changed"
    body = classes + [ast.ClassDef(name="Req", bases=[], keywords=[], body=methods, decorator_list=[])]
    ns: dict[str, Any] = {"re": re, "HTTPStatus": HTTPStatus, "logger": logging.getLogger("sglang-reference"),
                          **{k: getattr(typing, k) for k in ("List", "Optional", "Union")}}
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, ns)
    return ns["Req"]


def sglang_req(tokenizer, *, stop_strs, stop_str_max_len, stop_token_ids, eos_token_ids, max_new_tokens,
               ignore_eos=False, vocab_size=None, stop_regex_strs=(), stop_regex_max_len=0):
    """A Req of SGLang's finish rules with what update_finish_state reads (SamplingParams already normalised)."""
    from types import SimpleNamespace

    r = finish_req_class()()
    r.sampling_params = SimpleNamespace(stop_strs=list(stop_strs), stop_str_max_len=stop_str_max_len,
                                        stop_regex_strs=list(stop_regex_strs), stop_regex_max_len=stop_regex_max_len,
                                        ignore_eos=ignore_eos,
                                        stop_token_ids=set(stop_token_ids) or None, max_new_tokens=max_new_tokens)
    if not hasattr(tokenizer, "additional_stop_token_ids"):
        tokenizer.additional_stop_token_ids = None  # SGLang's get_tokenizer attaches it
    r.tokenizer, r.eos_token_ids, r.vocab_size = tokenizer, set(eos_token_ids), vocab_size
    r.output_ids, r.decoded_text, r.grammar = [], "", None
    r.finished_reason = r.finished_len = r.to_finish = None
    r.rid = "reference"
    return r


@functools.lru_cache(None)
def sampling_params_class() -> type:
    path = _path("srt", "sampling", "sampling_params.py")
    import msgspec
    import re._parser as sre_parse

    class WatermarkRequestConfig(msgspec.Struct, frozen=True, kw_only=True):  # not exercised here
        enabled: Optional[bool] = None

    names = {"_JsonScalar", "CustomParamValue", "_SAMPLING_EPS", "TOP_K_ALL", "MAX_STOP_COUNT", "MAX_STOP_REGEX_LEN",
             "MAX_STOP_REGEX_COUNT", "logger", "REQUEST_REASONING_END_TOKEN_IDS_KEY",
             "MAX_REQUEST_REASONING_END_TOKEN_IDS", "get_request_reasoning_end_token_ids", "SamplingParams",
             "get_max_seq_length", "MAX_LEN", "_max_length_from_subpattern", "raise_if_tokenizer_required"}
    ns = {"msgspec": msgspec, "math": __import__("math"), "logging": logging, "sre_parse": sre_parse,
          "WatermarkRequestConfig": WatermarkRequestConfig, "normalize_watermark_request": lambda v: v,
          **{k: getattr(typing, k) for k in ("Dict", "List", "Optional", "Sequence", "Set", "Union")}}
    return wheel._extract(path, names, "_mgrpo_test_sglang_sampling_params", ns).SamplingParams


def get_max_seq_length(pattern: str) -> int:
    """sampling_params.py's get_max_seq_length (stop_regex_max_len), from the module sampling_params_class
    ran."""
    import sys

    sampling_params_class()
    return sys.modules["_mgrpo_test_sglang_sampling_params"].get_max_seq_length(pattern)
