"""The engine's side of `mgrpo-doctor layers`: one sequence through transformers, every layer hooked.

The model is built as the CPU server (`rollout/sglang/cpu/model.py`) and the in-process engine
(`rollout/hf_engine.py`) build it: `AutoModelForCausalLM.from_pretrained(dir, dtype=...)`, eval mode. The
log-probs are theirs too: the logits in float32, log_softmax(logits / T) (over the top-k / top-p support with
`Support('sampled', ...)`, as both engines' sampler cuts it: rollout/sampler.py), the sampled token's entry. One
difference is deliberate: the engines decode token by token with a KV cache, the doctor runs the whole
sequence in one forward (the same computation up to summation order; `--trajectory` shows the recorded
engine log-probs next to this recomputation, so a cache or batching effect shows as a gap between them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mgrpo.doctor import SUPPORTS, DoctorError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DoctorError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def sites(num_layers: int) -> list[str]:
    """The places compared, in the order the forward reaches them (both sides name them alike)."""
    names = ["embeddings"]
    for i in range(num_layers):
        names += [f"layer {i} attention", f"layer {i} mlp"]
    return names + ["final norm", "logits", "log-probs"]


@dataclass(frozen=True)
class Support:
    """How a response token's log-prob is normalised: over the whole tempered distribution (`full`, what
    every engine reports by default) or over the token's sampling support under top-k / top-p (`sampled`:
    the engine's log-prob with SGLang's return_sampling_mask, the trainer's with
    algorithm.logprob_support=sampled). One side `full` and the other `sampled` is the support mismatch:
    every layer agrees, the log-probs part."""

    name: str = "full"
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self):
        if self.name not in SUPPORTS:
            raise DoctorError(f"support {self.name!r} is not one of {list(SUPPORTS)}")
        if self.name == "sampled" and not (self.top_k > 0 or 0 < self.top_p < 1):
            raise DoctorError("support 'sampled' needs --top-k K (K >= 1) or --top-p P (0 < P < 1): the rollout's "
                              "rollout.top_k / rollout.top_p")
        if not 0 < self.top_p <= 1:
            raise DoctorError(f"--top-p {self.top_p} must be in (0, 1]")

    def __str__(self) -> str:
        return "full" if self.name == "full" else f"sampled (top_k={self.top_k}, top_p={self.top_p:g})"

    def kept(self, logits: torch.Tensor, temperature: float) -> Optional[torch.Tensor]:
        """[positions, vocab] bool: each position's support as the CPU engines' sampler cuts it (SGLang's torch
        sampler, rollout/sampler.py::truncate, over softmax(logits / T)); None for the whole vocabulary."""
        if self.name == "full":
            return None
        from mgrpo.rollout.sampler import truncate

        probs = torch.softmax(logits.float() / (1.0 if temperature == 0 else temperature), dim=-1)
        kept = torch.zeros(probs.shape, dtype=torch.bool)
        for i, row in enumerate(probs):
            weights, ids = truncate(row, self.top_k, self.top_p)
            kept[i, ids[weights > 0]] = True
        return kept

    def csr(self, logits: torch.Tensor, temperature: float) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The supports in the kernels' CSR form (`support_offsets`, `support_ids`), or (None, None)."""
        kept = self.kept(logits, temperature)
        if kept is None:
            return None, None
        offsets = torch.zeros(kept.shape[0] + 1, dtype=torch.long)
        offsets[1:] = kept.sum(-1).cumsum(0)
        return offsets, kept.nonzero()[:, 1]



def support_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                     support: Support = Support()) -> torch.Tensor:
    """Log-prob of each token under the tempered distribution, renormalised over its support (the engine's side,
    as the in-process engine reports it)."""
    t = 1.0 if temperature == 0 else temperature
    scores = logits.float() / t
    kept = support.kept(logits, temperature)
    if kept is not None:
        scores = scores.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def engine_trace(hf_dir: str, ids: list[int], prompt_len: int, *, dtype: str = "float32", temperature: float = 1.0,
                 support: Support = Support(), vocab_size: Optional[int] = None) -> "OrderedDict[str, np.ndarray]":
    """{site: float64 array} for `ids` (prompt then response) through the engine's model: hidden sites as
    [positions, hidden], logits as [positions, vocab], log-probs of the response tokens as [response tokens]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype(dtype)).eval()
    core = model.model
    captured: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name):
        def hook(_module, _inputs, out):
            captured[name] = _first(out).detach()[0].clone()  # batch of one: [positions, features]
        return hook

    modules = [("embeddings", core.embed_tokens)]
    for i, layer in enumerate(core.layers):
        modules += [(f"layer {i} attention", layer.self_attn), (f"layer {i} mlp", layer.mlp)]
    modules += [("final norm", core.norm), ("logits", model.lm_head)]
    for name, module in modules:
        hooks.append(module.register_forward_hook(keep(name)))
    x = torch.tensor([ids], dtype=torch.long)
    try:
        with torch.no_grad():
            logits = model(input_ids=x, position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    vocab = vocab_size or model.config.vocab_size
    captured["logits"] = captured["logits"][:, :vocab]
    response = torch.tensor(ids[prompt_len:], dtype=torch.long)
    lp = support_logprobs(logits[prompt_len - 1:len(ids) - 1, :vocab], response, temperature, support)
    out = OrderedDict((name, captured[name].double().numpy()) for name, _ in modules)
    out["log-probs"] = lp.double().numpy()
    return out
