"""When a response ends, as SGLang 0.5.23 decides it after each generated token (both CPU engines use this).

SGLang's rules (sglang/srt/managers/schedule_batch.py, `Req.update_finish_state` and the methods it calls;
sampling/sampling_params.py, `SamplingParams.normalize`), in their order, one token per step:
1. **stop strings, then stop regexes** (`sampling_params.stop`, a string or a list of at most 32;
   `stop_regex`, a pattern or a list of at most 32, each at most 256 bytes in UTF-8): the last
   `max(stop_str_max_len, stop_regex_max_len) + 1` output tokens are decoded together (`tokenizer.decode`,
   special tokens kept; `Req.tail_str`), where `stop_str_max_len` is the longest stop string's length in
   tokens (`tokenizer.encode(s, add_special_tokens=False)`) and `stop_regex_max_len` the most characters a
   pattern can match (`get_max_seq_length`: 2**30 once it can repeat without bound or holds a construct
   SGLang does not measure, e.g. a lookaround; then the whole output is decoded). A stop string
   contained in that text ends the response with `{"type": "stop", "matched": <the stop string>}`, the first
   of the list that matches; else the first pattern `re.search` finds in it, with
   `{"type": "stop", "matched": <the pattern>}` (FINISHED_MATCHED_REGEX). The output keeps every token up to
   and including the one that completed it (with one token per step SGLang's `finished_len` is the whole
   output; ids are never trimmed; `no_stop_trim` only shapes the answer's text, and for a regex SGLang's
   detokenizer looks for the pattern's own characters in the text). This rule is checked before the token
   rule and applies even with `ignore_eos`. A pattern Python cannot parse is refused by `normalize` (an
   `re.error`, which SGLang's HTTP server does not catch); one that parses but does not compile (a
   variable-width lookbehind) makes `re.search` raise here, and SGLang then sets
   `{"type": "abort", "message": "invalid stop_regex ...", "status_code": 400, ...}` and goes on with the
   rules below, any of which replaces it.
2. **stop tokens**, unless `ignore_eos`: the request's `stop_token_ids`, the model's EOS ids and the
   tokenizer's `eos_token_id` -> `{"type": "stop", "matched": <token id>}`, the token kept.
3. **length**: `max_new_tokens` tokens -> `{"type": "length", "length": max_new_tokens}`.
4. **grammar ended**: a grammar that had terminated before this token -> `{"type": "stop", "matched": <this
   token>}` (SGLang checks it before it feeds the new token to the grammar).
What is left out: speculative decoding's several tokens per step.
"""

from __future__ import annotations

import re
import re._parser as sre_parse  # what SGLang measures patterns with (Python 3.11+)
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mgrpo.config.checks import MAX_STOP_COUNT, MAX_STOP_REGEX_COUNT, MAX_STOP_REGEX_LEN  # noqa: F401 (SGLang's)

UNBOUNDED = 2 ** 30  # sampling_params.py MAX_LEN: "no bound" in get_max_seq_length


class StopError(ValueError):
    """Stop strings or patterns SGLang refuses, with its message. `internal`: SGLang's HTTP server does not
    catch the error (normalize's re.error for a pattern Python cannot parse) and answers 500."""

    def __init__(self, message: str, internal: bool = False):
        super().__init__(message)
        self.internal = internal


def regex_max_len(pattern: str) -> int:
    """SGLang's get_max_seq_length: an upper bound on the characters `pattern` can match, which bounds the
    decoded tail it is searched in (every character may be a token of its own). re.error if Python cannot
    parse it."""
    return _max_len(sre_parse.parse(pattern))


def _max_len(sub) -> int:
    """sampling_params.py::_max_length_from_subpattern, op by op."""
    total = 0
    for op, value in sub:
        if op in (sre_parse.LITERAL, sre_parse.IN, sre_parse.ANY):
            total += 1
        elif op == sre_parse.SUBPATTERN:
            total += _max_len(value[3])
        elif op == sre_parse.BRANCH:
            total += max(_max_len(branch) for branch in value[1])
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
            total += UNBOUNDED if value[1] == sre_parse.MAXREPEAT else value[1] * _max_len(value[2])
        elif op != sre_parse.AT:  # ^, $, \b take no characters; anything else SGLang leaves unbounded
            total += UNBOUNDED
    return total


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings and stop patterns after SGLang's `normalize`."""

    strs: tuple[str, ...] = ()
    max_len: int = 0
    """The longest stop string in tokens (SGLang's stop_str_max_len)."""
    regexes: tuple[str, ...] = ()
    regex_max_len: int = 0
    """The most characters a pattern can match (SGLang's stop_regex_max_len)."""

    @classmethod
    def normalize(cls, stop: Any, tokenizer, stop_regex: Any = None) -> "StopStrings":
        """SamplingParams.normalize for `stop` and `stop_regex` (each a string, a list of strings or None), in
        SGLang's order and with its messages."""
        strs = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        if len(strs) > MAX_STOP_COUNT:
            raise StopError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(strs)}")
        regexes = [] if stop_regex is None else [stop_regex] if isinstance(stop_regex, str) else list(stop_regex)
        if len(regexes) > MAX_STOP_REGEX_COUNT:
            raise StopError(f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns are allowed, got {len(regexes)}")
        regex_max = 0
        for p in regexes:
            size = len(p.encode("utf-8"))
            if size > MAX_STOP_REGEX_LEN:
                raise StopError(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
            try:
                regex_max = max(regex_max, regex_max_len(p))
            except re.error as e:
                raise StopError(f"stop_regex {p!r} is not a regular expression: {e}", internal=True) from None
        if tokenizer is None:  # sampling_params.py raise_if_tokenizer_required
            for name, given in (("stop", strs), ("stop_regex", regexes)):
                if given:
                    raise StopError(f"{name}={given!r} is unavailable when skip_tokenizer_init=True "
                                    "(requires tokenizer to decode tokens to text for matching).")
        longest = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in strs), default=0)
        return cls(tuple(strs), longest, tuple(regexes), regex_max)

    def check(self, out: Sequence[int], tokenizer) -> Optional[dict]:
        """Req._check_str_based_finish after the newest token of `out`: the stop string, else the pattern, the
        decoded tail now holds (SGLang's finish_reason), None, or the abort of a pattern `re` cannot compile."""
        if not self.strs and not self.regexes:
            return None
        width = min(max(self.max_len, self.regex_max_len) + 1, len(out))  # Req._stop_match_tail_len
        tail = tokenizer.decode(list(out[-width:]))
        s = next((s for s in self.strs if s in tail), None)
        if s is not None:
            return {"type": "stop", "matched": s}
        for p in self.regexes:
            try:
                found = re.search(p, tail)
            except (re.error, RecursionError) as e:  # schedule_batch.py's FINISH_ABORT, HTTPStatus.BAD_REQUEST
                return {"type": "abort", "message": f"invalid stop_regex {p!r}: {e}", "status_code": 400,
                        "err_type": "BadRequestError"}
            if found:
                return {"type": "stop", "matched": p}
        return None


def finish_after(out: Sequence[int], *, stops: StopStrings, tokenizer, stop_token_ids, max_new_tokens: int,
                 ignore_eos: bool = False, grammar_ended: bool = False) -> Optional[dict]:
    """SGLang's finish_reason after the newest token of `out` (None: the response goes on). `stop_token_ids`:
    every id that ends it (the request's, the model's EOS, the tokenizer's eos_token_id)."""
    return finish_rules(stops.check(out, tokenizer), out[-1], len(out), stop_token_ids=stop_token_ids,
                        max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, grammar_ended=grammar_ended)


def finish_rules(text: Optional[dict], last: int, length: int, *, stop_token_ids, max_new_tokens: int,
                 ignore_eos: bool = False, grammar_ended: bool = False) -> Optional[dict]:
    """finish_after once `StopStrings.check` has been answered (`text`) for an output of `length` tokens ending
    in `last`: for an engine that checked the strings while generating and so need not decode again."""
    if text is not None and text["type"] == "stop":
        return text
    # an abort (a pattern that does not compile) does not return in SGLang: the rules below replace it
    if not ignore_eos and last in stop_token_ids:
        return {"type": "stop", "matched": last}
    if length >= max_new_tokens:
        return {"type": "length", "length": max_new_tokens}
    if grammar_ended:
        return {"type": "stop", "matched": last}
    return text
