"""Fused chunked GRPO log-prob / entropy / KL / loss kernels (import name: mgrpo_kernels).

Three implementations behind one interface (dispatch.py), picked by `impl` (config: actor.logprob_impl):
  "chunked"  torch, never more than one chunk of logits (reference.py's fast twin; CPU default)
  "fused"    Triton kernels, logits only as register tiles (GPU; CPU under TRITON_INTERPRET=1)
  "naive"    reference.py, full [T, V] logits (the oracle; small vocabularies only)

This folder is installed as mgrpo_kernels so that it does not shadow PyPI's `kernels`, which transformers
(>= 5.25) imports with every model. A process whose sys.path starts at the repository root (`python -m ...` or
`python -c` run in a checkout) still finds this folder first by its short name; imported as `kernels`, it hands
that name to the installed package (_pypi.py) instead of breaking transformers.

  dispatch.py      the one interface (`linear_logprobs`, `fused_linear_loss`, `capabilities`), picked by impl
  chunked.py       "chunked": log-prob / entropy / token loss one chunk of logits at a time, in torch
  triton_kernel.py "fused": the Triton kernels, imported after a capability check
  reference.py     "naive": the full-logits oracle the fast paths are tested against
  support.py       per-token sampling supports: validation, and which columns a chunk needs
  topk.py          top-k log-probs per token (a distillation teacher's) and log-probs of given ids (the student's)
  _pypi.py         PyPI's `kernels` loaded in this folder's place when imported by the short name
"""

if __name__ == "kernels":
    from ._pypi import hand_over

    hand_over()
else:
    from .chunked import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK, num_valid_rows
    from .dispatch import IMPLS, capabilities, fused_linear_loss, linear_logprobs
    from .reference import full_linear_loss, full_logprobs
    from .topk import linear_ids_logprobs, linear_topk

    __all__ = ["IMPLS", "capabilities", "linear_logprobs", "fused_linear_loss", "num_valid_rows", "full_logprobs",
               "full_linear_loss", "DEFAULT_CHUNK_SIZE", "DEFAULT_VOCAB_CHUNK", "linear_topk", "linear_ids_logprobs"]
