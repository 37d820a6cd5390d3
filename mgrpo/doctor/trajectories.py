"""A run's trajectory lines with token log-probs (what `trainer.log_token_logprobs` writes), read and checked.

Each line of `trajectories.jsonl` is one sampled response; with token log-probs it also holds `prompt_ids`,
`response_ids`, `rollout_logprobs` (the engine's, one per response token) and `trainer_logprobs` (the trainer's
recomputation of the same tokens with the same weights), and `engine` (an index, or 'router'). Lines without
token fields (a run with the option off, or steps before it was turned on) are counted, not read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

from mgrpo.doctor import DoctorError

TRAJECTORIES = "trajectories.jsonl"
TOKEN_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs", "trainer_logprobs")


@dataclass
class TokenLine:
    line: int
    """1-based line number in trajectories.jsonl (what `mgrpo-doctor layers --line` takes)."""
    step: int
    engine: object
    weight_version: Optional[int]
    prompt_ids: list[int]
    response_ids: list[int]
    rollout: list[float]
    trainer: list[float]
    response: str = ""
    sampled: Optional[list[int]] = None
    """Multi-turn runs (the line's `sampled_mask`): 1 where the policy sampled the token, 0 for context (tool
    replies, template tokens), which has no engine log-prob; None: every token sampled."""
    turn: Optional[list[int]] = None
    """Multi-turn runs (the spans of the line's `multi_turn.turns`): per response token, the number of the
    assistant turn that sampled it (1, 2, ...), 0 for context; None: a single-turn line."""

    @property
    def diffs(self) -> list[float]:
        """|rollout - trainer| per response token (NaN where the engine returned no log-prob, and on
        multi-turn context tokens, which it never sampled)."""
        mask = self.sampled or [1] * len(self.rollout)
        return [abs(a - b) if m else float("nan") for a, b, m in zip(self.rollout, self.trainer, mask)]

    @property
    def context_tokens(self) -> int:
        return 0 if self.sampled is None else len(self.sampled) - sum(1 for m in self.sampled if m)


def trajectories_path(run_dir: str) -> str:
    if not os.path.isdir(run_dir):
        raise DoctorError(f"run folder {run_dir} does not exist")
    path = os.path.join(run_dir, TRAJECTORIES)
    if not os.path.isfile(path):
        raise DoctorError(f"{run_dir} has no {TRAJECTORIES} (a run with trainer.log_trajectories=false, or not an "
                          "mgrpo run folder)")
    return path


def _number(value, where: str, name: str) -> float:
    if value is None:
        return float("nan")  # SGLang reports None for a log-prob it could not compute: kept, and counted
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DoctorError(f"{where}: {name} holds {value!r}, not a number")
    return float(value)


def parse_line(raw: str, line: int, path: str) -> Optional[TokenLine]:
    """One trajectory line -> TokenLine, or None when it has no token fields; DoctorError naming file:line and
    field when it is broken."""
    where = f"{path}:{line}"
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DoctorError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DoctorError(f"{where}: a trajectory line is a JSON object, got {type(row).__name__}")
    present = [f for f in TOKEN_FIELDS if row.get(f) is not None]
    if not present:
        return None
    missing = [f for f in TOKEN_FIELDS if row.get(f) is None]
    if missing:
        raise DoctorError(f"{where}: has {', '.join(present)} but not {', '.join(missing)}")
    for f in TOKEN_FIELDS:
        if not isinstance(row[f], list):
            raise DoctorError(f"{where}: {f} is {type(row[f]).__name__}, not a list")
    n = len(row["response_ids"])
    for f in ("rollout_logprobs", "trainer_logprobs"):
        if len(row[f]) != n:
            raise DoctorError(f"{where}: {f} has {len(row[f])} values for {n} response_ids")
    for f in ("prompt_ids", "response_ids"):
        if any(isinstance(t, bool) or not isinstance(t, int) for t in row[f]):
            raise DoctorError(f"{where}: {f} holds a value that is not a token id")
    if not isinstance(row.get("step"), int):
        raise DoctorError(f"{where}: step is {row.get('step')!r}, not an integer")
    return TokenLine(line=line, step=row["step"], engine=row.get("engine"), weight_version=row.get("weight_version"),
                     prompt_ids=row["prompt_ids"], response_ids=row["response_ids"],
                     rollout=[_number(v, where, "rollout_logprobs") for v in row["rollout_logprobs"]],
                     trainer=[_number(v, where, "trainer_logprobs") for v in row["trainer_logprobs"]],
                     response=str(row.get("response", "")), sampled=_mask(row.get("sampled_mask"), n, where),
                     turn=_turns(row.get("multi_turn"), n, where))


def _mask(value, n: int, where: str) -> Optional[list[int]]:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n or any(v not in (0, 1) for v in value):
        raise DoctorError(f"{where}: sampled_mask must be {n} values of 0 or 1, one per response token")
    return [int(v) for v in value]


def _turns(value, n: int, where: str) -> Optional[list[int]]:
    """Assistant turn number per response token from the line's `multi_turn.turns` spans."""
    if value is None:
        return None
    turns = value.get("turns") if isinstance(value, dict) else None
    if not isinstance(turns, list):
        raise DoctorError(f"{where}: multi_turn.turns must be a list of turns")
    out, k = [0] * n, 0
    for j, t in enumerate(turns):
        span = t.get("span") if isinstance(t, dict) else None
        if (not isinstance(span, list) or len(span) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                   for v in span) or not 0 <= span[0] <= span[1] <= n):
            raise DoctorError(f"{where}: multi_turn.turns[{j}].span must be [start, end] within the {n} response "
                              f"tokens, got {span!r}")
        if t.get("role") == "assistant":
            k += 1
            out[span[0]:span[1]] = [k] * (span[1] - span[0])
    return out


def read_token_lines(path: str) -> tuple[list[TokenLine], int]:
    """(lines with token log-probs, number of lines without them)."""
    lines, without = [], 0
    for parsed in iter_lines(path):
        if parsed is None:
            without += 1
        else:
            lines.append(parsed)
    return lines, without


def iter_lines(path: str) -> Iterator[Optional[TokenLine]]:
    with open(path) as f:
        for i, raw in enumerate(f, start=1):
            if raw.strip():
                yield parse_line(raw, i, path)


def read_line(path: str, line: int) -> TokenLine:
    """The trajectory at 1-based `line` of `path`, which must carry token fields."""
    if not os.path.isfile(path):
        raise DoctorError(f"trajectory file {path} does not exist")
    if line < 1:
        raise DoctorError(f"--line {line}: lines are numbered from 1")
    with open(path) as f:
        for i, raw in enumerate(f, start=1):
            if i == line:
                parsed = parse_line(raw, i, path)
                if parsed is None:
                    raise DoctorError(f"{path}:{line} has no token ids or log-probs (run with "
                                      "trainer.log_token_logprobs=true)")
                return parsed
    raise DoctorError(f"{path} has fewer than {line} lines")
