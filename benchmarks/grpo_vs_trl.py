"""mgrpo vs TRL's GRPOTrainer on the same tiny GRPO workload, on CPU, in one run.

    python benchmarks/grpo_vs_trl.py                       # 3 warm-up + 30 timed steps, 2 rounds
    python benchmarks/grpo_vs_trl.py --steps 10 --warmup 2 --rounds 1 --out /tmp/quick

Workload (the default job's): a ~0.3M-parameter Qwen3-shaped model (16-token vocabulary, hidden 128,
2 layers, 4 heads / 2 KV heads, head_dim 32, ffn 256, tied embeddings, fp32) learning single-digit
sums ("a+b=" -> the digits of a+b then EOS); 32 prompts x 8 samples per step, at most 4 response
tokens, temperature 1.0; lr 5e-4 (Adam betas 0.9/0.99, no weight decay, grad-clip 1.0, constant);
GRPO with group-std-normalised advantages, clip 0.2, token-mean loss over the batch, KL-to-reference
loss with coefficient 0.001; one optimizer step per rollout.

Both sides start from one seeded random Qwen3ForCausalLM saved to a folder (mgrpo's
`init_hf_checkpoint`, seed 1: the default job's own initial weights), use the synthetic tokenizer,
see the same prompts in the same order (the stream of mgrpo's PromptDataset with data.seed=1,
handed to TRL unshuffled) and are scored by the same function (`mgrpo.rewards.synthetic.sum_score`).

How it is measured. Each framework runs in its own child process (mgrpo with its Ray processes and
reward workers), both alive at once but in lockstep: the parent lets exactly one of them run one
step at a time (a pipe handshake at the start of every step), alternating who goes first (A B, B A,
A B, ...). So load from other jobs on the machine reaches both alike, step by step, and neither
runs a step while the other does. A step is timed inside its child from "go" to the moment it is
ready for the next step, so logging and every other per-step overhead count; the first --warmup
steps are excluded. The idle framework's background CPU during the other's steps is measured and
reported (Ray's daemons keep ticking; TRL's idle process does not). The parent samples RSS of each
process tree every 0.2 s and PSS every 1 s (psutil), and snapshots each tree's CPU time at every
handshake. --rounds repeats the whole thing with the launch order swapped.

Outputs: a table on stdout, <out>.csv (one row per framework and the mgrpo/TRL ratios) and
<out>.json (per-step times, phase breakdowns, per-process memory, machine, both configurations).
It reports numbers and asserts nothing about them.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proctree import TreeMonitor, machine  # noqa: E402  (benchmarks/ is a folder of scripts)
from grpo_vs_trl_report import per_step, render_table, summarize, write_outputs  # noqa: E402
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "grpo_vs_trl")

PROMPTS_PER_STEP = 32
N_SAMPLES = 8
MAX_NEW_TOKENS = 4
TEMPERATURE = 1.0
LR = 5e-4
KL_COEF = 0.001
SEED = 1

WHAT_EACH_SIDE_DOES = {
    "trl": (
        "One process. Per step: tokenize the 32 prompts; HF generate with the policy model itself (KV cache, "
        "256 rows, <=4 new tokens, sampling); decode; the reward function in-process; reference forward pass (a "
        "second HF model, loaded again from the saved folder, no grad); no old-policy forward (TRL skips it when "
        "num_iterations=1 and generation is aligned with the optimizer step, using the detached current "
        "log-probs instead); policy forward + backward (TRL's chunked LM-head log-probs); grad-clip; AdamW step; "
        "log to stdout. No weight sync: generation uses the model being trained."
    ),
    "mgrpo": (
        "A Ray driver and Ray actors: one Megatron Megatron rank (actor + frozen reference) that also hosts the "
        "rollout engine (HF transformers, rollout=hf_cpu: rollout.mode=hybrid, veRL's hybrid engine), two "
        "reward-worker subprocesses, plus the Ray "
        "processes a local run keeps (gcs_server, raylet with its dashboard and runtime-env agents, log monitor; "
        "no API server, autoscaler monitor or idle workers). Per step: next 32 prompts; rollout call to the "
        "engine (HF generate with output_logits -> per-token rollout log-probs); decode; rewards in the worker "
        "subprocesses (each worker's share of the 256 responses as one JSON message, answers line by line); "
        "reference forward (sent to the Megatron rank right after generation, so it runs while the driver judges; "
        "its log-probs stay on the rank for the update: 'reference log-probs' below is the driver's wait for "
        "them, 0 here, and timing_s/ref_on_ranks the rank's time); advantages; one Megatron forward+backward "
        "and optimizer step (DDP wrapper, "
        "grad-clip) whose own detached log-probs are pi_old (no separate old-policy forward: one update per "
        "rollout) and give the rollout-vs-trainer check; weight sync (Megatron -> HF names, copied in memory "
        "into the engine in the same process, with an engine health check first); metrics to JSONL + "
        "TensorBoard + console; trajectories to JSONL."
    ),
}

DIFFERENCES = [
    "Neither side runs an old-policy forward: with one update per rollout both take pi_old from the training "
    "forward's detached log-probs (mgrpo: actor.recompute_old_logprob=false, its default).",
    "KL term: mgrpo's low_var_kl is k3 clamped to [-10, 10]; TRL's is plain k3. TRL's use_bias_correction_kl "
    "(default True) is turned off so its KL term is the same unweighted k3.",
    "Loss aggregation: TRL loss_type='dapo' (sum over tokens / active tokens of the whole batch) = mgrpo "
    "token-mean. Advantage std epsilon: TRL 1e-4, mgrpo its own; irrelevant to timing.",
    "Generation: both use transformers' generate with a KV cache; mgrpo also returns every step's raw logits "
    "(output_logits=True) to compute rollout log-probs, which TRL without vLLM does not need.",
    "Rewards: TRL calls the function in its own process; mgrpo's default job scores in reward.num_workers=2 "
    "isolated subprocesses (per-call timeouts, crash isolation), one message per worker per step.",
    "Threads: TRL's process gets torch.set_num_threads(--threads); mgrpo's Megatron rank and engine each get "
    "trainer.cpus_per_worker=--threads (the default job uses 1); mgrpo's processes take turns, never compute together.",
    "Models: TRL trains and generates with HF Qwen3ForCausalLM (fp32, sdpa attention); mgrpo trains a Megatron "
    "GPTModel (local spec, fp32) and generates with an HF copy that receives the weights each step.",
    "Neither side saves checkpoints (TRL save_strategy='no'; mgrpo trainer.save_freq=0, save_hf=false). TRL logs "
    "to stdout only (report_to='none'); mgrpo keeps its default loggers (console + TensorBoard) and trajectories.",
    "Random streams differ, so sampled responses, rewards and lengths diverge after the first step; tokens/s "
    "accounts for length, reward is informational (learning speed is not what is measured).",
]


# ======================================================================================================
# shared setup
# ======================================================================================================
def prompt_schedule(total_steps: int) -> list[dict]:
    """The prompts mgrpo's default job sees, step by step (PromptDataset with data.seed=1, shuffled epochs)."""
    from mgrpo.config.schema import DataConfig
    from mgrpo.data import PromptDataset
    from mgrpo.data.synthetic import synthetic_tokenizer

    ds = PromptDataset(DataConfig(), synthetic_tokenizer(), [], split="train")
    rows = []
    for _ in range(total_steps):
        for it in ds.next_batch(PROMPTS_PER_STEP):
            rows.append({"prompt": it.prompt_text, "ground_truth": it.ground_truth, "data_source": it.data_source,
                         "prompt_len": len(it.prompt_ids)})
    return rows


def make_initial_model(path: str) -> None:
    from mgrpo.config.schema import ModelConfig
    from mgrpo.data.synthetic import synthetic_tokenizer
    from mgrpo.models import init_hf_checkpoint

    init_hf_checkpoint(path, ModelConfig(), seed=SEED, tokenizer=synthetic_tokenizer())


# ======================================================================================================
# children
# ======================================================================================================
class Gate:
    """The child's end of the lockstep handshake: at the start of every step say 'ready' (the previous step,
    and everything after it, is done) and block until the parent says 'go'."""

    def __init__(self, go_fd: int, ready_fd: int):
        self.go_fd, self.ready_fd = go_fd, ready_fd
        self.ready_times: list[float] = []
        self.go_times: list[float] = []

    def begin_step(self) -> None:
        self.ready_times.append(time.time())
        os.write(self.ready_fd, b"r")
        if os.read(self.go_fd, 1) != b"g":
            raise SystemExit("grpo_vs_trl: parent went away")
        self.go_times.append(time.time())


def run_trl(spec: dict, gate: Gate) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mgrpo.data.synthetic import synthetic_tokenizer
    from mgrpo.rewards.synthetic import sum_score

    tok = synthetic_tokenizer()
    eos = {tok.eos_token_id}
    steps: list[dict] = []
    cur: dict = {}

    def add(name: str, seconds: float) -> None:
        cur[name] = cur.get(name, 0.0) + seconds

    def sum_reward(prompts, completions, completion_ids, ground_truth, data_source, prompt_len, **_):
        # What mgrpo's judger passes: the decoded text (special tokens skipped) and whether the response stopped
        # on EOS (TRL keeps the EOS id as the last completion id when it was sampled).
        scores = [sum_score(src, text, gt, {"finish_reason": "stop" if ids and ids[-1] in eos else "length"})
                  for text, ids, gt, src in zip(completions, completion_ids, ground_truth, data_source)]
        cur.update(score_mean=sum(scores) / len(scores), samples=len(scores),
                   response_tokens=sum(len(ids) for ids in completion_ids), prompt_tokens=sum(prompt_len))
        return scores

    def timed(name_of):
        def wrap(method):
            def inner(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return method(self, *a, **k)
                finally:
                    add(name_of(self, a), time.perf_counter() - t0)
            return inner
        return wrap

    class Timed(GRPOTrainer):
        """GRPOTrainer with stopwatches around its phases; behaviour unchanged."""

        _generate_single_turn = timed(lambda s, a: "gen")(GRPOTrainer._generate_single_turn)
        _calculate_rewards = timed(lambda s, a: "reward")(GRPOTrainer._calculate_rewards)
        _get_per_token_logps_and_entropies = timed(
            lambda s, a: "ref_forward" if a[0] is s.ref_model else "policy_logprobs")(
            GRPOTrainer._get_per_token_logps_and_entropies)
        _generate_and_score_completions = timed(lambda s, a: "gen_score_ref")(
            GRPOTrainer._generate_and_score_completions)

        def training_step(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super().training_step(*a, **k)
            finally:
                cur["_train_step_end"] = time.perf_counter()
                add("training_step", cur["_train_step_end"] - t0)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            gate.begin_step()

        def on_optimizer_step(self, args, state, control, **kw):
            add("clip_and_optimizer", time.perf_counter() - cur.pop("_train_step_end", time.perf_counter()))

        def on_step_end(self, args, state, control, **kw):
            steps.append({"step": state.global_step, **cur})
            cur.clear()

        def on_log(self, args, state, control, logs=None, **kw):
            if steps and logs:
                steps[-1]["trl_logs"] = {k: v for k, v in logs.items() if isinstance(v, (int, float))}

    args = GRPOConfig(
        output_dir=spec["run_dir"], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=PROMPTS_PER_STEP * N_SAMPLES, gradient_accumulation_steps=1,
        num_generations=N_SAMPLES, max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        use_vllm=False, learning_rate=LR, lr_scheduler_type="constant", optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=KL_COEF, use_bias_correction_kl=False, loss_type="dapo", epsilon=0.2, scale_rewards="group",
        num_iterations=1, max_steps=spec["total_steps"], shuffle_dataset=False, dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=SEED,
    )
    # The model goes in as a folder path: with beta != 0 TRL builds its reference model from name_or_path.
    trainer = Timed(model=spec["init_dir"], reward_funcs=sum_reward, args=args,
                    train_dataset=Dataset.from_list(spec["schedule"]), processing_class=tok, callbacks=[Clock()])
    trainer.train()
    config = {k: getattr(args, k) for k in (
        "per_device_train_batch_size", "generation_batch_size", "steps_per_generation", "num_generations",
        "max_completion_length", "temperature", "top_p", "top_k", "learning_rate", "beta", "loss_type", "epsilon",
        "scale_rewards", "use_bias_correction_kl", "num_iterations", "gradient_checkpointing", "bf16", "optim",
        "adam_beta1", "adam_beta2", "weight_decay", "max_grad_norm", "max_steps", "lr_scheduler_type")}
    config["torch_threads"] = torch.get_num_threads()
    config["reference_model_loaded_from"] = getattr(getattr(trainer.ref_model, "config", None), "_name_or_path", None)
    return {"steps": steps, "config": config}


def mgrpo_overrides(spec: dict) -> list[str]:
    return [
        # mgrpo's in-process transformers engine: its fastest rollout for a tiny CPU model, and the same HF
        # generate TRL runs (the default job may use the SGLang-protocol CPU server, built for production).
        "rollout=hf_cpu",
        f"model.hf_path={spec['init_dir']}",
        f"trainer.total_training_steps={spec['total_steps']}",
        f"trainer.output_dir={spec['run_dir']}",
        "trainer.resume=disable",
        "trainer.save_freq=0",
        "trainer.save_hf=false",
        f"trainer.cpus_per_worker={spec['threads']}",
    ]


def run_mgrpo(spec: dict, gate: Gate) -> dict:
    import dataclasses
    import logging

    from hydra import compose, initialize_config_dir

    from mgrpo.loop import Trainer
    from mgrpo_launchers.train import CONFIG_DIR, to_config  # importing it registers the structured schema

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    overrides = mgrpo_overrides(spec)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=overrides))  # the config `mgrpo-train <overrides>` runs

    class Gated(Trainer):
        def train_step(self) -> dict:
            gate.begin_step()
            return super().train_step()

    Gated(cfg).fit()
    steps = []
    with open(os.path.join(spec["run_dir"], "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            steps.append({
                "step": int(m["step"]), "score_mean": m.get("critic/score/mean"), "samples": m.get("rollout/samples"),
                "response_tokens": m.get("response_length/mean", 0.0) * m.get("rollout/samples", 0.0),
                "total_tokens": m.get("perf/total_tokens"),
                **{k: v for k, v in m.items() if k.startswith("timing_s/")},
            })
    return {"steps": steps, "config": dataclasses.asdict(cfg), "overrides": overrides}


def child_main(kind: str, spec_path: str, go_fd: int, ready_fd: int) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    gate = Gate(go_fd, ready_fd)
    out = (run_trl if kind == "trl" else run_mgrpo)(spec, gate)
    out["gate"] = {"ready": gate.ready_times, "go": gate.go_times}
    with open(spec["result_path"], "w") as f:
        json.dump(out, f, default=str)


# ======================================================================================================
# parent: one framework's child, and a lockstep round of both
# ======================================================================================================
class Side:
    def __init__(self, kind: str, spec: dict, workdir: str):
        self.kind, self.spec = kind, spec
        spec_path = os.path.join(workdir, f"{spec['name']}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(workdir, f"{spec['name']}.log")
        go_r, self.go_w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # mgrpo's local Ray gets a temp dir of its own (short path: Ray's socket paths are length-limited),
        # removed afterwards; mgrpo itself would leave a /tmp/mgrpo-ray-* behind per run.
        self.ray_tmp = tempfile.mkdtemp(prefix="gvt-ray-", dir="/tmp")
        env["RAY_TMPDIR"] = self.ray_tmp
        self.t_launch = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--_child", kind, spec_path,
                 str(go_r), str(ready_w)],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env, pass_fds=(go_r, ready_w))
        os.close(go_r)
        os.close(ready_w)  # so a dead child reads as EOF here
        self.monitor = TreeMonitor(self.proc.pid)
        self.monitor.start()
        self.own_cpu: list[float] = []  # CPU seconds of this tree during each of its own steps
        self.idle_cpu = self.idle_wall = 0.0  # ... and while the other side ran its steps
        self.t_exit = None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            r, _, _ = select.select([self.ready_r], [], [], min(5.0, max(0.0, deadline - time.time())))
            if r:
                if os.read(self.ready_r, 1) != b"r":
                    raise RuntimeError(f"{self.kind} child exited (rc={self.proc.wait()}) before its next step; "
                                       f"log: {self.log_path}\n" + self.log_tail())
                return
            if time.time() > deadline:
                raise TimeoutError(f"{self.kind} child not ready within {timeout:.0f}s; log: {self.log_path}")

    def go(self) -> None:
        os.write(self.go_w, b"g")

    def finish(self, timeout: float) -> dict:
        rc = self.proc.wait(timeout=timeout)
        self.t_exit = time.time()
        self.monitor.stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        if rc != 0 or not os.path.exists(self.spec["result_path"]):
            raise RuntimeError(f"{self.kind} child failed (rc={rc}); log {self.log_path}:\n{self.log_tail()}")
        with open(self.spec["result_path"]) as f:
            res = json.load(f)
        res.update(kind=self.kind, name=self.spec["name"], t_launch=self.t_launch, t_exit=self.t_exit,
                   own_cpu=self.own_cpu, idle_cpu=self.idle_cpu, idle_wall=self.idle_wall,
                   memory=self.monitor.summary(), log=self.log_path,
                   leftover_pids=[pid for pid, p in self.monitor.seen.items() if self.monitor.alive(p)])
        return res

    def log_tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def kill(self) -> None:
        """Terminate this side's child and everything below it, by pid (all started by this script)."""
        ps = self.monitor.ps
        self.monitor.procs()
        procs = [p for p in self.monitor.seen.values() if self.monitor.alive(p)]  # orphans too
        for p in procs:
            try:
                p.terminate()
            except ps.Error:
                pass
        _, alive = ps.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except ps.Error:
                pass
        self.monitor.stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def run_round(index: int, order: list[str], base: dict, workdir: str, timeout: float) -> dict[str, dict]:
    """Launch both children (one after the other, each until it is ready for step 1), then run every step of
    both in lockstep: one side at a time, the order flipping each step."""
    sides: dict[str, Side] = {}
    results: dict[str, dict] = {}
    try:
        for kind in order:
            name = f"r{index}_{kind}"
            spec = {**base, "name": name, "run_dir": os.path.join(workdir, name),
                    "result_path": os.path.join(workdir, f"{name}.result.json")}
            sides[kind] = Side(kind, spec, workdir)
            sides[kind].wait_ready(timeout)  # start-up of one never overlaps the other's
        total = base["total_steps"]
        for step in range(1, total + 1):
            for kind in (order if step % 2 else order[::-1]):
                me = sides[kind]
                others = [s for s in sides.values() if s is not me]
                c_me, c_others, t0 = me.monitor.cpu(), [o.monitor.cpu() for o in others], time.time()
                me.go()
                if step == total:
                    results[kind] = me.finish(timeout)  # its last step, then its shutdown
                else:
                    me.wait_ready(timeout)
                    me.own_cpu.append(me.monitor.cpu() - c_me)
                    for o, c in zip(others, c_others):
                        if o.t_exit is None:
                            o.idle_cpu += o.monitor.cpu() - c
                            o.idle_wall += time.time() - t0
            if step % 10 == 0 or step == total:
                print(f"  round {index}: step {step}/{total}", flush=True)
        return results
    except BaseException:
        for s in sides.values():
            s.kill()
        raise


# ======================================================================================================
# parent: main
# ======================================================================================================
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run, after the warm-up (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps excluded from timing (default 3, >= 1)")
    ap.add_argument("--rounds", type=int, default=2, help="lockstep runs of both; launch order swapped each round")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of TRL's process and mgrpo's trainer.cpus_per_worker (default job: 1)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output prefix: <out>.csv and <out>.json")
    ap.add_argument("--workdir", default=None, help="scratch folder, kept (default: a temp dir, removed)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for start-up or for one step")
    ap.add_argument("--last", type=int, default=10, help="final reward = mean over this many last steps")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        kind, spec_path, go_fd, ready_fd = a._child
        child_main(kind, spec_path, int(go_fd), int(ready_fd))
        return
    if a.warmup < 1 or a.steps < 2 or a.rounds < 1:
        ap.error("need --warmup >= 1, --steps >= 2, --rounds >= 1")

    meta = {"command": " ".join(["python", os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:]),
            "machine": machine()}
    keep = a.workdir is not None
    workdir = a.workdir or tempfile.mkdtemp(prefix="grpo_vs_trl-")
    os.makedirs(workdir, exist_ok=True)
    total = a.warmup + a.steps + 1  # the last step only closes the timing of the one before it
    init_dir = os.path.join(workdir, "init_hf")
    make_initial_model(init_dir)
    base = {"init_dir": init_dir, "total_steps": total, "threads": a.threads, "schedule": prompt_schedule(total)}
    print(f"workdir {workdir}: {a.rounds} round(s) of {total} lockstep steps ({a.warmup} warm-up, {a.steps} timed, "
          f"1 closing), threads {a.threads}", flush=True)

    runs: dict[str, list[dict]] = {"trl": [], "mgrpo": []}
    orders = []
    for r in range(a.rounds):
        order = ["trl", "mgrpo"] if r % 2 == 0 else ["mgrpo", "trl"]
        orders.append(order)
        t0 = time.time()
        res = run_round(r, order, base, workdir, a.timeout)
        for kind, rr in res.items():
            runs[kind].append(rr)
            w = per_step(rr, a.warmup)
            print(f"  round {r} {kind:5}: median step {statistics.median(w['intervals_s']):.3f}s, "
                  f"peak RSS {rr['memory']['peak_rss_tree_mib']:.0f} MiB, "
                  f"reward(last {a.last}) {statistics.fmean(w['scores'][-a.last:]):.3f}", flush=True)
        print(f"  round {r} took {time.time() - t0:.0f}s, load average now {os.getloadavg()[0]:.2f}", flush=True)

    trl = summarize("trl", runs["trl"], a.warmup, a.last)
    mg = summarize("mgrpo", runs["mgrpo"], a.warmup, a.last)
    meta["machine"]["loadavg_at_end"] = os.getloadavg()
    # Others may edit the checkout while this runs; children import whatever is on disk when they start.
    end = machine()
    meta["machine"]["mgrpo_commit_at_end"] = end["mgrpo_commit"]
    meta["machine"]["mgrpo_modified_tracked_files_at_end"] = end["mgrpo_modified_tracked_files"]
    meta.update({
        "workload": {"model": "Qwen3ForCausalLM: vocab 16, hidden 128, 2 layers, 4 heads / 2 KV heads, head_dim 32, "
                              "ffn 256, tied embeddings, fp32; seeded random init (mgrpo init_hf_checkpoint, seed 1)",
                     "task": "mgrpo synthetic 'sum' (a, b in 0..4), prompts in mgrpo's PromptDataset order "
                             "(data.seed=1)",
                     "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": N_SAMPLES,
                     "max_new_tokens": MAX_NEW_TOKENS, "temperature": TEMPERATURE, "lr": LR, "kl_coef": KL_COEF,
                     "warmup_steps": a.warmup, "timed_steps": a.steps, "steps_per_run": total, "rounds": a.rounds,
                     "launch_orders": orders, "threads": a.threads, "final_reward_last_steps": a.last},
        "what_each_side_does_per_step": WHAT_EACH_SIDE_DOES,
        "differences": DIFFERENCES,
        "measurement": (
            "Both children alive, stepping in lockstep (one step of one side at a time, order flipping every step). "
            "Step time: from the child's 'go' to its next 'ready' (start of the following step), so logging and "
            "data loading count; timed steps are warmup+1..total-1, pooled over rounds. Tokens/s: tokens of the "
            "timed steps / their summed time. CPU: user+system seconds of the whole process tree during the "
            "side's own steps (snapshots at the handshakes); 'busy while idle' is the tree's CPU while the other "
            "side stepped. Memory: RSS summed over the tree every 0.2 s (shared pages counted in every process), "
            "PSS every 1 s (shared pages split), peaks over the whole run including start-up and shutdown."),
        "trl_config": runs["trl"][0]["config"],
        "mgrpo_overrides": runs["mgrpo"][0]["overrides"],
        "mgrpo_config": runs["mgrpo"][0]["config"],
    })
    table = render_table(trl, mg)
    meta["table"] = table
    print("\n" + table)
    write_outputs(a.out, trl, mg, meta)
    print(f"\nwrote {a.out}.csv and {a.out}.json")
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
