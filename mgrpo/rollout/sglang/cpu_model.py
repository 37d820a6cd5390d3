"""The model side of the CPU rollout server: batched sampling with per-token log-probs, weight
loading, memory release. No HTTP here (cpu_server.py); every call runs on the server's single
model thread, so generation and weight loads never interleave.

Sampling follows SGLang's per-request semantics: each request has its own sampling params and, when
`sampling_seed` is given, its own random stream (so a request's tokens do not depend on what else
is in the batch). Log-probs are those of the full tempered distribution, log_softmax(logits / T),
before top-p/top-k truncation (T=0: greedy, log-probs at T=1), as `hf_engine.py` and the trainer
compute them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from mgrpo.rollout.sglang.schema import MEMORY_TAGS


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
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Optional[dict] = None


class ModelError(ValueError):
    """A request the model cannot serve in its current state (answered with 400)."""


class CPUModel:
    def __init__(self, model_path: str, *, dtype: str = "auto", seed: int = 0, enable_memory_saver: bool = False,
                 enable_weights_cpu_backup: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch_dtype = torch.float32 if dtype in ("auto", "float32", "float") else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
        cfg = AutoConfig.from_pretrained(model_path)
        eos = getattr(self.model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.pad_id = getattr(cfg, "pad_token_id", None) or 0
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.params = dict(self.model.named_parameters())  # tied: lm_head shares embed_tokens' Parameter
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
        active = [r for r in reqs if not self._abort_if(r, started, "Abort before prefill")]
        if active:
            self._decode(active, started)
        return list(reqs)

    def _abort_if(self, r: Req, started: float, message: str) -> bool:
        if r.finish is None and self._is_aborted(r, started):
            r.finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
            return True
        return False

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
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        last_pos = positions[:, -1]
        for step in range(max(r.max_new_tokens for r in reqs)):
            nxt = torch.full((n,), self.pad_id, dtype=torch.long)
            for i, r in enumerate(reqs):
                if r.finish is not None or self._abort_if(r, started, "Aborted by AbortReq"):
                    continue
                tok, lp = self._sample(logits[i], r, gens[i])
                r.out.append(tok)
                r.logprobs.append(lp)
                nxt[i] = tok
                if not r.ignore_eos and (tok in r.stop_token_ids or tok in self.eos_ids):
                    r.finish = {"type": "stop", "matched": tok}
                elif len(r.out) >= r.max_new_tokens:
                    r.finish = {"type": "length", "length": r.max_new_tokens}
            self.last_progress = time.monotonic()
            if all(r.finish is not None for r in reqs):
                return
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :].float()

    @staticmethod
    def _sample(logits: torch.Tensor, r: Req, gen: torch.Generator) -> tuple[int, float]:
        greedy = r.temperature == 0.0 or r.top_k == 1
        scaled = logits / (1.0 if r.temperature == 0.0 else r.temperature)
        logp = torch.log_softmax(scaled, dim=-1)
        if greedy:
            tok = int(torch.argmax(logits))
            return tok, float(logp[tok])
        # SGLang's torch sampler (srt/layers/sampler.py::top_k_top_p_min_p_sampling_from_probs_torch):
        # sort once, zero ranks >= top_k and tokens whose preceding mass already exceeds top_p.
        probs_sort, probs_idx = logp.exp().sort(descending=True)
        probs_sum = probs_sort.cumsum(0)
        if r.top_k > 0:
            probs_sort[r.top_k:] = 0.0
        probs_sort[(probs_sum - probs_sort) > r.top_p] = 0.0
        tok = int(probs_idx[torch.multinomial(probs_sort, 1, generator=gen)])
        return tok, float(logp[tok])

    # --- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model (cast to its dtype); returns the bytes loaded."""
        if "weights" in self.released:
            raise ModelError("cannot load weights into released memory: resume_memory_occupation(['weights']) first")
        nbytes = 0
        for name, t in named:
            p = self.params.get(name)
            if p is None:
                if name == "lm_head.weight" and self.tied:
                    continue  # tied to the embedding (SGLang's Qwen3 loader skips it too)
                raise ModelError(f"weight update: the model has no parameter {name!r}")
            if tuple(p.shape) != tuple(t.shape):
                raise ModelError(f"weight update: {name} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(p.shape)}")
            p.copy_(t)
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
                self.stale = set(self.params)
        self.released.difference_update(tags)

    def info(self) -> dict[str, Any]:
        return {"parameters": sum(p.numel() for p in self.params.values()), "released": sorted(self.released),
                "stale": len(self.stale)}
