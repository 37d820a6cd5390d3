"""Route bytes per multi-turn trajectory with routing replay from the rollout (actor.router_replay=rollout, R3):
each turn asking only for the rows its trajectory lacks (SGLang's routed_experts_start_len, the default) against
every turn asking for its whole sequence (rollout.multi_turn.recheck_routes=true, what every turn did before).

    python -m benchmarks.jobs.agent_route_bytes                    # -> outputs/benchmarks/agent_route_bytes_cpu.*
    python -m benchmarks.jobs.agent_route_bytes --update-results   # -> benchmarks/results/agent_route_bytes_cpu.*

The peek tool task's trajectories (configs/tools/peek.yaml; the printable tokenizer's Qwen3-style template) on a
randomly initialised tiny Qwen3-MoE (configs/model/tiny-moe.yaml: 2 layers, 8 experts, top-2) served by the CPU
SGLang server (--enable-return-routed-experts) through SGLang's client, the runner as a run uses it. Every turn
must call the tool (tool_choice=required, reset_tool_choice=false, stop_after_call), so every trajectory runs
`--turns` assistant turns (or stops at the response budget) whatever the random model writes. Both modes draw the
same tokens (per-turn seeds). Counted from the server's answers: `routed_experts` characters (base64 of int32
[rows, layers, top_k], what crosses the wire) and rows; per trajectory, with its length and turns.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import tempfile
import time

from benchmarks import add_output_args, output_path

TRAJECTORIES, TURNS, TOKENS_PER_TURN = 16, 6, 64


def _checkpoint(out_dir: str, tok) -> str:
    import yaml

    from mgrpo.config.schema import ModelConfig
    from mgrpo.data.printable import VOCAB
    from mgrpo.models.hf_io import init_hf_checkpoint

    spec = {k: v for k, v in yaml.safe_load(open("configs/model/tiny-moe.yaml")).items()
            if k not in ("name", "tokenizer", "vocab_size", "max_position_embeddings")}
    m = dataclasses.replace(ModelConfig(), **spec, tokenizer="printable", vocab_size=len(VOCAB),
                            max_position_embeddings=2048)
    return init_hf_checkpoint(out_dir, m, seed=0, tokenizer=tok)


def run(engine, tok, recheck: bool, turns: int) -> dict:
    from mgrpo.agent.runner import AgentRunner
    from mgrpo.agent.tools import ToolSet
    from mgrpo.config.schema import DataConfig, MultiTurnConfig
    from mgrpo.data.synthetic import peek_records
    from mgrpo.rollout.types import GenerateRequest, SamplingParams

    tools = ToolSet.from_config([], "configs/tools/peek.yaml")
    cfg = MultiTurnConfig(enable=True, tool_config_path="configs/tools/peek.yaml", max_assistant_turns=turns,
                          max_tokens_per_turn=TOKENS_PER_TURN, tool_choice="required", reset_tool_choice=False,
                          stop_after_call=True, recheck_routes=recheck)
    runner = AgentRunner(cfg, tok, tools, max_response_length=turns * 200)
    records = peek_records(DataConfig())[:TRAJECTORIES]
    prompts = [(tok(tok.apply_chat_template(r["prompt"], tools=tools.schemas(list(tools.tools)), tokenize=False,
                                            add_generation_prompt=True), add_special_tokens=False)["input_ids"],
                r["extra_info"], f"record {i}") for i, r in enumerate(records)]
    wire = {"chars": 0, "rows": 0, "posts": 0}
    post = engine.client.post

    def counting(path, body, **kw):
        resp = post(path, body, **kw)
        if path == "/generate":
            items = resp.json()
            for it in items if isinstance(items, list) else [items]:
                raw = (it.get("meta_info") or {}).get("routed_experts") or ""
                wire["chars"] += len(raw)
            wire["posts"] += 1
        return resp

    def generate(ids, params, sessions=None, seeds=None, routes_from=None):
        reqs = [GenerateRequest(uid=i, prompt_ids=p, seed=None if seeds is None else seeds[i],
                                routes_from=0 if routes_from is None else routes_from[i]) for i, p in enumerate(ids)]
        out = engine.generate(reqs, params)
        wire["rows"] += sum(r.routed_experts.shape[0] for r in out)
        return out, {}

    engine.client.post = counting
    try:
        t0 = time.perf_counter()
        trajs, metrics = runner.run(prompts, SamplingParams(temperature=1.0, max_new_tokens=turns * 200, seed=1,
                                                            return_routed_experts=True), generate)
        seconds = time.perf_counter() - t0
    finally:
        engine.client.post = post
    assert not any(t.failed or t.routes_missing for t in trajs), [(t.finish_reason, t.counts.get("generation_error"))
                                                                  for t in trajs][:2]
    n = len(trajs)
    return {"mode": "whole_sequence_per_turn" if recheck else "start_len_per_turn", "trajectories": n,
            "turns_mean": sum(t.counts.get("turns", 0) for t in trajs) / n,
            "finish": {k: sum(t.finish_reason == k for t in trajs) for k in {t.finish_reason for t in trajs}},
            "length_mean": sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs) / n,
            "route_rows_per_trajectory": wire["rows"] / n,
            "route_rows_needed_per_trajectory": sum(len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs) / n,
            "route_bytes_per_trajectory": wire["chars"] / n,
            "metric_route_rows_received": metrics["multi_turn/route_rows_received"],
            "route_rows_recomputed_differ": metrics.get("multi_turn/route_rows_recomputed_differ"),
            "generate_posts": wire["posts"], "seconds": seconds,
            "response_ids": [t.response_ids for t in trajs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=TURNS)
    add_output_args(p, "agent_route_bytes_cpu.json")
    args = p.parse_args()
    from mgrpo.data.printable import printable_tokenizer
    from mgrpo.rollout.sglang import SGLangEngine

    tok = printable_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = _checkpoint(os.path.join(tmp, "moe"), tok)
        engine = SGLangEngine.launch(ckpt, host="127.0.0.1", startup_timeout_s=300, log_dir=os.path.join(tmp, "logs"),
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}, return_routed_experts=True)
        try:
            rows = [run(engine, tok, recheck, args.turns) for recheck in (True, False)]
        finally:
            engine.shutdown()
    same = rows[0].pop("response_ids") == rows[1].pop("response_ids")
    for r in rows:
        r["same_tokens_both_modes"] = same
    rows[1]["bytes_ratio_whole_over_start_len"] = rows[0]["route_bytes_per_trajectory"] / \
        rows[1]["route_bytes_per_trajectory"]
    out = output_path(args, "agent_route_bytes_cpu.json")
    with open(out, "w") as f:
        json.dump({"machine": os.uname().nodename, "turns": args.turns, "trajectories": TRAJECTORIES,
                   "tokens_per_turn": TOKENS_PER_TURN, "results": rows}, f, indent=1)
    with open(out.removesuffix(".json") + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[1]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
