"""Constrained tool calls (rollout.multi_turn.tool_choice, reset_tool_choice, stop_after_call).

Each turn's request carries the constraint SGLang's chat serving would send for the trajectory's tools
(`ToolCallParser.constraint`: a structural tag), and each returned turn is replayed through the same grammar
(mgrpo/rollout/grammar.py): a token the grammar restricted is context (sampled mask 0), so only the policy's
free choices carry loss. With stop_after_call, a turn ends at the end of its first call.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.trajectory import Trajectory
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import GenerateResult


class CallConstraints:
    def __init__(self, cfg: MultiTurnConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        self._grammars = None  # built on the first constrained turn
        self.stop: tuple[str, ...] = ()
        """The engine's stop strings: the text that ends a call, with stop_after_call."""
        if cfg.stop_after_call:
            end = ToolCallParser(cfg.format, []).end_of_call()
            if not end:
                raise ValueError(f"rollout.multi_turn.stop_after_call: the {cfg.format} format has no text that "
                                 "ends a call")
            self.stop = (end,)

    def tag(self, parser: ToolCallParser, choice: str) -> Optional[str]:
        """The structural tag SGLang's chat serving would send for `choice` and these tools, or None."""
        constraint = parser.constraint(choice)
        if constraint is not None and constraint[0] != "structural_tag":
            raise ValueError(f"rollout.multi_turn.tool_choice={choice}: SGLang constrains the {self.cfg.format} "
                             f"format with {constraint[0]}, which the runner does not send yet")
        return constraint[1] if constraint is not None else None

    def free(self, tag: Optional[str], token_ids: Sequence[int], traj: Trajectory) -> Optional[list[int]]:
        """Under a grammar: per token 1 where the policy chose freely (the grammar allowed every token), 0
        where the grammar restricted the choice (context); None without one (every token sampled)."""
        if tag is None:
            return None
        from mgrpo.rollout.grammar import Grammars, restricted_steps

        if self._grammars is None:
            self._grammars = Grammars(self.tok, len(self.tok), [self.tok.eos_token_id])
        flags = restricted_steps(self._grammars.compile_structural_tag(tag), token_ids, len(self.tok))
        traj.count("multi_turn/constrained_tokens", sum(flags))
        return [0 if f else 1 for f in flags]

    def cut_after_call(self, res: GenerateResult, traj: Trajectory) -> GenerateResult:
        """stop_after_call: the turn ends at the first token after which its decoded text holds the end of a
        call. The engine's `stop` is matched as SGLang matches it, in the decoded last (its length in tokens +
        1) tokens (rollout/stops.py), which misses an end the grammar spelled in more tokens (`</tool_call>`
        character by character: the tag allows both); the engine then went on to EOS or the budget. The tokens
        past the end are dropped here, as a stop would have, and counted (multi_turn/tokens_cut_after_call)."""
        if not self.stop or not self._holds_stop(res.token_ids):
            return res
        ids = res.token_ids
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop (holding one is monotone in k)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._holds_stop(ids[:mid]) else (mid + 1, hi)
        if lo == len(ids) and res.finish_reason == "stop":
            return res  # the engine's stop ended it there
        cut = len(ids) - lo
        traj.count("multi_turn/tokens_cut_after_call", cut)
        routes = res.routed_experts  # [fed + out - 1, L, K]: the dropped tokens' rows go too
        return replace(res, token_ids=list(ids[:lo]), logprobs=list(res.logprobs[:lo]), finish_reason="stop",
                       support=None if res.support is None else list(res.support[:lo]),
                       routed_experts=None if routes is None else routes[:len(routes) - cut])

    def _holds_stop(self, ids: Sequence[int]) -> bool:
        text = self.tok.decode(ids, skip_special_tokens=False)
        return any(s in text for s in self.stop)
