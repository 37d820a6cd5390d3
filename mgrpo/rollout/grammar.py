"""Grammar-constrained decoding on CPU: SGLang's `sampling_params.structural_tag` (and, on the CPU server,
`json_schema`, `regex`, `ebnf`), enforced with xgrammar as SGLang 0.5.23's grammar backend enforces it
(sglang/srt/constrained/xgrammar_backend.py). One path for both CPU engines: their shared decode loop
(`rollout/decode.py`, one matcher per request, its mask applied before sampling).

`compile_structural_tag` is SGLang's `XGrammarGrammarBackend.dispatch_structural_tag`: a legacy tag
(`{"structures": [{begin, schema, end}], "triggers": [...], "at_least_one": ...}`, what SGLang's
FunctionCallParser builds for tool calls) becomes `StructuralTag.from_legacy_structural_tag` with its
`at_least_one`; any other tag (`{"format": ...}`) is compiled as xgrammar's structural-tag JSON; a missing
schema is an empty one. The TokenizerInfo is built as SGLang builds it: `from_huggingface(tokenizer,
vocab_size=<the model's>, stop_token_ids=<the model's EOS ids>)`. A tag that does not compile is refused
with SGLang's message ("Failed to compile structural_tag grammar: ..."; SGLang aborts the request with it,
answered 400). `compile(kind, ...)` is the other dispatch_<kind>: json (SGLang's schema check from the wheel,
any whitespace), regex, ebnf.

`restricted_steps` replays a generated turn through a fresh matcher and says, per token, whether the
grammar allowed fewer than all of the tokenizer's tokens there. Such a token was not the policy's free
choice (with exactly one allowed, not a choice at all), and the trainer, which recomputes log-probs of the
unmasked model, would disagree with the masked distribution it was sampled from: the agent runner makes
those tokens context (mgrpo/agent/runner.py). The replay needs nothing from the engine, so it holds for
SGLang's servers as for the CPU engines.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Optional, Sequence

import torch


class GrammarError(ValueError):
    """A grammar SGLang would refuse, with SGLang's message."""


def _sanitize_format(fmt) -> None:
    """XGrammarGrammarBackend._sanitize_structural_format: missing json_schema fields become {}."""
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind in {"json_schema", "qwen_xml_parameter"} and fmt.get("json_schema") is None:
        fmt["json_schema"] = {}
    if kind == "tag":
        _sanitize_format(fmt.get("content"))
    elif kind in {"sequence", "or"}:
        for element in fmt.get("elements", []):
            _sanitize_format(element)
    elif kind in {"triggered_tags", "tags_with_separator"}:
        for tag in fmt.get("tags", []):
            _sanitize_format(tag)


class Grammars:
    """One engine's xgrammar compiler (its tokenizer and vocabulary), with compiled grammars cached by key."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def compile_structural_tag(self, key_string: str):
        return self.compile("structural_tag", key_string)

    @functools.lru_cache(maxsize=64)
    def compile(self, kind: str, key_string: str):
        """SGLang's grammar of `kind` (its key type: 'structural_tag' | 'json' | 'regex' | 'ebnf', from
        sampling_params.structural_tag / json_schema / regex / ebnf), compiled as XGrammarGrammarBackend's
        dispatch_<kind> compiles it; GrammarError with SGLang's message when it does not compile."""
        try:
            if kind == "structural_tag":
                return self._structural_tag(key_string)
            with self._lock:
                if kind == "json":  # dispatch_json: any whitespace (SGLang's default), '$$ANY$$' = any JSON
                    if key_string == "$$ANY$$":
                        return self.compiler.compile_builtin_json_grammar()
                    _check_json_schema(json.loads(key_string))
                    return self.compiler.compile_json_schema(schema=key_string, any_whitespace=True)
                if kind == "regex":
                    return self.compiler.compile_regex(key_string)
                if kind == "ebnf":
                    return self.compiler.compile_grammar(key_string)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # xgrammar raises RuntimeError/ValueError
            raise GrammarError(f"Failed to compile {kind} grammar: {e}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def _structural_tag(self, key_string: str):
        tag = structural_tag_object(key_string)
        with self._lock:
            return self.compiler.compile_structural_tag(tag)


def structural_tag_object(key_string: str):
    """What XGrammarGrammarBackend.dispatch_structural_tag hands xgrammar for a structural_tag: a legacy tag as
    StructuralTag.from_legacy_structural_tag with its at_least_one, any other as its JSON (formats sanitised).
    Raises what xgrammar and json raise."""
    import xgrammar as xgr

    tag = json.loads(key_string)
    if not isinstance(tag, dict):
        raise json.JSONDecodeError("a structural tag is a JSON object", key_string, 0)
    if tag.get("structures", None) is not None:  # sglang/srt/constrained/utils.py is_legacy_structural_tag
        if tag.get("triggers", None) is None:
            raise RuntimeError("a legacy structural tag needs 'triggers'")
        for s in tag["structures"]:
            if s.get("schema") is None:
                s["schema"] = {}
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        new = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
        new.format.at_least_one = tag.get("at_least_one", False)
        return new
    if tag.get("format", None) is None:
        raise RuntimeError("a structural tag needs 'structures' and 'triggers' (legacy) or 'format'")
    if isinstance(tag["format"], dict):
        _sanitize_format(tag["format"])
        key_string = json.dumps(tag)
    return key_string


@functools.lru_cache(maxsize=64)
def structural_tag_ebnf(key_string: str) -> str:
    """The grammar SGLang compiles from a structural tag, as xgrammar prints it (EBNF): what SGLang's
    `ebnf` compiles back to the same grammar (tests/agent/test_agent_sglang.py walks both). For sglang-router
    0.3.2, whose /generate request type has no structural_tag field: it drops the field and passes ebnf
    (generate_io.py::build_generate_payload)."""
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_structural_tag(structural_tag_object(key_string)))
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise GrammarError(f"Failed to compile structural_tag grammar: {e}") from None


def _check_json_schema(schema) -> None:
    """SGLang's validate_xgrammar_json_schema (constrained/json_schema_validation.py, read from the wheel where
    installed): a schema with constraints xgrammar would silently ignore is refused."""
    from mgrpo.rollout.sglang.protocol import wheel

    mod = wheel.json_schema_validation()
    if mod is not None:
        mod.validate_xgrammar_json_schema(schema)


def restricted_steps(compiled, token_ids: Sequence[int], n_tokens: int) -> list[bool]:
    """Per token of a turn generated under `compiled` from its start: True where the grammar allowed fewer
    than all `n_tokens` tokens of the tokenizer (a padded vocabulary's extra rows are never allowed and do not
    count). Raises if the turn is not one the grammar allows (it was not generated under it)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, n_tokens)
    probe = torch.zeros(1, n_tokens)
    out = []
    for k, tok in enumerate(token_ids):
        m.fill_next_token_bitmask(bitmask, 0)
        probe.zero_()
        xgr.apply_token_bitmask_inplace(probe, bitmask, vocab_size=n_tokens)
        out.append(bool(torch.isneginf(probe).any()))
        if not m.accept_token(int(tok)):
            raise ValueError(f"token {tok} at position {k} is not allowed by the turn's grammar")
        if m.is_terminated():
            if k + 1 != len(token_ids):
                raise ValueError(f"the turn goes on after its grammar ended (position {k})")
            break
    return out


def load_engine_tokenizer(name: Optional[str]):
    """The run's tokenizer by its model.tokenizer name (an engine needs it only for grammars)."""
    if name is None:
        raise GrammarError("structural_tag, stop and stop_regex need the engine's tokenizer: the engine was "
                           "built without model.tokenizer")
    from types import SimpleNamespace

    from mgrpo.data.tokenizer import load_tokenizer

    return load_tokenizer(SimpleNamespace(tokenizer=name))
