"""Benchmarks write to outputs/benchmarks/ unless told to update the committed results: a trial run
must never change what the READMEs are rendered from."""

from __future__ import annotations

import argparse
import os
import re

from benchmarks import OUTPUTS, REPO, RESULTS, add_output_args, output_path


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_output_args(ap, "x_cpu.json")
    return ap.parse_args(list(argv))


def test_a_run_writes_outputs_and_only_update_results_writes_the_committed_file(tmp_path):
    assert output_path(_args(), "x_cpu.json") == os.path.join(OUTPUTS, "x_cpu.json")
    assert output_path(_args("--update-results"), "x_cpu.json") == os.path.join(RESULTS, "x_cpu.json")
    mine = str(tmp_path / "sub" / "y.json")
    assert output_path(_args("--out", mine, "--update-results"), "x_cpu.json") == mine  # --out wins
    assert (tmp_path / "sub").is_dir()


def test_no_benchmark_defaults_to_the_committed_results():
    offenders = []
    for folder, _, files in os.walk(os.path.join(REPO, "benchmarks")):
        for name in files:
            if name.endswith(".py") and not (folder.endswith("benchmarks") and name == "__init__.py"):  # the rule
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                # An argparse default, or an "or" fallback, that points into benchmarks/results/.
                if re.search(r"default=[^\n]*\bRESULTS\b|\bor os\.path\.join\(RESULTS", text):
                    offenders.append(os.path.relpath(path, REPO))
    assert offenders == []


def test_a_job_without_the_plot_extra_says_so_and_ends_well(monkeypatch, capsys, tmp_path):
    """The README's install has no matplotlib (the `bench` extra): the job's plot is a line, not a crash."""
    import sys

    from benchmarks.jobs import reward_model_sum

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` meets where it is not installed
    png = tmp_path / "x.png"
    reward_model_sum.plot({"rule_accuracy": [0.1, 0.9], "rm_score": [0.2, 0.8]}, str(png))
    assert not png.exists()
    assert f"no plot {png}: matplotlib is not installed" in capsys.readouterr().out


def test_a_failed_proof_job_keeps_its_reward_model_and_run_folder(monkeypatch, tmp_path):
    """mgrpo-train failing (here: exiting 1) must not take the trained reward model and the run's logs with it."""
    import pytest

    from benchmarks.jobs import reward_model_sum

    def train(out_dir, steps):  # the real training takes a minute: its file is what must survive
        os.makedirs(out_dir)
        open(os.path.join(out_dir, "model.safetensors"), "w").close()
        return {"rm_steps": steps, "rm_train_s": 0.0, "rm_heldout_accuracy": 1.0, "rm_right_answer_ranked_first": 1.0}

    def run_job(rm_dir, run_dir, overrides):
        os.makedirs(run_dir)
        open(os.path.join(run_dir, "metrics.jsonl"), "w").close()
        raise SystemExit(f"mgrpo-train exited 1 (its run folder is kept: {run_dir})")

    monkeypatch.setattr(reward_model_sum, "train_reward_model", train)
    monkeypatch.setattr(reward_model_sum, "run_job", run_job)
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match="its run folder is kept"):
        reward_model_sum.main(["--work", str(work), "--out", str(tmp_path / "r.json"), "--rm-steps", "3"])
    assert (work / "rm" / "model.safetensors").exists() and (work / "run" / "metrics.jsonl").exists()
