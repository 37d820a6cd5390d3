"""The one decode loop of both CPU engines (the in-process engine, hf_engine.py, and the CPU SGLang-protocol
server, sglang/cpu/model.py): a batch of requests sampled to their ends on a transformers model, as SGLang 0.5.23's
scheduler runs them.

- prefill of the left-padded prompts (every prompt ends at the last column) keeping only the last position's
  logits (all of them would be [rows x prompt x vocab]: 10 GB for 64 prompts of 256 tokens at Qwen3's vocabulary),
  then one KV-cached forward per step feeding each row's token (padding for a finished row);
- per step: each row's grammar mask on its logits (`Matchers`), one token per live row from the shared sampler
  (rollout/sampler.py), SGLang's finish rules in SGLang's order (rollout/stops.py::finish_after: stop strings,
  stop tokens, length, then the grammar's end, checked before the token is fed to the grammar);
- a row finishes on its own; the loop ends when every row has (a finished row's last token is never fed back);
- the experts each fed position was routed to, for the rows that ask (rollout/route_capture.py);
- the process's free heap pages returned every `DECODE_TRIM_EVERY` steps (mgrpo/heap.py: the loop's [rows x
  vocab] blocks fragment the heap, 1.4 GB at 32 rows of 128 tokens at Qwen3's vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from mgrpo.heap import DECODE_TRIM_EVERY, trim_heap
from mgrpo.rollout.sampler import Generators, RowSampling, sample
from mgrpo.rollout.stops import StopStrings, finish_after


@dataclass
class Req:
    """One request as the loop runs it (SGLang's per-request sampling params) and what it produced."""

    rid: str
    input_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None
    mask_mode: Optional[str] = None
    """'selected' | 'support': return each token's sampling support (SGLang's return_sampling_mask)."""
    top_logprobs_num: int = 0
    """Keep each output position's top log-probs (SGLang's top_logprobs_num, under return_logprob)."""
    routes_from: Optional[int] = None
    """Return the routed experts of positions [routes_from, prompt + output - 1)."""
    logprob_start_len: Optional[int] = None
    """The first input position whose log-prob is returned (SGLang's logprob_start_len); None: none of them."""
    input_logprobs: list = field(default_factory=list)
    """Log-probs of input positions logprob_start_len.. given the tokens before them; the first is None."""
    input_top_logprobs: list = field(default_factory=list)
    """With top_logprobs_num: per input position of `input_logprobs` its (values, ids) highest first; the first
    None (logprob_result_processor.py::_process_input_top_logprobs)."""
    stops: StopStrings = field(default_factory=StopStrings)
    """Stop strings (SGLang's sampling_params.stop, normalised; rollout/stops.py)."""
    grammar_key: Optional[tuple[str, str]] = None
    """SGLang's (kind, value) of the request's grammar; `grammar` is it compiled (xgrammar)."""
    grammar: Any = None
    lora: Any = None
    """The adapter the request named (cpu/lora.py::Adapter; SGLang's lora_path), None: the base model."""
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    mask_logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    route_rows: list = field(default_factory=list)
    routes: Optional[torch.Tensor] = None
    finish: Optional[dict] = None

    @property
    def sampling(self) -> RowSampling:
        return RowSampling(self.temperature, self.top_k, self.top_p, self.seed, self.mask_mode, self.top_logprobs_num)


class Matchers:
    """The requests' grammars in one decode loop, as SGLang's scheduler applies them: one xgrammar matcher
    per request with a grammar, its next-token bitmask applied to that row's logits before sampling (so the
    log-probs returned are over the masked logits, as SGLang's sampler computes them), the sampled token fed
    to it after the finish check."""

    def __init__(self, reqs: Sequence[Req], vocab_size: int):
        self.matchers = [None] * len(reqs)
        if not any(r.grammar is not None for r in reqs):
            return
        import xgrammar as xgr

        self.matchers = [xgr.GrammarMatcher(r.grammar) if r.grammar is not None else None for r in reqs]
        self.bitmask = xgr.allocate_token_bitmask(len(reqs), vocab_size)
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        live = [i for i, m in enumerate(self.matchers)
                if m is not None and reqs[i].finish is None and not m.is_terminated()]
        if not live:
            return
        import xgrammar as xgr

        self.bitmask.fill_(-1)  # every token allowed in the rows without a grammar
        for i in live:
            self.matchers[i].fill_next_token_bitmask(self.bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size)

    def ended(self, i: int) -> bool:
        return self.matchers[i] is not None and self.matchers[i].is_terminated()

    def accept(self, i: int, r: Req, tok: int) -> None:
        m = self.matchers[i]
        if m is None or m.is_terminated():
            return
        if not m.accept_token(tok):  # cannot happen under the mask; SGLang aborts the request with this
            r.finish = {"type": "abort", "message": f"Grammar accept_token failed: Tokens not accepted: {tok}",
                        "status_code": 500, "err_type": "InternalServerError"}


def decode(model, reqs: Sequence[Req], *, pad_id: int, stop_ids: set[int], tokenizer=None,
           generators: Generators = None, routes=None, stopped: Callable[[Req], bool] = lambda r: False,
           progress: Callable[[], None] = lambda: None) -> None:
    """Sample every request of `reqs` to its end, filling its out, logprobs (and masks, top_logprobs, route rows
    when asked: `finish_routes` puts the routes together) and finish. `stop_ids`: the ids that end every response
    (with each request's own); `tokenizer`: for stop strings; `generators`: the unseeded rows' random numbers (rollout/sampler.py);
    `routes`: a RouteCapture on `model` (rows with routes_from get theirs); `stopped(r)`: checked before each
    step, True once it has finished the request itself (an abort); `progress()`: after each step."""
    n, width = len(reqs), max(len(r.input_ids) for r in reqs)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
        mask[i, width - len(r.input_ids):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    keep = (lambda fed, seq, rows: _keep_routes(routes, reqs, fed, seq, rows)) if routes is not None else None
    if keep:
        keep([True] * n, width, lambda r: slice(width - len(r.input_ids), width))
    cache, logits = out.past_key_values, out.logits[:, -1, :].float()
    last_pos = positions[:, -1]
    grammars = Matchers(reqs, logits.shape[-1])
    rows = [r.sampling for r in reqs]
    stop_sets = [stop_ids | set(r.stop_token_ids) for r in reqs]
    for step in range(max(r.max_new_tokens for r in reqs)):
        grammars.mask(logits, reqs)
        live = [r.finish is None and not stopped(r) for r in reqs]
        draws = sample(logits, rows, [len(r.input_ids) - 1 + len(r.out) for r in reqs], live, generators)
        nxt = torch.full((n,), pad_id, dtype=torch.long)
        for i, (r, d) in enumerate(zip(reqs, draws)):
            if d is None:
                continue
            r.out.append(d.token)
            r.logprobs.append(d.logprob)
            if d.top is not None:
                r.top_logprobs.append(d.top)
            if d.mask is not None:
                r.masks.append(d.mask)
                r.mask_logprobs.append(d.mask_logprob)
            nxt[i] = d.token
            # SGLang's order (rollout/stops.py): the grammar's end is checked before the token is fed to it
            r.finish = finish_after(r.out, stops=r.stops, tokenizer=tokenizer, stop_token_ids=stop_sets[i],
                                    max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos,
                                    grammar_ended=grammars.ended(i))
            grammars.accept(i, r, d.token)
        progress()
        if (step + 1) % DECODE_TRIM_EVERY == 0:
            trim_heap()
        if all(r.finish is not None for r in reqs):
            break
        fed = [r.finish is None for r in reqs]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    past_key_values=cache, use_cache=True)
        if keep:
            keep(fed, 1, lambda r: slice(0, 1))
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()


def finish_routes(reqs: Sequence[Req], shape: tuple[int, int]) -> None:
    """Each request that asked for its routes (and was not aborted) gets them as SGLang returns them: int32
    [positions, layers, top_k] of positions [routes_from, prompt + output - 1); `shape`: (layers, top_k)."""
    for r in reqs:
        if r.routes_from is not None and (r.finish or {}).get("type") != "abort":
            rows = torch.cat(r.route_rows) if r.route_rows else torch.empty(0, *shape)
            r.routes = rows[min(r.routes_from, len(rows)):]  # SGLang: [start, seqlen - 1)
        r.route_rows = []


def _keep_routes(routes, reqs: Sequence[Req], fed: list[bool], seq: int, rows) -> None:
    """After a forward: each request that asked keeps the routes of the positions it fed."""
    got = routes.take(len(reqs), seq)
    for i, r in enumerate(reqs):
        if r.routes_from is not None and fed[i]:
            r.route_rows.append(got[i, rows(r)].clone())
