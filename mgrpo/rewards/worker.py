"""A reward worker process: `python -m mgrpo.rewards.worker`, driven by the Rules over pipes.

Protocol, one JSON object per line: the first stdin line is the config {"custom_functions": {...},
"gsm8k": {"method", "format_score"}};
the worker answers {"ready": true}; then each batch {"requests": [{"id", "data_source", "response",
"ground_truth", "extra_info"}, ...]} (one message per worker per step) is scored in order, each
request answered by its own line {"id", "score", "error"} as soon as it is done: the Rules times
every call from the previous answer, so a hung call is cut without losing the finished ones. The
protocol owns the original stdout; anything a reward function prints goes to stderr instead, so
user code cannot corrupt it.
A plain subprocess rather than multiprocessing: it starts from Ray actors and daemon processes
alike and does not re-import the parent's __main__.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    # Ctrl-C at the terminal reaches the whole process group; the driver decides what it means (finish the
    # step and checkpoint) and closes this worker's stdin when it is done with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # fd 1 (C-level prints too) now goes to stderr
    sys.stdout = sys.stderr

    from mgrpo.rewards import math_reward
    from mgrpo.rewards.registry import EVERY_SOURCE, builtin_rewards, get_reward_fn, load_function, to_score

    config = json.loads(sys.stdin.readline())
    custom: dict[str, str] = config.get("custom_functions", {})
    builtins = {} if EVERY_SOURCE in custom else builtin_rewards(config.get("gsm8k"))  # '*' replaces them
    fns = {**builtins, **{src: None for src in custom}}  # custom: imported on first use

    def resolve(src: str):
        key = src if src in fns else EVERY_SOURCE
        if fns.get(key) is None and key in custom:
            fns[key] = load_function(custom[key], key)
        return get_reward_fn(src, fns)

    if any(src in fns for src in math_reward.SOURCES):
        math_reward.warm()
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        for req in json.loads(line)["requests"]:
            src = req["data_source"]
            try:
                fn = resolve(src)
                score, error = to_score(fn(src, req["response"], req["ground_truth"], req["extra_info"])), None
            except BaseException as e:  # noqa: BLE001 - a bad reward function must never kill the worker
                score, error = None, f"{type(e).__name__}: {e}"
            proto.write(json.dumps({"id": req["id"], "score": score, "error": error}) + "\n")  # line-buffered


if __name__ == "__main__":
    main()
