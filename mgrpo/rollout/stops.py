"""When a response ends, as SGLang 0.5.23 decides it after each generated token (both CPU engines use this).

SGLang's rules (sglang/srt/managers/schedule_batch.py, `Req.update_finish_state` and the methods it calls;
sampling/sampling_params.py, `SamplingParams.normalize`), in their order, one token per step:
1. **stop strings** (`sampling_params.stop`, a string or a list of at most 32): the last
   `stop_str_max_len + 1` output tokens are decoded together (`tokenizer.decode`, special tokens kept), where
   `stop_str_max_len` is the longest stop string's length in tokens (`tokenizer.encode(s,
   add_special_tokens=False)`); a stop string contained in that text ends the response with
   `{"type": "stop", "matched": <the stop string>}`, the first of the list that matches. The output keeps every
   token up to and including the one that completed it (ids are never trimmed; `no_stop_trim` only shapes
   the answer's text). This rule is checked before the token rule and applies even with `ignore_eos`.
2. **stop tokens**, unless `ignore_eos`: the request's `stop_token_ids`, the model's EOS ids and the
   tokenizer's `eos_token_id` -> `{"type": "stop", "matched": <token id>}`, the token kept.
3. **length**: `max_new_tokens` tokens -> `{"type": "length", "length": max_new_tokens}`.
4. **grammar ended**: a grammar that had terminated before this token -> `{"type": "stop", "matched": <this
   token>}` (SGLang checks it before it feeds the new token to the grammar).
What is left out: `stop_regex` (refused by the CPU server), speculative decoding's several tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

MAX_STOP_COUNT = 32  # sampling_params.py MAX_STOP_COUNT


class StopError(ValueError):
    """Stop strings SGLang refuses, with its message."""


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings after SGLang's `normalize`."""

    strs: tuple[str, ...] = ()
    max_len: int = 0
    """The longest stop string in tokens (SGLang's stop_str_max_len)."""

    @classmethod
    def normalize(cls, stop: Any, tokenizer) -> "StopStrings":
        """SamplingParams.normalize for `stop` (a string, a list of strings or None), with SGLang's messages."""
        if stop is None:
            return cls()
        strs = [stop] if isinstance(stop, str) else list(stop)
        if len(strs) > MAX_STOP_COUNT:
            raise StopError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(strs)}")
        if tokenizer is None and strs:  # sampling_params.py raise_if_tokenizer_required
            raise StopError(f"stop={strs!r} is unavailable when skip_tokenizer_init=True "
                            "(requires tokenizer to decode tokens to text for matching).")
        longest = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in strs), default=0)
        return cls(tuple(strs), longest)

    def matched(self, out: Sequence[int], tokenizer) -> Optional[str]:
        """The stop string the response `out` (its newest token last) now contains in its tail, or None."""
        if not self.strs:
            return None
        tail = tokenizer.decode(list(out[-min(self.max_len + 1, len(out)):]))
        return next((s for s in self.strs if s in tail), None)


def finish_after(out: Sequence[int], *, stops: StopStrings, tokenizer, stop_token_ids, max_new_tokens: int,
                 ignore_eos: bool = False, grammar_ended: bool = False) -> Optional[dict]:
    """SGLang's finish_reason after the newest token of `out` (None: the response goes on). `stop_token_ids`:
    every id that ends it (the request's, the model's EOS, the tokenizer's eos_token_id)."""
    s = stops.matched(out, tokenizer)
    if s is not None:
        return {"type": "stop", "matched": s}
    if not ignore_eos and out[-1] in stop_token_ids:
        return {"type": "stop", "matched": out[-1]}
    if len(out) >= max_new_tokens:
        return {"type": "length", "length": max_new_tokens}
    if grammar_ended:
        return {"type": "stop", "matched": out[-1]}
    return None
