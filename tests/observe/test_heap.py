"""The Megatron rank's heap measures (mgrpo/heap.py) do what they are there for, in a process of their own.

The child allocates what a decode loop allocates: a 19 MB `[32 x vocab]` logits block each step, a slightly bigger
one after it (a growing KV cache), and small blocks that stay alive in between. Under glibc's adaptive mmap
threshold the big blocks are carved from the heap once the first is freed, and the small survivors pin it: the
process keeps ~1 GB it no longer uses, with one arena as without. Trimmed every DECODE_TRIM_EVERY steps, as the
CPU engines' decode loop is (rollout/decode.py), it keeps at most those steps' holes.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from mgrpo import heap
from mgrpo.heap import DECODE_TRIM_EVERY, arena_env, trim_heap

CHILD = r"""
import sys, torch
from mgrpo.heap import trim_heap
every = int(sys.argv[1])
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))
keep, base, top = [], rss(), 0
for step in range(1, 129):
    big = torch.ones(32, 151936)
    keep.append(torch.ones(256))
    bigger = torch.ones(32, 151936 + step)
    del big
    keep.append(torch.ones(256))
    del bigger
    if every and step % every == 0:
        trim_heap()
    top = max(top, rss() - base)
print(top)
"""

pytestmark = pytest.mark.skipif(not trim_heap(), reason="glibc only (malloc_trim, MALLOC_* variables)")


def peak_held_mib(env: dict, trim_every: int) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(trim_every)], env={**clean, **env}, capture_output=True,
                         text=True, check=True, timeout=180)
    return int(out.stdout.strip())


@pytest.mark.integration
def test_decode_loop_trims_bound_what_the_heap_holds():
    untrimmed = peak_held_mib(arena_env(), 0)
    trimmed = peak_held_mib(arena_env(), DECODE_TRIM_EVERY)
    # 128 steps x 2 blocks of 19 MB: untrimmed the heap keeps most of them (measured ~2.2 GiB); trimmed every 16
    # steps it peaks at about 16 steps' worth (2 x 16 x 19 MB = 0.6 GB at most)
    assert untrimmed > 1500, untrimmed
    assert trimmed < 700 and trimmed < untrimmed / 2.5, (trimmed, untrimmed)


def test_decode_loop_trims_every_n_steps(monkeypatch):
    """The CPU engines' decode loop (rollout/decode.py) trims the heap every DECODE_TRIM_EVERY steps; a scripted
    model stands in for the forward."""
    from types import SimpleNamespace

    from mgrpo.rollout import decode

    calls = []
    monkeypatch.setattr(decode, "trim_heap", lambda: calls.append(1))

    def model(input_ids, **kw):
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], 1, 5), past_key_values=None)

    steps = 2 * DECODE_TRIM_EVERY + 3
    reqs = [decode.Req(rid="0", input_ids=[1, 2], temperature=0.0, max_new_tokens=steps)]
    decode.decode(model, reqs, pad_id=0, stop_ids=set())
    assert len(reqs[0].out) == steps and len(calls) == 2


def test_user_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert arena_env() == {"MALLOC_ARENA_MAX": "4"}


def test_call_trim_runs_once_the_process_grew_by_its_threshold(monkeypatch):
    """trim_after_call trims on its first call, then only once resident memory grew by min_growth since that trim:
    a call that freed little (the tiny job's) costs no trim, one that holds ~64 MiB more does."""
    monkeypatch.setattr(heap, "_resident_after_trim", [None])
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1) or True)
    assert heap.trim_after_call(min_growth=32 << 20) is True
    small = torch.ones(1 << 18)  # 1 MiB more
    assert heap.trim_after_call(min_growth=32 << 20) is False
    # 64 MiB more, touched: resident. A mapping of its own, not a tensor from malloc, which under xdist may reuse
    # pages an earlier test freed and left resident (trim_heap is stubbed here): then nothing grows
    big = mmap.mmap(-1, 64 << 20)
    big.write(b"\1" * (64 << 20))
    assert heap.trim_after_call(min_growth=32 << 20) is True
    assert heap.trim_after_call(min_growth=32 << 20) is False  # measured again after that trim
    assert len(trims) == 2 and small.sum() > 0 and big[-1] == 1
    big.close()


def test_trim_before_an_embeddings_backward_runs_once_between_the_layers_and_it(monkeypatch):
    """trim_before_backward_of: the trim runs when the backward reaches the embedding's output (the layers'
    backward done, the embedding's own not yet: its weight has no gradient at that moment), once per backward,
    and not at all for a forward without grad."""
    emb, layer = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)
    seen = []
    monkeypatch.setattr(heap, "trim_after_call", lambda: seen.append((layer.weight.grad is not None,
                                                                      emb.weight.grad is not None)) or True)
    heap.trim_before_backward_of(emb)
    ids = torch.tensor([1, 2, 3])
    with torch.no_grad():
        layer(emb(ids))
    assert seen == []
    layer(emb(ids)).sum().backward()
    assert seen == [(True, False)] and emb.weight.grad is not None
