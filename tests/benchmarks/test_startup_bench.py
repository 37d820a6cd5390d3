"""benchmarks/measure/startup.py's arithmetic and the process-tree monitor's per-process PSS at the tree's peak
(benchmarks/tools/proctree.py), on this process alone."""

from __future__ import annotations

import mmap
import os

from benchmarks.measure.startup import PHASE, summary
from benchmarks.tools.proctree import TreeMonitor


def own_pss_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024


def test_pss_at_peak_is_the_peak_samples_split_and_sums_to_it():
    mon = TreeMonitor(os.getpid())
    mon.sample(pss=True)
    first = mon.summary()
    # 64 MiB touched in an anonymous mapping of its own, so every page is new to the process whatever its
    # malloc holds: the next sample is the tree's peak. (A bytearray, before: in one full run of the README's
    # test command the worker's PSS grew by 11 MiB only; the cause was not established.)
    block = mmap.mmap(-1, 64 << 20)
    for off in range(0, len(block), 4096):
        block[off] = 1
    mon.sample(pss=True)
    reference = own_pss_mib()
    out = mon.summary()
    block.close()
    # This process may have children of its own by now (an xdist worker that ran other tests keeps torch's
    # torch_shm_manager and multiprocessing's helper): they are in the tree and in the split, as they should be.
    own = out["pss_at_peak_mib"]["main process"]
    assert abs(sum(out["pss_at_peak_mib"].values()) - out["peak_pss_tree_mib"]) < 1e-6
    assert own - first["pss_at_peak_mib"]["main process"] > 60
    assert abs(own - reference) < 8  # smaps_rollup read by hand, a moment later


def test_summary_takes_medians_per_phase_and_per_process_kind():
    runs = [{"time_to_first_step_s": t, "peak_pss_tree_mib": p, "load_1m_at_start": 1.0,
             "phases_s": {"Ray placement + initial weights": r, "ready": t - 4},
             "pss_at_peak_mib": {"ray::MegatronRank": k, "main process": 260.0}}
            for t, p, r, k in ((18.0, 900.0, 6.0, 400.0), (20.0, 950.0, 7.5, 420.0), (30.0, 870.0, 6.2, 380.0))]
    s = summary(runs)
    assert s["time_to_first_step_s"] == 20.0 and s["peak_pss_tree_mib"] == 900.0
    assert s["phases_s"] == {"ready": 16.0, "Ray placement + initial weights": 6.2}
    assert s["pss_at_peak_mib"] == {"ray::MegatronRank": 400.0, "main process": 260.0}


def test_phase_lines_are_read_as_the_run_logs_them():
    log = ("2026-11-27 20:05:43,510 INFO mgrpo: start | Ray placement + initial weights in 6.5s\n"
           "... start | Megatron stages (tp=1 pp=1 cp=1 dp=1) in 5.0s (built alongside the engines)\n"
           "... start | ready in 15.5s: run dir /tmp/x, steps 0..4\n")
    assert {m.group(1): float(m.group(2)) for m in PHASE.finditer(log)} == {
        "Ray placement + initial weights": 6.5, "Megatron stages (tp=1 pp=1 cp=1 dp=1)": 5.0, "ready": 15.5}
