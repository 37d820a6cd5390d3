"""Trajectories as JSONL, one line per sampled response: what the model saw, said, earned and learned
from. Appended, so a resumed run adds to the same file."""

from __future__ import annotations

import json
import os


class TrajectoryWriter:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a", buffering=1 << 16)

    def write(self, step: int, rows: list[dict]) -> None:
        for row in rows:
            self._f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()
