"""mgrpo-doctor on the README's main job: the run's mismatch report, and its worst sequence layer by layer.

    python -m benchmarks.jobs.doctor_main_job                # runs mgrpo-train (defaults) in a temp folder first
    python -m benchmarks.jobs.doctor_main_job --run-dir outputs/mgrpo/sum-tiny     # an existing run of the default job

Writes benchmarks/results/doctor_main_job_cpu.json (the `run` report without its per-token lists, the `layers`
verdicts for the engine in float32 and in bfloat16 against the fp32 trainer) and doctor_main_job_cpu.txt (what
the two commands print). These are the numbers behind trainer.max_logprob_diff's fp32 default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from benchmarks import REPO, add_output_args, output_path
from benchmarks.tools.proctree import machine


def _doctor(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mgrpo_launchers.doctor", *args], cwd=REPO, capture_output=True,
                         text=True)
    if out.returncode != 0:
        sys.exit(f"mgrpo-doctor {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return out.stdout


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", help="an existing run folder of the default job (else one is made and removed)")
    add_output_args(ap, "doctor_main_job_cpu.json")
    args = ap.parse_args(argv)
    args.out = output_path(args, "doctor_main_job_cpu.json")
    run_dir, made = args.run_dir, False
    if run_dir is None:
        run_dir, made = tempfile.mkdtemp(prefix="mgrpo-doctor-job-"), True
        subprocess.run([sys.executable, "-m", "mgrpo_launchers.train", f"trainer.output_dir={run_dir}"], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)
    work = tempfile.mkdtemp(prefix="mgrpo-doctor-out-")
    try:
        text = [f"$ mgrpo-doctor run {run_dir}", _doctor("run", run_dir, "--json", os.path.join(work, "run.json"))]
        with open(os.path.join(work, "run.json")) as f:
            report = json.load(f)
        worst = report["worst"][0]
        line = ["--engine", os.path.join(run_dir, "hf"), "--trajectory", report["trajectories"], "--line",
                str(worst["line"])]
        verdicts = {}
        for dtype in ("float32", "bfloat16"):
            out = os.path.join(work, f"{dtype}.json")
            text += [f"$ mgrpo-doctor layers {' '.join(line)} --engine-dtype {dtype}",
                     _doctor("layers", *line, "--engine-dtype", dtype, "--json", out)]
            with open(out) as f:
                c = json.load(f)
            verdicts[dtype] = {"verdict": c["verdict"], "kind": c["comparison"]["kind"],
                               "parts_at": c["comparison"]["parts_at"],
                               "sites": {s["name"]: s["rel"] for s in c["comparison"]["sites"]}}
        for w in report["worst"]:  # keep the file small: the worst sequences' tokens, not the run's
            w.pop("rollout", None), w.pop("trainer", None)
        result = {"command": "mgrpo-train (defaults), then mgrpo-doctor run / layers", "run": report,
                  "layers_worst_sequence": verdicts, "load_avg_1m": os.getloadavg()[0],
                  "machine": machine(packages=("torch", "transformers", "megatron-core"))}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # the run folder was a temporary one: its path says nothing
            f.write(json.dumps(result, indent=1).replace(os.path.abspath(run_dir), "<run>"))
        with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
            f.write("\n".join(text).replace(os.path.abspath(run_dir), "<run>"))
        print(f"per-token |diff| mean {report['tokens']['mean']:.3g}, max {report['tokens']['max']:.3g}; largest step "
              f"mean {report['worst_step']['mean']:.3g}; layers: "
              + "; ".join(f"{k}: {v['kind']}" for k, v in verdicts.items()) + f"\nwrote {args.out}")
    except BaseException:
        print(f"kept for a look: the run folder {run_dir}, the doctor's reports {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)  # everything is in the results: the temporary folders go
    if made:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
