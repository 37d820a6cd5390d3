"""The engine's side of `mgrpo-doctor layers`: one sequence through transformers, every layer hooked.

The model is built as the CPU server (`rollout/sglang/cpu_model.py`) and the in-process engine
(`rollout/hf_engine.py`) build it: `AutoModelForCausalLM.from_pretrained(dir, dtype=...)`, eval mode. The
log-probs are theirs too: the logits in float32, log_softmax(logits / T), the sampled token's entry. One
difference is deliberate: the engines decode token by token with a KV cache, the doctor runs the whole
sequence in one forward (the same computation up to summation order; `--trajectory` shows the recorded
engine log-probs next to this recomputation, so a cache or batching effect shows as a gap between them).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import numpy as np
import torch

from mgrpo.doctor import DoctorError

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


def full_support_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-prob of each token under the whole tempered distribution (what every engine reports today and the
    trainer recomputes). A top-k/top-p renormalised support (algorithm.logprob_support, not merged yet) adds an
    entry to LOGPROB_SUPPORTS and the doctor compares whichever the run used."""
    t = 1.0 if temperature == 0 else temperature
    return torch.log_softmax(logits.float() / t, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


LOGPROB_SUPPORTS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "full": full_support_logprobs,
}
"""How a log-prob is normalised, by name (`mgrpo-doctor layers --support`): the seam for sampling-support
mismatches under top-k/top-p."""


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def engine_trace(hf_dir: str, ids: list[int], prompt_len: int, *, dtype: str = "float32", temperature: float = 1.0,
                 support: str = "full", vocab_size: Optional[int] = None) -> "OrderedDict[str, np.ndarray]":
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
    lp = LOGPROB_SUPPORTS[support](logits[prompt_len - 1:len(ids) - 1, :vocab], response, temperature)
    out = OrderedDict((name, captured[name].double().numpy()) for name, _ in modules)
    out["log-probs"] = lp.double().numpy()
    return out
