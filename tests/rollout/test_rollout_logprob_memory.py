"""The CPU rollout engines' log-prob path at a large vocabulary: the in-process transformers engine returns the
log-probs one full transformers forward gives, while holding at most one decode step of [rows x vocab] logits;
the CPU server's prefill keeps only the last position's logits. Memory is the peak extra resident memory of one
generate call in a fresh process whose allocator returns freed tensors at once (MALLOC_MMAP_THRESHOLD_), so it
follows the live tensors; keeping every step's logits (what `output_logits=True` did) or the prefill's logits at
every prompt position would cost several times the bounds asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mgrpo.config.schema import ModelConfig
from mgrpo.models.hf_io import init_hf_checkpoint
from mgrpo.rollout.hf_engine import HFRolloutEngine
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers import ROOT
from tests.helpers.sglang_cpu import VOCAB, Reference, tiny_checkpoint

REPO = str(ROOT)
BIG_VOCAB = 32768
ROWS, NEW_TOKENS, PROMPT_LEN = 16, 48, 200


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    cfg = ModelConfig(vocab_size=BIG_VOCAB, hidden_size=32, num_layers=1, num_attention_heads=2, num_query_groups=1,
                      head_dim=16, ffn_hidden_size=64, max_position_embeddings=512)
    return init_hf_checkpoint(str(tmp_path_factory.mktemp("bigvocab")), cfg, seed=2)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_new_tokens=6),
                                      SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=7, seed=3),
                                      SamplingParams(temperature=1.3, max_new_tokens=5, seed=4)],
                         ids=["greedy", "t0.7-topp-topk", "t1.3"])
def test_hf_engine_logprobs_match_a_transformers_forward(tiny, sampling):
    engine = HFRolloutEngine(tiny, eos_token_ids=[VOCAB + 1], pad_token_id=0)  # no EOS: every row runs to the end
    ref = Reference(tiny)
    reqs = [GenerateRequest(uid=i, prompt_ids=[1, (3 + i) % VOCAB, 5, 7][: 2 + i % 3]) for i in range(6)]
    out = engine.generate(reqs, sampling)
    for req, res in zip(reqs, out):
        assert len(res.token_ids) == len(res.logprobs) == sampling.max_new_tokens
        assert ref.max_diff(req.prompt_ids, res, sampling.temperature) < 1e-5
        if sampling.greedy:
            assert res.token_ids == ref.logprobs(req.prompt_ids, res.token_ids, 1.0).argmax(-1).tolist()


def test_hf_engine_logprobs_of_rows_that_stop_early(tiny):
    """Rows ending on EOS at different steps keep exactly their own tokens' log-probs."""
    engine = HFRolloutEngine(tiny, eos_token_ids=[3], pad_token_id=0)
    ref = Reference(tiny)
    reqs = [GenerateRequest(uid=i, prompt_ids=[1, 2 + i % 5]) for i in range(16)]
    out = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=12, seed=5))
    assert len({len(r.token_ids) for r in out}) > 1 and any(r.finish_reason == "stop" for r in out)
    for req, res in zip(reqs, out):
        assert ref.max_diff(req.prompt_ids, res, 1.0) < 1e-5


PROBE = r"""
import json, sys, torch
from benchmarks.peers.kernel_bench import PeakMemory  # the kernel benchmark's probe (VmHWM reset); cwd: the repo
kind, ckpt, rows, new, plen, vocab = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, vocab, (plen - i % 4,), generator=g).tolist() for i in range(rows)]
if kind == "hf":
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.types import GenerateRequest, SamplingParams
    eng = HFRolloutEngine(ckpt, eos_token_ids=[vocab + 1], pad_token_id=0)
    call = lambda n, t: eng.generate([GenerateRequest(uid=i, prompt_ids=p) for i, p in enumerate(prompts[:n])],
                                     SamplingParams(temperature=1.0, max_new_tokens=t, seed=1))
else:
    from mgrpo.rollout.sglang.cpu.model import CPUModel, Req
    eng = CPUModel(ckpt)
    call = lambda n, t: eng.generate([Req(rid=str(i), input_ids=p, max_new_tokens=t, seed=i, ignore_eos=True)
                                      for i, p in enumerate(prompts[:n])])
call(2, 2)
with PeakMemory(torch.device("cpu")) as mem:
    call(rows, new)
print(json.dumps({"peak": mem.peak}))
"""


def peak_extra_bytes(kind: str, ckpt: str, rows: int, new_tokens: int) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", PROBE, kind, ckpt, str(rows), str(new_tokens), str(PROMPT_LEN),
                        str(BIG_VOCAB)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.integration
def test_hf_engine_holds_one_decode_step_of_logits(big_vocab):
    all_steps = ROWS * NEW_TOKENS * BIG_VOCAB * 4  # every step's logits, fp32: 100 MB
    one_step = ROWS * BIG_VOCAB * 4  # 2 MB
    peak = peak_extra_bytes("hf", big_vocab, ROWS, NEW_TOKENS)
    assert peak < all_steps / 4, (peak, all_steps)
    # ... and it does not grow with the response length
    longer = peak_extra_bytes("hf", big_vocab, ROWS, 2 * NEW_TOKENS)
    assert longer < peak + 4 * one_step, (peak, longer)


@pytest.mark.integration
def test_cpu_server_prefill_keeps_only_the_last_positions_logits(big_vocab):
    every_position = ROWS * PROMPT_LEN * BIG_VOCAB * 4  # 420 MB
    peak = peak_extra_bytes("sglang", big_vocab, ROWS, 4)
    assert peak < every_position / 8, (peak, every_position)
