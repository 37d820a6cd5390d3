"""The Megatron rank's heap settings (mgrpo/cluster/heap.py) do what they are there for, in a process of their own.

The child allocates what a decode loop allocates: a 19 MB `[32 x vocab]` logits block each step, a slightly bigger
one after it (a growing KV cache), and small blocks that stay alive in between. Under glibc's adaptive mmap
threshold the big blocks are carved from the heap once the first is freed, and the small survivors pin it: the
process keeps ~1 GB it no longer uses. Under the rank's environment (`arena_env()`) it keeps almost nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mgrpo.cluster.heap import arena_env, trim_heap

CHILD = r"""
import torch
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))
keep, base = [], rss()
for step in range(64):
    big = torch.ones(32, 151936)
    keep.append(torch.ones(256))
    bigger = torch.ones(32, 151936 + step)
    del big
    keep.append(torch.ones(256))
    del bigger
print(rss() - base)
"""

pytestmark = pytest.mark.skipif(not trim_heap(), reason="glibc only (malloc_trim, MALLOC_* variables)")


def held_mib(env: dict) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.strip())


def test_rank_environment_returns_freed_logits_blocks_glibc_default_keeps_them():
    default = held_mib({})
    arena_only = held_mib({"MALLOC_ARENA_MAX": "1"})
    rank = held_mib(arena_env())
    # 64 steps x 2 blocks of 19 MB: the default keeps most of them (measured 1,115 MiB), one arena alone too
    assert default > 500 and arena_only > 500, (default, arena_only)
    assert rank < 50, rank  # measured 2 MiB


def test_user_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    env = arena_env()
    assert env == {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
