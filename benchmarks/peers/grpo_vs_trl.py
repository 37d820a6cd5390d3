"""mgrpo vs TRL's GRPOTrainer on the same GRPO workload, on CPU, in one run.

    python -m benchmarks.peers.grpo_vs_trl                        # tiny workload: 3 warm-up + 30 timed steps, 2 rounds
    python -m benchmarks.peers.grpo_vs_trl --steps 10 --warmup 2 --rounds 1 --out /tmp/quick
    python -m benchmarks.peers.grpo_vs_trl --workload qwen3vocab  # GSM8K, Qwen3 tokenizer, 151,936-token vocabulary

Workloads (benchmarks/peers/grpo_workloads.py):
- tiny (the default job's): a ~0.3M-parameter Qwen3-shaped model (16-token vocabulary, hidden 128, 2 layers,
  4 heads / 2 KV heads, head_dim 32, ffn 256, tied embeddings, fp32) learning single-digit sums ("a+b=" -> the
  digits of a+b then EOS); 32 prompts x 8 samples per step, at most 4 response tokens, lr 5e-4.
- qwen3vocab: GSM8K prompts through the real Qwen3 tokenizer and chat template, a Qwen3-shaped model with the
  full 151,936-token vocabulary and a small body (hidden 256, 4 layers, 8 heads / 4 KV heads, head_dim 32,
  ffn 768, tied embeddings: 40M parameters, 39M of them the embedding), 8 prompts x 8 samples per step, up to
  128 response tokens, lr 1e-5, reward: mgrpo's GSM8K judge, flexible, with veRL's format credit 0.1 (reward.gsm8k.format_score).
Both: temperature 1.0; Adam betas 0.9/0.99, no weight decay, grad-clip 1.0, constant LR; GRPO with
group-std-normalised advantages, clip 0.2, token-mean loss over the batch, KL-to-reference loss with
coefficient 0.001; one optimizer step per rollout.

Both sides start from one seeded random Qwen3ForCausalLM saved to a folder (mgrpo's `init_hf_checkpoint`,
seed 1), use the workload's tokenizer, see the same prompts in the same order (the stream of mgrpo's
PromptDataset with data.seed=1, handed to TRL unshuffled; GSM8K prompts as chat messages that TRL templates
itself, checked to give mgrpo's token ids) and are scored by the same function.

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

from benchmarks import add_output_args, output_path
from benchmarks.peers.grpo_vs_trl_report import per_step, render_table, summarize, write_outputs
from benchmarks.peers.grpo_workloads import (SEED, WORKLOADS, Workload, child_pythonpath, load_reward,
                                             make_initial_model, model_key, prepare_data, prompt_schedule)
from benchmarks.peers.grpo_workloads import mgrpo_overrides as workload_overrides
from benchmarks.tools.proctree import TreeMonitor, machine


def what_each_side_does(w: Workload) -> dict:
    rows, p = w.rows, w.prompts_per_step
    accumulation = (f"{rows // w.trl_micro_batch} micro-batches of {w.trl_micro_batch} rows (gradient accumulation)"
                    if w.trl_micro_batch < rows else f"all {rows} rows at once")
    return {
        "trl": (
            f"One process. Per step: tokenize (and chat-template) the {p} prompts; HF generate with the policy model "
            f"itself (KV cache, {rows} rows, <={w.max_new_tokens} new tokens, sampling); decode; the reward function "
            "in-process; reference forward pass (a second HF model, loaded again from the saved folder, no grad, "
            "TRL's chunked LM-head log-probs); no old-policy forward (TRL skips it when num_iterations=1 and "
            "generation is aligned with the optimizer step, using the detached current log-probs instead); policy "
            f"forward + backward over {accumulation} (TRL's chunked LM-head log-probs, add_fused_lm_head: on CPU "
            "every position of the padded rows is scored, in tiles of 4096 tokens x 32768 vocabulary rows); "
            "grad-clip; AdamW step; log to stdout. No weight sync: generation uses the model being trained."
        ),
        "mgrpo": (
            "A Ray driver and Ray actors: one Megatron rank (actor + frozen reference) that also hosts the "
            "rollout engine (HF transformers, rollout=hf_cpu: rollout.mode=hybrid, veRL's hybrid engine), "
            "plus the Ray processes a local run keeps (gcs_server, raylet with its dashboard and runtime-env "
            "agents; no API server, autoscaler monitor, log monitor process (a driver thread forwards the actors' "
            "output) or idle workers). Per "
            f"step: next {p} prompts; rollout call to the engine (HF generate; each sampled token's log-prob taken "
            "from that step's logits by a logits processor); decode; the built-in rule in the driver's process "
            "(reward workers only for user functions and math-verify); reference forward "
            "(sent to the Megatron rank right after generation, so it runs while the driver judges; its log-probs "
            "stay on the rank for the update: 'reference log-probs' below is the driver's wait for them, 0 here, "
            "and timing_s/ref_on_ranks the rank's time); advantages; one Megatron forward+backward and optimizer "
            "step (DDP wrapper, grad-clip; response tokens packed THD into micro-batches of at most "
            "actor.max_tokens_per_gpu tokens; log-probs and loss through the fused chunked kernel, response positions "
            "only) whose own detached log-probs are pi_old (no separate old-policy forward: one update per rollout) "
            "and give the rollout-vs-trainer check; weight sync (Megatron -> HF names, copied in memory into the "
            "engine in the same process, with an engine health check first); metrics to JSONL + TensorBoard + "
            "console; trajectories to JSONL."
        ),
    }


DIFFERENCES = [
    "Neither side runs an old-policy forward: with one update per rollout both take pi_old from the training "
    "forward's detached log-probs (mgrpo: actor.recompute_old_logprob=false, its default).",
    "KL term: mgrpo's low_var_kl is k3 clamped to [-10, 10]; TRL's is plain k3. TRL's use_bias_correction_kl "
    "(default True) is turned off so its KL term is the same unweighted k3.",
    "Loss aggregation: TRL loss_type='dapo' (sum over tokens / active tokens of the whole batch) = mgrpo "
    "token-mean. Advantage std epsilon: TRL 1e-4, mgrpo its own; irrelevant to timing.",
    "Generation: both use transformers' generate with a KV cache; mgrpo also computes each sampled token's "
    "log-prob under the engine (a logits processor reads each step's raw logits once: no step's logits are kept "
    "longer than the next step), which TRL without vLLM does not need. They draw tokens differently from the same "
    "distribution: TRL through generate's torch.multinomial (one CPU exponential per vocabulary entry: 48 ms a "
    "decode step at 16 rows of 151,936), mgrpo's engine by inversion with one uniform per row "
    "(rollout/categorical.py, 0.55 ms; benchmarks/measure/sampler.py).",
    "Log-prob heads: both avoid [tokens x vocab] logits in training. TRL 1.16 patches the model with its chunked "
    "LM head (add_fused_lm_head; on CPU it scores every position of the padded rows, prompt and padding included); "
    "mgrpo's kernel scores the response positions of THD-packed micro-batches only.",
    "Rewards: both call the built-in rule in their own process (mgrpo sends user functions and math-verify to "
    "reward.num_workers=2 isolated subprocesses: per-call timeouts, crash isolation).",
    "Priority: Ray starts its workers at nice 15 (RAY_worker_niceness); the harness sets it to 0, TRL's "
    "process's priority, so that other jobs on the machine slow both sides alike.",
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

    from mgrpo.config.schema import ModelConfig
    from mgrpo.data.tokenizer import load_tokenizer

    w = Workload.from_dict(spec["workload"])
    tok = load_tokenizer(ModelConfig(**w.model))
    eos = {tok.eos_token_id}
    score_fn = load_reward(w)
    steps: list[dict] = []
    cur: dict = {}

    def add(name: str, seconds: float) -> None:
        cur[name] = cur.get(name, 0.0) + seconds

    def reward(prompts, completions, completion_ids, ground_truth, data_source, prompt_len, **_):
        # What mgrpo's judger passes: the decoded text (special tokens skipped; a chat prompt's completion is the
        # assistant message) and whether the response stopped on EOS (TRL keeps the EOS id as the last completion
        # id when it was sampled).
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [score_fn(src, text, gt, {"finish_reason": "stop" if ids and ids[-1] in eos else "length"})
                  for text, ids, gt, src in zip(texts, completion_ids, ground_truth, data_source)]
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
        # One generation of all rows per optimizer step: gradient accumulation over micro-batches of
        # trl_micro_batch rows (steps_per_generation defaults to gradient_accumulation_steps).
        per_device_train_batch_size=w.trl_micro_batch, gradient_accumulation_steps=w.rows // w.trl_micro_batch,
        num_generations=w.samples_per_prompt, max_completion_length=w.max_new_tokens, temperature=w.temperature,
        top_p=1.0, top_k=0, use_vllm=False, learning_rate=w.lr, lr_scheduler_type="constant", optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=w.kl_coef, use_bias_correction_kl=False, loss_type="dapo", epsilon=0.2, scale_rewards="group",
        num_iterations=1, max_steps=spec["total_steps"], shuffle_dataset=False, dataloader_num_workers=0,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=SEED,
        chat_template_kwargs={"enable_thinking": False},  # mgrpo's data.enable_thinking=false
    )
    # The model goes in as a folder path: with beta != 0 TRL builds its reference model from name_or_path.
    trainer = Timed(model=spec["init_dir"], reward_funcs=reward, args=args,
                    train_dataset=Dataset.from_list(spec["schedule"]), processing_class=tok, callbacks=[Clock()])
    trainer.train()
    config = {k: getattr(args, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
        "num_generations", "max_completion_length", "temperature", "top_p", "top_k", "learning_rate", "beta",
        "loss_type", "epsilon", "scale_rewards", "use_bias_correction_kl", "num_iterations", "gradient_checkpointing",
        "bf16", "optim",
        "adam_beta1", "adam_beta2", "weight_decay", "max_grad_norm", "max_steps", "lr_scheduler_type")}
    config["torch_threads"] = torch.get_num_threads()
    config["reference_model_loaded_from"] = getattr(getattr(trainer.ref_model, "config", None), "_name_or_path", None)
    return {"steps": steps, "config": config}


def mgrpo_overrides(spec: dict) -> list[str]:
    w = Workload.from_dict(spec["workload"])
    return workload_overrides(w, spec["data_dir"]) + [
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

    from benchmarks.peers.grpo_workloads import compose_mgrpo
    from mgrpo.loop import Trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    overrides = mgrpo_overrides(spec)
    cfg = compose_mgrpo(overrides)  # the config `mgrpo-train <overrides>` runs

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
    def __init__(self, kind: str, spec: dict, workdir: str, repo: str | None = None):
        """`repo`: the checkout the child imports mgrpo and this module from (default: this one); an A/B
        comparison of two commits runs the same parent over two checkouts (benchmarks/measure/startup.py)."""
        self.kind, self.spec = kind, spec
        spec_path = os.path.join(workdir, f"{spec['name']}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(workdir, f"{spec['name']}.log")
        go_r, self.go_w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = child_pythonpath(env) if repo is None else os.pathsep.join([repo, child_pythonpath(env)])
        # Ray starts its workers (mgrpo's Megatron rank and engine) at nice 15; TRL's process runs at 0. On a
        # machine others load, that alone made mgrpo's generate 3-5x slower than TRL's in a trial (load 30):
        # both sides run at the same priority here.
        env["RAY_worker_niceness"] = "0"
        # mgrpo's local Ray gets a temp dir of its own (short path: Ray's socket paths are length-limited),
        # removed afterwards; mgrpo itself would leave a /tmp/mgrpo-ray-* behind per run.
        self.ray_tmp = tempfile.mkdtemp(prefix="gvt-ray-", dir="/tmp")
        env["RAY_TMPDIR"] = self.ray_tmp
        self.t_launch = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", "-m", "benchmarks.peers.grpo_vs_trl", "--_child", kind,
                 spec_path, str(go_r), str(ready_w)],
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


def run_round(index: int | str, order: list[str], base: dict, workdir: str, timeout: float) -> dict[str, dict]:
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
def prepare(w: Workload, workdir: str, total_steps: int, threads: int) -> dict:
    """What both children of every round share: the initial weights, the data, the prompt schedule."""
    os.makedirs(workdir, exist_ok=True)
    init_dir = os.path.join(workdir, "init_hf_" + model_key(w.model))
    if not os.path.exists(os.path.join(init_dir, "config.json")):
        make_initial_model(w, init_dir)
    data_dir = prepare_data(w, workdir)
    return {"init_dir": init_dir, "data_dir": data_dir, "total_steps": total_steps, "threads": threads,
            "workload": w.to_dict(), "schedule": prompt_schedule(w, data_dir, total_steps)}


def workload_meta(w: Workload, a, total: int, orders: list) -> dict:
    return {"name": w.name, "model": w.model_label(), "task": w.describe,
            "prompts_per_step": w.prompts_per_step, "samples_per_prompt": w.samples_per_prompt,
            "max_new_tokens": w.max_new_tokens, "max_prompt_length": w.max_prompt_length,
            "temperature": w.temperature, "lr": w.lr, "kl_coef": w.kl_coef, "trl_micro_batch": w.trl_micro_batch,
            "warmup_steps": a.warmup, "timed_steps": a.steps, "steps_per_run": total, "rounds": a.rounds,
            "launch_orders": orders, "threads": a.threads, "final_reward_last_steps": a.last}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                    help="tiny (the default job's) or qwen3vocab (GSM8K, Qwen3 tokenizer, 151,936-token vocabulary)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per run, after the warm-up (default: tiny 30, qwen3vocab 6)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps excluded from timing (default 3, "
                    "qwen3vocab 1; >= 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="lockstep runs of both; launch order swapped each round (default: tiny 2, qwen3vocab 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of TRL's process and mgrpo's trainer.cpus_per_worker (default job: 1)")
    ap.add_argument("--trl-micro-batch", type=int, default=None,
                    help="TRL's per_device_train_batch_size (default: the workload's; gradient accumulation "
                         "makes up the batch)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the workload's)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response length cap (default: the workload's)")
    ap.add_argument("--mgrpo", action="append", default=[], metavar="OVERRIDE",
                    help="an mgrpo-train override added to the workload's (repeatable), e.g. "
                         "actor.max_tokens_per_gpu=2048; recorded in the JSON's mgrpo_overrides")
    add_output_args(ap, "grpo_vs_trl[_<workload>]")  # a prefix: <out>.csv and <out>.json
    ap.add_argument("--workdir", default=None, help="scratch folder, kept (default: a temp dir, removed)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for start-up or for one step")
    ap.add_argument("--last", type=int, default=None, help="final reward = mean over this many last steps "
                    "(default: tiny 10, qwen3vocab 3)")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        kind, spec_path, go_fd, ready_fd = a._child
        child_main(kind, spec_path, int(go_fd), int(ready_fd))
        return
    tiny = a.workload == "tiny"
    for k, small, big in (("steps", 30, 6), ("warmup", 3, 1), ("rounds", 2, 1), ("last", 10, 3)):
        if getattr(a, k) is None:
            setattr(a, k, small if tiny else big)
    a.out = output_path(a, "grpo_vs_trl" + ("" if tiny else f"_{a.workload}"))
    w = WORKLOADS[a.workload]
    for opt, fld in (("trl_micro_batch", "trl_micro_batch"), ("prompts", "prompts_per_step"),
                     ("max_new_tokens", "max_new_tokens")):
        if getattr(a, opt):
            w = w.with_changes(**{fld: getattr(a, opt)})
    w = w.with_changes(trl_micro_batch=min(w.trl_micro_batch, w.rows))
    if a.mgrpo:
        w = w.with_changes(mgrpo_overrides=tuple(w.mgrpo_overrides) + tuple(a.mgrpo))
    if a.warmup < 1 or a.steps < 2 or a.rounds < 1 or w.rows % w.trl_micro_batch:
        ap.error("need --warmup >= 1, --steps >= 2, --rounds >= 1 and a TRL micro-batch that divides "
                 f"{w.rows} rows")

    meta = {"command": " ".join(["python", "-m", "benchmarks.peers.grpo_vs_trl"] + sys.argv[1:]),
            "machine": machine()}
    keep = a.workdir is not None
    workdir = a.workdir or tempfile.mkdtemp(prefix="grpo_vs_trl-")
    total = a.warmup + a.steps + 1  # the last step only closes the timing of the one before it
    base = prepare(w, workdir, total, a.threads)
    print(f"workdir {workdir}: workload {w.name}, {a.rounds} round(s) of {total} lockstep steps ({a.warmup} "
          f"warm-up, {a.steps} timed, 1 closing), threads {a.threads}", flush=True)

    runs: dict[str, list[dict]] = {"trl": [], "mgrpo": []}
    orders = []
    for r in range(a.rounds):
        order = ["trl", "mgrpo"] if r % 2 == 0 else ["mgrpo", "trl"]
        orders.append(order)
        t0 = time.time()
        res = run_round(r, order, base, workdir, a.timeout)
        for kind, rr in res.items():
            runs[kind].append(rr)
            ps = per_step(rr, a.warmup)
            print(f"  round {r} {kind:5}: median step {statistics.median(ps['intervals_s']):.3f}s, "
                  f"peak RSS {rr['memory']['peak_rss_tree_mib']:.0f} MiB, "
                  f"reward(last {a.last}) {statistics.fmean(ps['scores'][-a.last:]):.3f}", flush=True)
        print(f"  round {r} took {time.time() - t0:.0f}s, load average now {os.getloadavg()[0]:.2f}", flush=True)

    trl = summarize("trl", runs["trl"], a.warmup, a.last)
    mg = summarize("mgrpo", runs["mgrpo"], a.warmup, a.last)
    meta["machine"]["loadavg_at_end"] = os.getloadavg()
    # Others may edit the checkout while this runs; children import whatever is on disk when they start.
    end = machine()
    meta["machine"]["mgrpo_commit_at_end"] = end["mgrpo_commit"]
    meta["machine"]["mgrpo_modified_tracked_files_at_end"] = end["mgrpo_modified_tracked_files"]
    meta.update({
        "workload": workload_meta(w, a, total, orders),
        "what_each_side_does_per_step": what_each_side_does(w),
        "differences": DIFFERENCES,
        "measurement": MEASUREMENT,
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


MEASUREMENT = (
    "Both children alive, stepping in lockstep (one step of one side at a time, order flipping every step). "
    "Step time: from the child's 'go' to its next 'ready' (start of the following step), so logging and "
    "data loading count; timed steps are warmup+1..total-1, pooled over rounds. Tokens/s: tokens of the "
    "timed steps / their summed time. CPU: user+system seconds of the whole process tree during the "
    "side's own steps (snapshots at the handshakes); 'busy while idle' is the tree's CPU while the other "
    "side stepped. Memory: RSS summed over the tree every 0.2 s (shared pages counted in every process), "
    "PSS every 1 s (shared pages split), peaks over the whole run including start-up and shutdown.")


if __name__ == "__main__":
    main()
