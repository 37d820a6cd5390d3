"""What the chat template puts between an assistant turn and the next one, as token ids.

A trajectory is kept as token ids (token-in, token-out): the sampled tokens of each assistant turn are never
decoded and re-encoded. What comes after a turn (tool replies, the next generation prompt) is rendered by
the tokenizer's own chat template *against a conversation*, and only the new part is taken:

    full   = template([user 'U', assistant 'A', tool r1, ..., tool rk], add_generation_prompt=True)
    suffix = everything in `full` after 'A' and the assistant's end-of-turn token (EOS)

Its first characters are what the model never samples: Qwen3 stops at `<|im_end|>` and its template writes a `\\n`
after it (verl PR #6921 lost exactly that `\\n`), so it is inserted as context. The suffix starts right after
a special token, so tokenizing it alone gives the ids the whole conversation would have there.

`drift` is the check: it renders the finished conversation with the tokenizer's template (assistant turns as
OpenAI messages with parsed `tool_calls`) and counts the tokens that differ from the trajectory's ids. What
it finds is named, not hidden: the template re-serialises the model's tool-call JSON (`{"a": 1}` for a
sampled `{"a":1}`), trims whitespace around content, and Qwen3's template drops `<think>` blocks of turns
before the last user message (not tool replies; so a pure tool-calling trajectory keeps them).
"""

from __future__ import annotations

import difflib
from typing import Optional


class ChatTemplate:
    def __init__(self, tokenizer, *, enable_thinking: bool = True):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.multi_turn needs a tokenizer with a chat template (model.tokenizer=qwen3 or "
                             "a tokenizer directory; 'synthetic' has none)")
        self.tok = tokenizer
        self.kwargs = {"enable_thinking": enable_thinking}
        self.end_text = tokenizer.eos_token
        self.after_end = self._after_turn(self._render(self._turn + [{"role": "user", "content": "V"}]))
        """Template text between the assistant's end-of-turn token and the next message (Qwen3: '\\n'), never
        sampled."""
        self.after_end = self.after_end[:self.after_end.find("V")] if "V" in self.after_end else ""
        end = self._render(self._turn)
        self.final_tail = end[end.rfind(self.end_text) + len(self.end_text):] if self.end_text in end else ""
        """Template text after the last assistant turn's end-of-turn token (what `drift` leaves out)."""

    _turn = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]

    def _after_turn(self, full: str) -> str:
        mark = "A" + self.end_text
        if full.count(mark) != 1:
            raise ValueError(f"the chat template does not end an assistant turn with the EOS token {self.end_text!r}")
        return full[full.index(mark) + len(mark):]

    def _render(self, messages: list[dict], tools: Optional[list[dict]] = None, gen: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen,
                                            **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def tool_suffix(self, replies: list[str]) -> list[int]:
        """Context ids after an assistant turn that ended with the EOS token: `replies` as tool messages,
        then the generation prompt of the next assistant turn."""
        return self.suffix([{"role": "tool", "content": r} for r in replies])

    def suffix(self, messages: list[dict]) -> list[int]:
        """Context ids after an assistant turn that ended with the EOS token: `messages` (tool replies, or an
        environment's user messages) as the template renders them there, then the next generation prompt."""
        return self.encode(self._after_turn(self._render(self._turn + list(messages), gen=True)))

    def end_tail(self) -> list[int]:
        """Ids of the template text after a final end-of-turn token (what `drift` leaves out)."""
        return self.encode(self.final_tail) if self.final_tail else []

    def render_ids(self, messages: list[dict], tools: Optional[list[dict]]) -> list[int]:
        return self.encode(self._render(messages, tools))


def count_drift(ours: list[int], theirs: list[int]) -> int:
    """Tokens that differ between two id sequences: those outside the longest matching blocks, counted on
    the longer side."""
    sm = difflib.SequenceMatcher(a=ours, b=theirs, autojunk=False)
    same = sum(b.size for b in sm.get_matching_blocks())
    return max(len(ours), len(theirs)) - same
