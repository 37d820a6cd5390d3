"""The model side of the CPU rollout server: batched sampling with per-token log-probs, weight
loading, memory release. No HTTP here (server.py); every call runs on the server's single
model thread, so generation and weight loads never interleave.

Sampling follows SGLang's per-request semantics: each request has its own sampling params and, when
`sampling_seed` is given, is drawn by SGLang's seeded sampler (rollout/seeded.py: Gumbel noise hashed from
the seed, the position and the column), so a request's tokens do not depend on what else is in the batch. Log-probs are those of the full tempered distribution, log_softmax(logits / T),
before top-p/top-k truncation (T=0: greedy, log-probs at T=1), as `hf_engine.py` and the trainer
compute them. On request (`mask_mode`) also each token's sampling support and behaviour log-prob, as
SGLang's sampler captures them (srt/layers/sampler.py::_build_sampling_mask_output: the tokens the
filtered distribution keeps, by decreasing probability, and log(p / mass kept)), and the experts each
position was routed to (rollout/route_capture.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from mgrpo.rollout.categorical import sample_categorical
from mgrpo.rollout.seeded import sample_row
from mgrpo.rollout.sglang.protocol.tables import MEMORY_TAGS
from mgrpo.rollout.stops import StopStrings, finish_after


@dataclass
class Req:
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
    """SGLang's (kind, value) of the request's grammar; `grammar` is it compiled (cpu/text.py)."""
    grammar: Any = None
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    mask_logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    route_rows: list = field(default_factory=list)
    routes: Optional[torch.Tensor] = None
    finish: Optional[dict] = None


INPUT_LOGITS_BYTES = 256 << 20
"""Most fp32 logits one batch of input-token log-probs holds (rows x width x vocabulary x 4)."""


class ModelError(ValueError):
    """A request the model cannot serve in its current state (answered with 400)."""


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


class CPUModel:
    def __init__(self, model_path: str, *, dtype: str = "auto", seed: int = 0, enable_memory_saver: bool = False,
                 enable_weights_cpu_backup: bool = False, return_routed_experts: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM

        from mgrpo.rollout.route_capture import RouteCapture
        from mgrpo.rollout.sglang.cpu.moe import weight_targets

        torch_dtype = torch.float32 if dtype in ("auto", "float32", "float") else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
        cfg = AutoConfig.from_pretrained(model_path)
        eos = getattr(self.model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.stop_ids = set(self.eos_ids)
        """Ids that end a response (unless ignore_eos): the model's EOS, with a tokenizer also its eos_token_id."""
        self.tokenizer = None
        """The server's tokenizer (cpu/text.py), for stop strings; None: the server has none."""
        self.pad_id = getattr(cfg, "pad_token_id", None) or 0
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.params = dict(self.model.named_parameters())  # tied: lm_head shares embed_tokens' Parameter
        self.targets = weight_targets(self.model)
        """SGLang's weight names (one per expert for MoE) -> (parameter, the slice they fill)."""
        self.routes = RouteCapture(self.model) if return_routed_experts else None
        self._shapes = {n: p.shape for n, p in self.params.items()}
        self.rng = torch.Generator().manual_seed(seed)
        self.memory_saver = enable_memory_saver
        self.cpu_backup = enable_weights_cpu_backup
        self.released: set[str] = set()
        self.stale: set[str] = set()
        """Tensors whose memory was released and re-taken but not loaded since (undefined contents)."""
        self._backup: dict[str, torch.Tensor] = {}
        self.aborted: set[str] = set()
        self.abort_all_before = 0.0
        self.lock = threading.Lock()  # guards the abort state, written from the HTTP thread
        self.last_progress = time.monotonic()
        self.busy = 0

    # --- generation -------------------------------------------------------------------------------
    def check_servable(self) -> None:
        if self.released:
            raise ModelError(f"memory {sorted(self.released)} is released: POST /resume_memory_occupation first")
        if self.stale:
            raise ModelError(f"the weights were released and {len(self.stale)} tensors were not loaded since "
                             f"(e.g. {sorted(self.stale)[:3]}): sync the weights before generating")

    def abort(self, rid: Optional[str], abort_all: bool) -> None:
        with self.lock:
            if abort_all:
                self.abort_all_before = time.monotonic()
            elif rid:
                self.aborted.add(rid)

    def _is_aborted(self, req: Req, started: float) -> bool:
        with self.lock:
            if req.rid in self.aborted:
                self.aborted.discard(req.rid)
                return True
            return self.abort_all_before >= started

    @torch.no_grad()
    def generate(self, reqs: Sequence[Req], submitted: Optional[float] = None) -> list[Req]:
        """Sample every request to its end; `submitted`: when the requests arrived (an abort_all
        after that aborts them, also while they waited for the model thread)."""
        started = time.monotonic() if submitted is None else submitted
        self.check_servable()
        vocab = self.model.config.vocab_size
        for r in reqs:
            if not r.input_ids:
                raise ModelError(f"request {r.rid}: empty input_ids")
            bad = [t for t in r.input_ids if not 0 <= t < vocab]
            if bad:
                raise ModelError(f"request {r.rid}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        for r in reqs:
            if r.max_new_tokens == 0:  # SGLang answers at once: nothing generated, finished by length
                r.finish = {"type": "length", "length": 0}
        self._input_logprobs([r for r in reqs
                              if r.logprob_start_len is not None and r.logprob_start_len < len(r.input_ids)])
        active = [r for r in reqs if r.finish is None and not self._abort_if(r, started, running=False)]
        if active:
            self._decode(active, started)
        for r in reqs:
            if r.routes_from is not None and r.finish.get("type") != "abort":
                rows = torch.cat(r.route_rows) if r.route_rows else torch.empty(0, *self.routes_shape)
                r.routes = rows[min(r.routes_from, len(rows)):]  # SGLang: [start, seqlen - 1)
            r.route_rows = []
        return list(reqs)

    @property
    def routes_shape(self) -> tuple[int, int]:
        return (len(self.routes.modules), self.routes.top_k)

    def _abort_if(self, r: Req, started: float, running: bool) -> bool:
        """SGLang 0.5.23's answers: a running request finishes with FINISH_ABORT().to_json() (scheduler.py
        abort_request, method 3); a waiting one with the tokenizer manager's own (_handle_abort_req)."""
        if r.finish is None and self._is_aborted(r, started):
            r.finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None} if running \
                else {"type": "abort", "message": "Abort in waiting queue"}
            return True
        return False

    def _input_logprobs(self, reqs: list[Req]) -> None:
        """SGLang's input-token log-probs: at every input position from logprob_start_len on, log_softmax of the
        logits (untempered, as logprob_processor.py computes them) at the token before, taken at the input's token;
        the first position None (logprob_result_processor.py). Rows are batched left-padded, as the prefill, at
        most INPUT_LOGITS_BYTES of fp32 logits at once."""
        vocab = self.model.config.vocab_size
        width_of = lambda r: len(r.input_ids)  # noqa: E731
        order = sorted(reqs, key=width_of)
        while order:
            width = width_of(order[-1])
            rows = max(1, INPUT_LOGITS_BYTES // (4 * width * vocab))
            batch, order = order[-rows:], order[:-rows]
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
                mask[i, width - len(r.input_ids):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            for i, r in enumerate(batch):
                pad, n = width - len(r.input_ids), len(r.input_ids)
                rows_lp = torch.log_softmax(logits[i, pad + r.logprob_start_len:pad + n - 1].float(), dim=-1)
                nxt = torch.tensor(r.input_ids[r.logprob_start_len + 1:])
                r.input_logprobs = [None] + rows_lp.gather(-1, nxt[:, None])[:, 0].tolist()
                if r.top_logprobs_num:  # input_top_logprobs: the same rows' top entries, the first None too
                    vals, idx = torch.topk(rows_lp, min(r.top_logprobs_num, rows_lp.shape[-1]))
                    r.input_top_logprobs = [None] + list(zip(vals.tolist(), idx.tolist()))

    def _decode(self, reqs: list[Req], started: float) -> None:
        n, width = len(reqs), max(len(r.input_ids) for r in reqs)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding: every prompt ends at the last column
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids):] = 1
        gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None
                else torch.Generator().manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.rng)))
                for r in reqs]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Prefill: only the last position's logits are sampled from; all of them would be [rows x prompt x vocab]
        # (10 GB for 64 prompts of 256 tokens at Qwen3's vocabulary).
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        self._keep_routes(reqs, [True] * n, ids.shape[1], lambda i, r: slice(width - len(r.input_ids), width))
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        last_pos = positions[:, -1]
        grammars = Matchers(reqs, logits.shape[-1])
        stop_ids = [self.stop_ids | set(r.stop_token_ids) for r in reqs]
        for step in range(max(r.max_new_tokens for r in reqs)):
            nxt = torch.full((n,), self.pad_id, dtype=torch.long)
            grammars.mask(logits, reqs)
            for i, r in enumerate(reqs):
                if r.finish is not None or self._abort_if(r, started, running=True):
                    continue
                tok, lp = self._sample(logits[i], r, gens[i], len(r.input_ids) - 1 + len(r.out))
                r.out.append(tok)
                r.logprobs.append(lp)
                nxt[i] = tok
                # SGLang's order (rollout/stops.py): the grammar's end is checked before the token is fed to it
                r.finish = finish_after(r.out, stops=r.stops, tokenizer=self.tokenizer, stop_token_ids=stop_ids[i],
                                        max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos,
                                        grammar_ended=grammars.ended(i))
                grammars.accept(i, r, tok)
            self.last_progress = time.monotonic()
            if all(r.finish is not None for r in reqs):
                return
            fed = [r.finish is None for r in reqs]  # a finished request's last token is never fed back
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             past_key_values=cache, use_cache=True)
            self._keep_routes(reqs, fed, 1, lambda i, r: slice(0, 1))
            cache, logits = out.past_key_values, out.logits[:, -1, :].float()

    def use_tokenizer(self, tokenizer, stop_ids: set[int]) -> None:
        """The server's tokenizer (stop strings) and the ids it adds to the model's EOS (cpu/text.py)."""
        self.tokenizer = tokenizer
        self.stop_ids = self.eos_ids | set(stop_ids)

    def _keep_routes(self, reqs: list[Req], fed: list[bool], seq: int, rows) -> None:
        """After a forward: each request that asked keeps the routes of the positions it fed."""
        if self.routes is None:
            return
        got = self.routes.take(len(reqs), seq)
        for i, r in enumerate(reqs):
            if r.routes_from is not None and fed[i]:
                r.route_rows.append(got[i, rows(i, r)].clone())

    @staticmethod
    def _sample(logits: torch.Tensor, r: Req, gen: torch.Generator, position: int) -> tuple[int, float]:
        """`position`: of the last token fed (SGLang's seeded sampler hashes it with the request's seed)."""
        greedy = r.temperature == 0.0 or r.top_k == 1
        scaled = logits / (1.0 if r.temperature == 0.0 else r.temperature)
        logp = torch.log_softmax(scaled, dim=-1)
        if r.top_logprobs_num:  # the same distribution output_token_logprobs reads, highest first (torch.topk)
            vals, idx = torch.topk(logp, min(r.top_logprobs_num, logp.numel()))
            r.top_logprobs.append((vals.tolist(), idx.tolist()))
        if greedy:
            tok = int(torch.argmax(logits))
            if r.mask_mode is not None:  # sampler.py::_build_greedy_sampling_mask_output
                r.masks.append([tok])
                r.mask_logprobs.append([0.0] if r.mask_mode == "support" else 0.0)
            return tok, float(logp[tok])
        if r.seed is not None:  # SGLang's seeded sampler: the row's token depends on its own seed and position only
            tok, probs_sort, probs_idx, pick = sample_row(torch.softmax(scaled, dim=-1), r.top_k, r.top_p, r.seed,
                                                          position, sorted_too=r.mask_mode is not None)
        elif r.top_k <= 0 and r.top_p >= 1.0 and r.mask_mode is None:
            # SGLang's sampling_from_probs_torch: the whole vocabulary unsorted, drawn as torch.multinomial draws
            # (rollout/categorical.py; a sort of Qwen3's vocabulary and multinomial's exponentials cost ~10 ms a row)
            tok = int(sample_categorical(logp.exp().view(1, -1), generator=gen))
            return tok, float(logp[tok])
        else:
            probs_sort, probs_idx = CPUModel.truncate(logp.exp(), r.top_k, r.top_p)
            pick = int(torch.multinomial(probs_sort, 1, generator=gen))
            tok = int(probs_idx[pick])
        if r.mask_mode is not None:
            CPUModel._keep_support(r, probs_sort, probs_idx, pick)
        return tok, float(logp[tok])

    @staticmethod
    def truncate(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights by decreasing probability, their token ids) of SGLang's torch sampler
        (srt/layers/sampler.py::top_k_top_p_min_p_sampling_from_probs_torch): sort once, zero ranks >= top_k
        and tokens whose preceding mass already exceeds top_p; the support is the ids of the non-zero weights.
        Top-p reads the whole distribution's mass, not the mass left after top-k (transformers' warpers, and
        so the in-process engine, renormalise after top-k and cut more)."""
        probs_sort, probs_idx = probs.sort(descending=True)
        probs_sum = probs_sort.cumsum(0)
        if top_k > 0:
            probs_sort[top_k:] = 0.0
        probs_sort[(probs_sum - probs_sort) > top_p] = 0.0
        return probs_sort, probs_idx

    @staticmethod
    def _keep_support(r: Req, probs_sort: torch.Tensor, probs_idx: torch.Tensor, pick: int) -> None:
        """sampler.py::_build_sampling_mask_output for the torch sampler: the kept tokens (weights > 0) by
        decreasing weight; the behaviour log-prob log(weight / mass kept) of the sampled one, or of each."""
        kept = int((probs_sort > 0).sum())  # sorted descending: the kept tokens lead
        mass = probs_sort[:kept].sum(dtype=torch.float32)
        r.masks.append(probs_idx[:kept].tolist())
        if r.mask_mode == "support":
            r.mask_logprobs.append(torch.log(probs_sort[:kept].float() / mass).tolist())
        else:
            r.mask_logprobs.append(float(torch.log(probs_sort[pick].float() / mass)))

    # --- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model (cast to its dtype); returns the bytes loaded."""
        if "weights" in self.released:
            raise ModelError("cannot load weights into released memory: resume_memory_occupation(['weights']) first")
        checked = []  # every tensor is checked before any is copied: a bad bucket changes nothing
        for item in named:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise ModelError(f"weight update: expected (name, tensor) pairs, got {type(item).__name__}")
            name, t = item
            target = self.targets.get(name)
            if target is None:
                if name == "lm_head.weight" and self.tied:
                    continue  # tied to the embedding (SGLang's Qwen3 loader skips it too)
                raise ModelError(f"weight update: the model has no parameter {name!r}")
            dst = target[1](self.params[target[0]].data)
            if tuple(dst.shape) != tuple(t.shape):
                raise ModelError(f"weight update: {name} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
            if t.is_complex() or t.device.type != "cpu":
                raise ModelError(f"weight update: {name} is a {t.dtype} tensor on {t.device}")
            checked.append((name, dst, t))
        nbytes = 0
        for name, dst, t in checked:
            dst.copy_(t)
            self.stale.discard(name)
            nbytes += t.numel() * t.element_size()
        return nbytes

    def release(self, tags: Optional[Sequence[str]]) -> None:
        tags = list(tags) if tags else list(MEMORY_TAGS)
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ModelError(f"unknown memory tags {sorted(unknown)}; SGLang knows {list(MEMORY_TAGS)}")
        if "weights" in tags and "weights" not in self.released and self.memory_saver:
            # Give the memory back for real; its contents are gone unless backed up (SGLang's
            # --enable-weights-cpu-backup), so the weights must be synced after resuming.
            for name, p in self.params.items():
                if self.cpu_backup:
                    self._backup[name] = p.detach().clone()
                p.data = torch.empty(0, dtype=p.dtype)
        self.released.update(tags)

    def resume(self, tags: Optional[Sequence[str]]) -> None:
        tags = list(tags) if tags else list(MEMORY_TAGS)
        not_released = [t for t in tags if t not in self.released]
        if not_released:  # SGLang: offload_tags.remove(tag) raises KeyError
            raise ModelError(f"memory {not_released} is not released (released: {sorted(self.released)})")
        if "weights" in tags and self.memory_saver:
            for name, p in self.params.items():
                p.data = self._backup.pop(name) if self.cpu_backup else torch.empty(self._shapes[name], dtype=p.dtype)
            if not self.cpu_backup:
                self.stale = set(self.targets)
        self.released.difference_update(tags)

    def info(self) -> dict[str, Any]:
        return {"parameters": sum(p.numel() for p in self.params.values()), "released": sorted(self.released),
                "stale": len(self.stale)}
