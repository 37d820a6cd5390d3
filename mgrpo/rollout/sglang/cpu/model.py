"""The model side of the CPU rollout server: batched sampling with per-token log-probs, weight
loading, memory release. No HTTP here (server.py); every call runs on the server's single
model thread, so generation and weight loads never interleave.

Generation is the decode loop and sampler the in-process engine runs too (rollout/decode.py,
rollout/sampler.py: SGLang's per-request semantics, seeded requests by SGLang's seeded sampler, log-probs of
the full tempered distribution, supports as SGLang's sampler captures them, grammars, stops, routed experts);
here: the requests checked, aborts, SGLang's input-token log-probs, and each unseeded request's own generator
drawn from the server's --random-seed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Optional, Sequence

import torch

from mgrpo.rollout.decode import Req, decode, finish_routes
from mgrpo.rollout.sglang.protocol.tables import MEMORY_TAGS


INPUT_LOGITS_BYTES = 256 << 20
"""Most fp32 logits one batch of input-token log-probs holds (rows x width x vocabulary x 4)."""


class ModelError(ValueError):
    """A request the model cannot serve in its current state (answered with 400)."""


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
        self.lora = None
        """The server's adapters (cpu/lora.py::LoraBank), set by the server."""

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
            with self._adapters(active):
                self._decode(active, started)
        if self.routes is not None:
            finish_routes(reqs, self.routes_shape)
        return list(reqs)

    def _adapters(self, rows: Sequence[Req]):
        return self.lora.batch([r.lora for r in rows]) if self.lora is not None else contextlib.nullcontext()

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
            with self._adapters(batch):
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
        # unseeded requests: a generator each, seeded from the server's (--random-seed)
        gens = [None if r.seed is not None
                else torch.Generator().manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.rng)))
                for r in reqs]

        def progress():
            self.last_progress = time.monotonic()

        decode(self.model, reqs, pad_id=self.pad_id, stop_ids=self.stop_ids, tokenizer=self.tokenizer,
               generators=gens, routes=self.routes, stopped=lambda r: self._abort_if(r, started, running=True),
               progress=progress)

    def use_tokenizer(self, tokenizer, stop_ids: set[int]) -> None:
        """The server's tokenizer (stop strings) and the ids it adds to the model's EOS (cpu/text.py)."""
        self.tokenizer = tokenizer
        self.stop_ids = self.eos_ids | set(stop_ids)

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
