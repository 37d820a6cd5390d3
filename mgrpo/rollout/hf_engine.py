"""In-process rollout engine on Hugging Face transformers (the CPU backend; see docs/architecture.md).

It implements the same interface as the SGLang client (`RolloutEngine`): generate with per-token
log-probs (and, when asked, each token's sampling support under top-k / top-p), receive HF-named
weight buckets from the trainer, report health. It is what the default CPU job and the tests use; on
GPUs SGLang takes its place. Tokens are drawn by the `Sample` logits processor (transformers decodes
greedily on what it leaves): a request with its own seed (`GenerateRequest.seed`) per row by SGLang's
seeded sampler, independent of its batch; the others by inversion (rollout/categorical.py), the
distribution torch.multinomial draws from at a tenth of its CPU cost. `SamplingParams.structural_tag`
(SGLang's grammar-constrained decoding) is enforced with xgrammar as SGLang's grammar backend does
(mgrpo/rollout/grammar.py).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Optional, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from mgrpo.heap import DECODE_TRIM_EVERY, trim_heap
from mgrpo.models.registry import hf_named_tensors
from mgrpo.rollout.route_capture import check_routes_from, generated_routes
from mgrpo.rollout.types import EngineDefaults, EngineHealth, GenerateRequest, GenerateResult, SamplingParams


class TokenLogprobs(LogitsProcessor):
    """Each sampled token's log-prob under log_softmax(raw logits / T), the tempered distribution before
    top-p/top-k truncation: what the trainer recomputes for the same tokens.

    transformers applies a caller's processors before its temperature / top-k / top-p warpers, so this one
    sees every decode step's raw logits. Which token was sampled shows only in the next step's input_ids,
    so one step's logits wait for it; `result` takes the last column. At most one step of [rows x vocab]
    is held (`output_logits=True` would keep all of them: rows x steps x vocab, 5 GB for 64 rows of 128
    tokens at Qwen3's 151,936-token vocabulary, and stacking them and their log-softmax tripled it).
    """

    def __init__(self, temperature: float):
        self.inv_t = 1.0 / temperature
        self.columns: list[torch.Tensor] = []
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # last step's (logits, lse)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        # log-sum-exp of scores / T with a single [rows x vocab] temporary (torch.logsumexp makes several)
        m = scores.amax(dim=-1, keepdim=True)
        lse = torch.sub(scores, m).mul_(self.inv_t).exp_().sum(dim=-1).log_() + m.squeeze(-1) * self.inv_t
        self.pending = (scores, lse)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        logits, lse = self.pending
        self.columns.append(logits.gather(-1, tokens[:, None]).squeeze(-1).float() * self.inv_t - lse)
        self.pending = None

    def result(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, steps] log-probs of `new_tokens` (the generated columns)."""
        if self.pending is not None:
            self._take(new_tokens[:, len(self.columns)])
        if len(self.columns) != new_tokens.shape[1]:
            raise RuntimeError(f"{len(self.columns)} decode steps seen for {new_tokens.shape[1]} generated tokens")
        return torch.stack(self.columns, dim=1)


class SGLangStops(StoppingCriteria):
    """Stop strings and stop patterns as SGLang matches them (rollout/stops.py): after each token, in the
    decoded tail of the longest stop's length + 1 tokens. transformers' own `stop_strings` stops wherever the
    text ends with a stop string, also one spelled in more tokens than its own encoding (a grammar may write
    `</tool_call>` character by character), where SGLang, and so this engine, goes on. A row also stops on a
    pattern `re` cannot compile (SGLang aborts it; `_finish` raises).

    Each row's first answer is kept (`found`: the number of tokens generated then, and check()'s result), so
    `_finish` applies SGLang's rules without decoding any prefix again: with an unbounded pattern every check
    decodes the whole output (as SGLang's does), and checking every prefix again afterwards was quadratic in
    the row's length on top of that. A row is checked no more once it has an answer or generated an EOS
    (transformers has finished it; what follows in the row is padding)."""

    def __init__(self, stops, tokenizer, prompt_width: int, eos: set[int]):
        self.stops, self.tok, self.width, self.eos = stops, tokenizer, prompt_width, eos
        self.found: list[Optional[tuple[int, dict]]] = []
        self.done: list[bool] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if not self.done:
            self.found, self.done = [None] * input_ids.shape[0], [False] * input_ids.shape[0]
        step = input_ids.shape[1] - self.width  # tokens generated so far
        width = max(self.stops.max_len, self.stops.regex_max_len) + 1  # the tail check() decodes, at most
        for i, row in enumerate(input_ids[:, max(self.width, input_ids.shape[1] - width):].tolist()):
            if self.done[i]:
                continue
            got = self.stops.check(row, self.tok)
            if got is not None:
                self.found[i] = (step, got)
            self.done[i] = got is not None or row[-1] in self.eos
        return torch.tensor([f is not None for f in self.found], dtype=torch.bool, device=input_ids.device)


class Sample(LogitsProcessor):
    """Draws each row's token and returns scores whose only finite entry is the draw, so the greedy decode
    that follows takes it: transformers' `generate` samples with torch.multinomial, whose CPU exponentials
    cost 48 ms a decode step at 16 rows of Qwen3's 151,936-token vocabulary, more than the step's forward.

    Runs last, on what the grammar left: warps with the same transformers warpers generate() builds when
    sampling (temperature, top-k, top-p), keeps the warped scores when supports are asked (what
    `output_scores` would have held), and draws from their softmax:
    - rows without a seed of their own: `categorical.sample_categorical` (the same distribution as
      torch.multinomial, from torch's default generator, which SamplingParams.seed seeds);
    - `seeds` given (requests with their own `GenerateRequest.seed`): each row with SGLang's seeded sampler
      (rollout/seeded.py::multinomial_with_seed: Gumbel noise from the row's seed and position), so it does
      not depend on the other rows of the batch. `lengths`: per row its prompt length; `width`: the padded
      prompt width."""

    def __init__(self, sampling: SamplingParams, keep_scores: bool, seeds: Optional[Sequence[int]] = None,
                 lengths: Sequence[int] = (), width: int = 0):
        from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)

        self.seeds = torch.tensor(list(seeds), dtype=torch.int64) if seeds is not None else None
        self.lengths = torch.tensor(list(lengths), dtype=torch.int64)
        self.width = width
        self.warpers = [w for w in (
            TemperatureLogitsWarper(sampling.temperature) if sampling.temperature != 1.0 else None,
            TopKLogitsWarper(top_k=sampling.top_k) if sampling.top_k > 0 else None,
            TopPLogitsWarper(top_p=sampling.top_p) if sampling.top_p < 1.0 else None) if w is not None]
        self.scores: Optional[list[torch.Tensor]] = [] if keep_scores else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        from mgrpo.rollout.categorical import sample_categorical
        from mgrpo.rollout.seeded import multinomial_with_seed

        warped = scores
        for w in self.warpers:
            warped = w(input_ids, warped)
        if self.scores is not None:
            self.scores.append(warped.float())
        probs = torch.softmax(warped.float(), dim=-1)
        if self.seeds is None:
            pick = sample_categorical(probs)
        else:
            positions = self.lengths - 1 + (input_ids.shape[1] - self.width)  # of the last token fed (SGLang's)
            pick = multinomial_with_seed(torch.log(probs), self.seeds, positions)
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


class TrimHeap(LogitsProcessor):
    """Returns the process's free heap pages every `every` decode steps (mgrpo/heap.py: the decode loop's
    blocks fragment the heap within one `generate`, 1.4 GB at 32 rows of 128 tokens at Qwen3's vocabulary).
    Leaves the scores as they are."""

    def __init__(self, every: int = DECODE_TRIM_EVERY):
        self.every, self.steps = every, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.steps += 1
        if self.steps % self.every == 0:
            trim_heap()
        return scores


class HFRolloutEngine(EngineDefaults):
    """The in-process transformers engine (CPU): no server, no accelerator memory to give back, no retries."""

    def __init__(self, hf_dir: str, *, eos_token_ids: Sequence[int], pad_token_id: int, chunk_size: int = 512,
                 num_threads: int | None = None, weight_version: int = 0, return_routed_experts: bool = False,
                 tokenizer: Optional[str] = None):
        """`tokenizer`: the run's model.tokenizer, loaded when a request first carries a grammar."""
        from transformers import AutoModelForCausalLM

        from mgrpo.rollout.route_capture import RouteCapture

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.chunk_size = chunk_size
        self.weight_version = weight_version
        # under the names weight sync sends (checkpoint names: per expert for Qwen3-MoE, whose experts
        # transformers 5 fuses in memory), as views that share the parameters' memory
        self._params = hf_named_tensors(self.model)
        self.routes = RouteCapture(self.model, what="return_routed_experts") if return_routed_experts else None
        """The experts each token was routed to, from the model's routers (as the CPU server captures them)."""
        self._received: set[str] = set()
        self._tokenizer = tokenizer
        self._grammars = None
        self._generated = 0
        # one model, one global random generator: calls from several host threads take turns
        self._lock = threading.Lock()

    # --- generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        with self._lock:
            return self._generate(requests, sampling)

    def _generate(self, requests: Sequence[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        # Similar lengths share a forward batch, which keeps left padding small.
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list[GenerateResult] = []
        for start in range(0, len(order), self.chunk_size):
            chunk = [requests[i] for i in order[start:start + self.chunk_size]]
            results.extend(self._generate_chunk(chunk, sampling))
        self._generated += len(results)
        return sorted(results, key=lambda r: r.uid)

    def _generate_chunk(self, chunk: Sequence[GenerateRequest], sampling: SamplingParams) -> list[GenerateResult]:
        width = max(len(r.prompt_ids) for r in chunk)
        # left padding: every prompt ends at the same column (one tensor built from lists: a per-row
        # tensor copy costs more than the forward of a tiny model)
        ids = torch.tensor([[self.pad_token_id] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in chunk],
                           dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in chunk],
                            dtype=torch.long)
        sample = not sampling.greedy
        supports = sampling.return_support and sample
        grammar = self._grammar(sampling.structural_tag, len(chunk)) if sampling.structural_tag else None
        eos = set(self.eos_token_ids)
        stops = None
        if sampling.stop or sampling.stop_regex:  # SGLang's normalize: refused (StopError) before generating
            from mgrpo.rollout.stops import StopStrings

            stops = SGLangStops(StopStrings.normalize(list(sampling.stop), self._tok(),
                                                      list(sampling.stop_regex) or None), self._tok(), width, eos)
        if sampling.return_routed_experts and self.routes is None:
            raise ValueError("return_routed_experts was asked, but the engine was built without "
                             "return_routed_experts=True (a mixture-of-experts model's routes are captured then)")
        if sampling.return_routed_experts:
            for r in chunk:
                check_routes_from(r.routes_from, len(r.prompt_ids))
        # Without supports each sampled token's log-prob is read from its own decode step's logits (one step
        # held); supports need every step's processed scores.
        step_logprobs = None if supports else TokenLogprobs(sampling.temperature if sample else 1.0)
        sampler = None
        if sample:
            seeds = None
            if any(r.seed is not None for r in chunk):
                # rows without a seed of their own draw one from the call's generator (seeded by SamplingParams.seed)
                seeds = [r.seed if r.seed is not None else int(torch.randint(2 ** 62, (1,))) for r in chunk]
            sampler = Sample(sampling, supports, seeds, [len(r.prompt_ids) for r in chunk], width)
        capture = self.routes.every_forward(self.model) if sampling.return_routed_experts else nullcontext([])
        with capture as forwards:
            out = self._sample(ids, mask, sampling, step_logprobs, grammar, sampler, stops)
        new_tokens = out.sequences[:, width:]
        if supports:
            # The processed scores are what transformers sampled from: logits / temperature, then its
            # top-k and top-p warpers (in that order) set every token outside the support to -inf. Their
            # log-softmax is the behaviour log-prob over the support; the finite entries are the support.
            scores = torch.stack(sampler.scores, dim=1)
            token_supports = _supports(torch.isfinite(scores))
            token_logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        else:
            token_supports = None
            token_logprobs = step_logprobs.result(new_tokens)
        results = []
        for i, (r, toks, lps) in enumerate(zip(chunk, new_tokens.tolist(), token_logprobs.tolist())):
            n, finish = len(toks), "length"
            if stops is not None:
                n, finish = self._finish(toks, stops.found[i] if stops.found else None, eos,
                                         sampling.max_new_tokens)
            else:
                for j, t in enumerate(toks):
                    if t in eos:
                        n, finish = j + 1, "stop"
                        break
            support = None
            if sampling.return_support:  # greedy: no sampling distribution, every token 'whole vocabulary'
                support = token_supports[i][:n] if token_supports is not None else [None] * n
            results.append(GenerateResult(uid=r.uid, token_ids=toks[:n], logprobs=lps[:n], finish_reason=finish,
                                          weight_version=self.weight_version, support=support))
            if forwards:
                # SGLang's rows [routed_experts_start_len, prompt + output - 1)
                results[-1].routed_experts = generated_routes(forwards, i, len(r.prompt_ids), width, n)[r.routes_from:]
        return results

    def _tok(self):
        """The run's tokenizer: for grammars and stop strings only (the engine otherwise works on ids)."""
        if not isinstance(self._tokenizer, (str, type(None))):
            return self._tokenizer
        from mgrpo.rollout.grammar import load_engine_tokenizer

        self._tokenizer = load_engine_tokenizer(self._tokenizer)
        return self._tokenizer

    def _grammar(self, structural_tag: str, rows: int):
        """A GrammarProcessor for `rows` rows of one structural tag (GrammarError as SGLang refuses it)."""
        from mgrpo.rollout.grammar import GrammarProcessor, Grammars

        if self._grammars is None:
            vocab = self.model.get_input_embeddings().weight.shape[0]
            self._grammars = Grammars(self._tok(), vocab, self.eos_token_ids)
        compiled = self._grammars.compile_structural_tag(structural_tag)
        return GrammarProcessor(compiled, rows, self._grammars.vocab_size, self.pad_token_id)

    @staticmethod
    def _finish(toks: list[int], found: Optional[tuple[int, dict]], eos: set[int],
                max_new_tokens: int) -> tuple[int, str]:
        """(tokens kept, 'stop' or 'length'): SGLang's finish rules after every token (rollout/stops.py, shared
        with the CPU server), with the stop strings' answer `SGLangStops` found while generating (`found`: the
        tokens generated then and check()'s result; check() answered None before it); the abort SGLang answers
        400 for a pattern `re` cannot compile raises here."""
        from mgrpo.rollout.stops import finish_rules

        at, text = found if found is not None else (0, None)
        for j, t in enumerate(toks):
            fin = finish_rules(text if j + 1 == at else None, t, j + 1, stop_token_ids=eos,
                               max_new_tokens=max_new_tokens)
            if fin is not None:
                if fin["type"] == "abort":
                    raise ValueError(fin["message"])
                return j + 1, fin["type"]
        return len(toks), "length"

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingParams,
                step_logprobs: Optional[TokenLogprobs], grammar=None, sampler: Optional[Sample] = None,
                stops: Optional[SGLangStops] = None):
        # a sampled row's only finite score is its draw (Sample), so transformers always decodes greedily
        return self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            stopping_criteria=StoppingCriteriaList([stops]) if stops is not None else None,
            pad_token_id=self.pad_token_id,
            # the log-probs read the raw logits (what the trainer recomputes), the grammar masks after them
            logits_processor=LogitsProcessorList([p for p in (step_logprobs, grammar, sampler, TrimHeap())
                                                  if p is not None]),
            return_dict_in_generate=True,
        )

    # --- weight sync ----------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            self._load(named_tensors)

    def _load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"weight sync: engine has no parameter {name!r}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"weight sync: {name} has shape {tuple(tensor.shape)}, engine expects "
                                 f"{tuple(param.shape)}")
            if param.data_ptr() != tensor.data_ptr():  # a tensor shared with the trainer (`share`) is already there
                param.copy_(tensor)
            self._received.add(name)

    @torch.no_grad()
    def share(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Use the given tensors' memory as this engine's parameters of the same name, shape and dtype; return
        the bytes freed. For an engine inside the trainer's process (rollout.mode=hybrid, one trainer shard
        per weight): the trainer's parameters that export to HF as they are (the embedding above all: at
        Qwen3's vocabulary it is most of a small model) then exist once. The trainer updates them in place
        before each weight sync, which copies the other tensors; generation never runs between the two."""
        by_ptr = {p.data_ptr(): p for p in self.model.parameters()}
        freed = 0
        with self._lock:
            for name, tensor in named_tensors:
                view = self._params.get(name)
                param = by_ptr.get(view.data_ptr()) if view is not None else None
                if (param is None or param.shape != tensor.shape or param.dtype != tensor.dtype
                        or param.device != tensor.device or not tensor.is_contiguous()
                        or param.data_ptr() == tensor.data_ptr()):
                    continue
                freed += param.numel() * param.element_size()
                param.data = tensor.detach()  # tied weights are one Parameter: both names follow
            self._params = hf_named_tensors(self.model)
        return freed

    def finish_weight_update(self, version: int) -> None:
        missing = sorted(set(self._params) - self._received)
        self._received = set()
        if missing:
            raise RuntimeError(f"weight sync to version {version} is incomplete: {len(missing)} tensors never "
                               f"arrived, e.g. {missing[:5]}")
        self.weight_version = version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # --- lifecycle ------------------------------------------------------------------------------
    def health(self) -> EngineHealth:
        return EngineHealth(ok=True, weight_version=self.weight_version, detail={"generated": self._generated})


def _supports(kept: torch.Tensor) -> list[list[Optional[list[int]]]]:
    """Per sequence, per step: the ascending ids where `kept` [B, S, V] is True, or None where all are
    (nothing was cut). Only the truncated steps are expanded into ids."""
    b, s, v = kept.shape
    counts = kept.sum(-1).flatten().tolist()
    cut = ~kept.all(-1)
    ids = kept[cut].nonzero()[:, 1].tolist()  # row-major: ascending within each truncated step
    out: list[list[Optional[list[int]]]] = []
    at = 0
    for k, c in enumerate(counts):
        if k % s == 0:
            out.append([])
        if c == v:
            out[-1].append(None)
        else:
            out[-1].append(ids[at:at + c])
            at += c
    return out
