"""In-process rollout engine on Hugging Face transformers (the CPU backend; see docs/architecture.md).

It implements the same interface as the SGLang client (`RolloutEngine`): generate with per-token
log-probs (and, when asked, each token's sampling support under top-k / top-p), receive HF-named
weight buckets from the trainer, report health. It is what the default CPU job and the tests use; on
GPUs SGLang takes its place. Generation is the decode loop and sampler the CPU SGLang-protocol server runs
too (rollout/decode.py, rollout/sampler.py: SGLang's sampler, stops in SGLang's order, grammars with
xgrammar as SGLang's grammar backend compiles them, mgrpo/rollout/grammar.py). Here: chunks of similar
prompt lengths, the call's seed, and SGLang's results turned into `GenerateResult`s. A request with its own
seed (`GenerateRequest.seed`) is drawn by SGLang's seeded sampler, independent of its batch, and then every
row of its chunk is (the others with a seed drawn from the call's generator); otherwise the chunk's rows draw
from torch's default generator, which SamplingParams.seed seeds.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from mgrpo.models.registry import hf_named_tensors
from mgrpo.rollout.route_capture import check_routes_from
from mgrpo.rollout.types import EngineDefaults, EngineHealth, GenerateRequest, GenerateResult, SamplingParams


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
        from mgrpo.rollout.decode import Req, decode, finish_routes
        from mgrpo.rollout.stops import StopStrings

        stops = StopStrings()
        if sampling.stop or sampling.stop_regex:  # SGLang's normalize: refused (StopError) before generating
            stops = StopStrings.normalize(list(sampling.stop), self._tok(), list(sampling.stop_regex) or None)
        grammar = self._grammar(sampling.structural_tag) if sampling.structural_tag else None
        if sampling.return_routed_experts and self.routes is None:
            raise ValueError("return_routed_experts was asked, but the engine was built without "
                             "return_routed_experts=True (a mixture-of-experts model's routes are captured then)")
        if sampling.return_routed_experts:
            for r in chunk:
                check_routes_from(r.routes_from, len(r.prompt_ids))
        seeds = [r.seed for r in chunk]
        if not sampling.greedy and any(s is not None for s in seeds):
            # rows without a seed of their own draw one from the call's generator (seeded by SamplingParams.seed)
            seeds = [s if s is not None else int(torch.randint(2 ** 62, (1,))) for s in seeds]
        # supports where the sampler cuts (greedy: no sampling distribution, every token 'whole vocabulary')
        masks = sampling.return_support and not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1.0)
        reqs = [Req(rid=str(r.uid), input_ids=list(r.prompt_ids), temperature=sampling.temperature,
                    top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens, seed=seed,
                    mask_mode="selected" if masks else None, stops=stops, grammar=grammar,
                    routes_from=r.routes_from if sampling.return_routed_experts else None)
                for r, seed in zip(chunk, seeds)]
        routes = self.routes if sampling.return_routed_experts else None
        decode(self.model, reqs, pad_id=self.pad_token_id, stop_ids=set(self.eos_token_ids),
               tokenizer=self._tok() if sampling.stop or sampling.stop_regex else None, routes=routes)
        if routes is not None:
            finish_routes(reqs, routes.shape)
        vocab = self.model.get_input_embeddings().weight.shape[0]
        results = []
        for g, r in zip(chunk, reqs):
            if r.finish is not None and r.finish["type"] == "abort":  # SGLang answers 400 with its message
                raise ValueError(r.finish["message"])
            support = None
            if sampling.return_support:  # ascending ids; None where nothing was cut
                support = [sorted(m) if len(m) < vocab else None for m in r.masks] if masks else [None] * len(r.out)
            results.append(GenerateResult(uid=g.uid, token_ids=r.out, logprobs=r.mask_logprobs if masks else r.logprobs,
                                          finish_reason=r.finish["type"] if r.finish else "length",
                                          weight_version=self.weight_version, support=support))
            if routes is not None:
                results[-1].routed_experts = r.routes.numpy()
        return results

    def _tok(self):
        """The run's tokenizer: for grammars and stop strings only (the engine otherwise works on ids)."""
        if not isinstance(self._tokenizer, (str, type(None))):
            return self._tokenizer
        from mgrpo.rollout.grammar import load_engine_tokenizer

        self._tokenizer = load_engine_tokenizer(self._tokenizer)
        return self._tokenizer

    def _grammar(self, structural_tag: str):
        """One structural tag compiled (GrammarError as SGLang refuses it)."""
        from mgrpo.rollout.grammar import Grammars

        if self._grammars is None:
            vocab = self.model.get_input_embeddings().weight.shape[0]
            self._grammars = Grammars(self._tok(), vocab, self.eos_token_ids)
        return self._grammars.compile_structural_tag(structural_tag)

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

