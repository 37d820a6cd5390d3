"""Validation metrics per data source (veRL's names): val/<data_source>/score, mean@n, pass@n."""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Optional, Sequence

SOLVED = 1.0 - 1e-6  # a sample "passes" when it scored 1 (the full reward)


def eval_metrics(scores: Sequence[Optional[float]], group_index: Sequence[Hashable], data_sources: Sequence[str],
                 n: int) -> dict[str, float]:
    """Per data source:
      val/<src>/score   mean over all samples
      val/<src>/mean@n  mean over prompts of the prompt's mean score (equals score when every prompt
                        has n samples; differs if some prompts lost samples)
      val/<src>/pass@n  fraction of prompts with at least one sample scored 1
      val/<src>/failed  samples without a score (their judge failed; left out of the three above), when any
    `group_index` groups the samples of one prompt; `n` is only the label (samples per prompt).
    """
    if not len(scores) == len(group_index) == len(data_sources):
        raise ValueError(f"scores, group_index and data_sources differ in length: "
                         f"{len(scores)}, {len(group_index)}, {len(data_sources)}")
    groups: dict[str, dict[Hashable, list[float]]] = defaultdict(lambda: defaultdict(list))
    failed: dict[str, int] = defaultdict(int)
    for s, g, src in zip(scores, group_index, data_sources):
        if s is None:
            failed[src] += 1
        else:
            groups[src][g].append(float(s))
    out: dict[str, float] = {f"val/{src}/failed": float(k) for src, k in failed.items()}
    for src, by_prompt in sorted(groups.items()):
        samples = [s for ss in by_prompt.values() for s in ss]
        out[f"val/{src}/score"] = sum(samples) / len(samples)
        out[f"val/{src}/mean@{n}"] = sum(sum(ss) / len(ss) for ss in by_prompt.values()) / len(by_prompt)
        out[f"val/{src}/pass@{n}"] = sum(any(s >= SOLVED for s in ss) for ss in by_prompt.values()) / len(by_prompt)
    return out
