"""Benchmarks write to outputs/benchmarks/ unless told to update the committed results (issue 30): a trial run
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
