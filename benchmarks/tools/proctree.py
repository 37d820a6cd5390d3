"""Measuring a run from outside: memory and CPU of a whole process tree (a driver plus its Ray
processes, reward workers, ...) and a description of the machine. Shared by the benchmarks."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import threading
import time

from benchmarks import REPO


# ======================================================================================================
def process_label(p, root_pid: int) -> str:
    if p.pid == root_pid:
        return "main process"
    cmd = p.cmdline()
    if not cmd:  # exiting, or not exec'd yet; the kernel's 15-character name is all there is
        return f"({p.name()})"
    if cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0].split(" ")[0]  # "ray::MegatronRank.call" -> "ray::MegatronRank"
    if "mgrpo.rewards.worker" in cmd:
        return "mgrpo reward worker"
    base = os.path.basename(cmd[0])
    script = next((c for c in cmd[1:4] if c.endswith(".py")), None)
    return f"{base} {os.path.basename(script)}" if script else base


def better_label(old: str | None, new: str) -> str:
    """A Ray worker starts as setup_worker.py, becomes default_worker.py, then ray::IDLE, then ray::<Actor>;
    Ray's agents start as scripts and rename themselves. Keep the most specific name a process has had."""
    def rank(label):
        if label.startswith("("):
            return -1
        return 2 if label.startswith("ray::") and label != "ray::IDLE" else 1 if label == "ray::IDLE" else 0

    return new if old is None or rank(new) >= rank(old) else old


class TreeMonitor(threading.Thread):
    """RSS every `interval` s and PSS every `pss_every`-th sample of a process and all its descendants, summed
    per sample (peaks are of those sums); cumulative CPU time of the tree, keeping that of exited processes."""

    def __init__(self, root_pid: int, interval: float = 0.2, pss_every: int = 5):
        super().__init__(daemon=True)
        import psutil

        self.ps = psutil
        self.root = psutil.Process(root_pid)
        self.interval, self.pss_every = interval, pss_every
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.rss_timeline: list[tuple[float, int, int]] = []  # (time, RSS sum, processes)
        self.pss_timeline: list[tuple[float, int]] = []
        self.cpu_last: dict[int, float] = {}
        self.seen: dict[int, object] = {}  # pid -> psutil.Process (it knows its start time: no pid reuse)
        self.labels: dict[int, str] = {}  # pid -> what the process became (a Ray worker renames itself)
        self.peak_rss: dict[int, int] = {}
        self.peak_pss: dict[int, int] = {}
        self.pss_at_peak: dict[int, int] = {}  # each process's PSS in the sample where the tree's PSS peaked

    def procs(self) -> list:
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except self.ps.Error:
            return []
        for p in procs:
            self.seen.setdefault(p.pid, p)
        return procs

    def alive(self, p) -> bool:
        try:
            return p.is_running() and p.status() != self.ps.STATUS_ZOMBIE
        except self.ps.Error:
            return False

    def run(self) -> None:
        i = 0
        while not self.stop_event.is_set():
            self.sample(pss=i % self.pss_every == 0)
            i += 1
            self.stop_event.wait(self.interval)

    def sample(self, pss: bool) -> None:
        rss_sum = pss_sum = n = 0
        pss_now: dict[int, int] = {}
        with self.lock:
            for p in self.procs():
                try:
                    with p.oneshot():
                        rss = p.memory_info().rss
                        c = p.cpu_times()
                    label = process_label(p, self.root.pid)
                    q = p.memory_full_info().pss if pss else 0
                except self.ps.Error:
                    continue
                self.cpu_last[p.pid] = c.user + c.system
                self.labels[p.pid] = better_label(self.labels.get(p.pid), label)
                n += 1
                rss_sum += rss
                pss_sum += q
                self.peak_rss[p.pid] = max(self.peak_rss.get(p.pid, 0), rss)
                self.peak_pss[p.pid] = max(self.peak_pss.get(p.pid, 0), q)
                pss_now[p.pid] = q
            t = time.time()
            self.rss_timeline.append((t, rss_sum, n))
            if pss:
                if pss_sum > max((v for _, v in self.pss_timeline), default=0):
                    self.pss_at_peak = pss_now
                self.pss_timeline.append((t, pss_sum))

    def cpu(self) -> float:
        """Cumulative user+system CPU seconds of the tree now (processes that exited keep their last value)."""
        with self.lock:
            for p in self.procs():
                try:
                    c = p.cpu_times()
                except self.ps.Error:
                    continue
                self.cpu_last[p.pid] = c.user + c.system
            return sum(self.cpu_last.values())

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)

    def summary(self) -> dict:
        mib = 1 << 20
        kinds: dict[str, dict] = {}
        for pid, label in self.labels.items():
            k = kinds.setdefault(label, {"processes": 0, "peak_rss_mib": 0.0, "peak_pss_mib": 0.0})
            k["processes"] += 1
            k["peak_rss_mib"] += self.peak_rss.get(pid, 0) / mib
            k["peak_pss_mib"] += self.peak_pss.get(pid, 0) / mib
        return {
            "peak_rss_tree_mib": max((r for _, r, _ in self.rss_timeline), default=0) / mib,
            "peak_pss_tree_mib": max((q for _, q in self.pss_timeline), default=0) / mib,
            "max_processes": max((n for _, _, n in self.rss_timeline), default=0),
            "processes_seen": len(self.labels),
            "rss_samples": len(self.rss_timeline),
            # per kind of process: how many, and the sum of each one's own peak (>= their share of the tree peak)
            "by_process_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["peak_rss_mib"])),
            # what each kind held in the one sample where the tree's PSS peaked (these sum to the peak)
            "pss_at_peak_mib": self.at_peak(),
        }

    def at_peak(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, q in self.pss_at_peak.items():
            label = self.labels.get(pid, "?")
            out[label] = out.get(label, 0.0) + q / (1 << 20)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def machine(packages=("torch", "trl", "transformers", "accelerate", "datasets", "ray", "megatron-core",
                     "psutil")) -> dict:
    import psutil
    from importlib.metadata import PackageNotFoundError, version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "?"

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True).stdout.strip()

    return {
        "cpu_model": cpu, "logical_cpus": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "memory_total_gib": round(psutil.virtual_memory().total / (1 << 30), 1), "platform": platform.platform(),
        "python": platform.python_version(),
        **{f"{p}_version": v(p) for p in packages},
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mgrpo_commit": git("rev-parse", "HEAD"),
        "mgrpo_modified_tracked_files": git("status", "--porcelain", "--untracked-files=no").splitlines(),
        "loadavg_at_start": os.getloadavg(),
    }
