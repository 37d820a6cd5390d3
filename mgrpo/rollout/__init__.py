"""Rollout engines: what generates the samples, and how new weights reach it.

  types.py          what goes into and comes out of an engine (`RolloutEngine`, requests, results, health)
  factory.py        the engines by name: how each is built from the config and fed new weights
  hf_engine.py      the in-process engine on transformers (CPU backend; hybrid mode)
  decode.py         the CPU engines' one decode loop: prefill, KV-cached steps, grammars, stops, per-row finish
  sampler.py        the CPU engines' one sampler: SGLang's temperature / top-k / top-p per row, seeds, supports
  route_capture.py  the experts each token was routed to, captured from a transformers MoE model's routers
  categorical.py    one token per row drawn from a distribution on CPU, fast at Qwen3's vocabulary
  seeded.py         SGLang's per-request seeded sampler (sampling_seed) for the CPU engines
  stops.py          when a response ends (stop strings, stop tokens), as SGLang decides it
  grammar.py        grammar-constrained decoding (structural_tag, json_schema, regex, ebnf) with xgrammar
  sglang/           our client for SGLang's HTTP server, its CPU stand-in (sglang/cpu/) and SGLang's
                    protocol that both speak (sglang/protocol/); sglang/__init__.py lists the files
"""
