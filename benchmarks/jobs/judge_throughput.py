"""Scoring throughput of a generative judge on the CPU server: samples judged per second, by parser.

    python -m benchmarks.jobs.judge_throughput                  # outputs/benchmarks/judge_throughput_cpu.json
    python -m benchmarks.jobs.judge_throughput --update-results # benchmarks/results/judge_throughput_cpu.json

A tiny Qwen3-shaped chat model on the printable tokenizer (random weights: the answers are noise; what is measured
is the path: template, chat template, /generate on the CPU server launched as the run launches judges, parsing) is
launched once; then each parser scores the same `--samples` responses of the sum task `--repeats` times through
`GenerativeJudge.score` (yes_no: one token and the top log-probs; number: up to `--max-new-tokens` tokens; pairwise
yes_no: two judgements per sample). Printed and written: the median samples/s per parser, and how many answers the
number parser could not read (a random model rarely writes a digit: those are failed judgements, never 0.0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from benchmarks import add_output_args, output_path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap, "judge_throughput_cpu.json")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    args.out = output_path(args, "judge_throughput_cpu.json")

    from mgrpo.cluster.aux_engines import RewardEngines
    from mgrpo.config.reward import JudgeConfig, RewardModelConfig
    from mgrpo.config.schema import ModelConfig
    from mgrpo.data.printable import printable_tokenizer
    from mgrpo.models.hf_io import init_hf_checkpoint
    from mgrpo.rewards import ScoreRequest
    from mgrpo.rewards.generative import GenerativeJudge

    ENGINES = RewardEngines()  # noqa: N806

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = tempfile.mkdtemp(prefix="mgrpo-judge-bench-")
    reqs = [ScoreRequest("mgrpo/sum", str(a + b + (i % 3 == 0)), str(a + b), prompt=[{"role": "user", "content":
                                                                                    f"{a}+{b}="}])
            for i, (a, b) in enumerate((i % 5, (i * 7) % 5) for i in range(args.samples))]
    parsers = {
        "yes_no": dict(template="Q:{{ question }}\nA:{{ response }}\nRight? Y or N", parser="yes_no", yes="Y",
                       no="N", top_logprobs=20),
        "number": dict(template="Q:{{ question }}\nA:{{ response }}\nRef:{{ reference }}\nScore 0-9:",
                       parser="number", pattern=r"(\d)", range=[0.0, 9.0], max_new_tokens=args.max_new_tokens),
        "yes_no_pairwise": dict(template="Q:{{ question }}\n1:{{ response_a }}\n2:{{ response_b }}\n1 better? Y or N",
                                parser="yes_no", yes="Y", no="N", top_logprobs=20, pairwise=True),
    }
    result = {"command": "python -m benchmarks.jobs.judge_throughput", "samples": args.samples,
              "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
              "load_1min": os.getloadavg()[0], "parsers": {}}
    base = None
    try:
        hf = os.path.join(work, "judge")
        init_hf_checkpoint(hf, ModelConfig(tokenizer="printable", vocab_size=107, max_position_embeddings=512,
                                           init_std=0.1), seed=0, tokenizer=printable_tokenizer())
        t0 = time.perf_counter()
        base = GenerativeJudge("judge", RewardModelConfig(kind="generative", hf_path=hf, judge=JudgeConfig(
            **parsers["yes_no"])), engines=ENGINES, api_key=None, log_dir=work)
        result["server_start_s"] = round(time.perf_counter() - t0, 2)
        for name, spec in parsers.items():
            judge = GenerativeJudge("judge", RewardModelConfig(kind="generative", hf_path=hf,
                                                               url=base.hosting.engines[0].url,
                                                               judge=JudgeConfig(**spec)),
                                    engines=ENGINES, api_key=None, log_dir=work)
            rates, unparsed = [], 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                judge.score(reqs)
                rates.append(len(reqs) / (time.perf_counter() - t0))
                unparsed = judge.counts["unparsed"]
            result["parsers"][name] = {"samples_per_s_median": round(statistics.median(rates), 1),
                                       "samples_per_s_all": [round(r, 1) for r in rates],
                                       "judgements_per_sample": 2 if spec.get("pairwise") else 1,
                                       "unparsed_last_repeat": unparsed}
            print(f"{name:>16}: {statistics.median(rates):7.1f} samples/s (median of {args.repeats}), "
                  f"{unparsed} of {len(reqs)} unparsed", flush=True)
    except BaseException:
        print(f"kept for a look: {work}", file=sys.stderr)
        raise
    finally:
        if base is not None:
            base.close()
    shutil.rmtree(work, ignore_errors=True)  # everything is in the results: the temporary folder goes
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
