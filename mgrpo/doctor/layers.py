"""`mgrpo-doctor layers`: one sequence through the engine's model and the trainer's, compared layer by layer.

    mgrpo-doctor layers --engine <hf dir> [--trainer <hf dir | run checkpoint | mgrpo-convert checkpoint>]
                        (--trajectory <trajectories.jsonl> --line N | --tokens 1,2,3,... --prompt-len K)
                        [--engine-dtype float32|bfloat16] [--temperature T] [--tolerance X]
                        [--engine-support full|sampled] [--trainer-support full|sampled] [--top-k K] [--top-p P]

The engine side is the HF directory as the engines load it (`engine_side.py`); the trainer side defaults to the
same directory through megatron-core (`trainer_side.py`), or a run's checkpoint / `hf/` export, so a
conversion fault shows too. Both hook the embeddings, each layer's attention and MLP outputs, the final norm,
the logits and the response tokens' log-probs; `compare.py` names the first place where they part.
"""

from __future__ import annotations

import os
from typing import Optional

from mgrpo.doctor import DoctorError
from mgrpo.doctor.compare import canonical, compare, render_sites, verdict_line
from mgrpo.doctor.engine_side import Support, engine_trace
from mgrpo.doctor.trajectories import read_line
from mgrpo.doctor.trainer_side import check_tokens, resolve_trainer, trainer_trace


SOURCES = {"hf": "an HF directory", "run": "a run's checkpoint", "megatron": "an mgrpo-convert checkpoint"}


def parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise DoctorError(f"--tokens {text!r}: token ids are integers separated by commas") from None


def sequence(*, tokens: Optional[str], prompt_len: Optional[int], trajectory: Optional[str],
             line: Optional[int]) -> tuple[list[int], int, Optional[dict]]:
    """(token ids, prompt length, the trajectory line's recorded log-probs or None) from the arguments."""
    if (tokens is None) == (trajectory is None):
        raise DoctorError("give the sequence either as --trajectory FILE --line N or as --tokens IDS --prompt-len K")
    if trajectory is not None:
        if line is None:
            raise DoctorError("--trajectory needs --line N (the 1-based line; mgrpo-doctor run names the worst)")
        t = read_line(trajectory, line)
        return t.prompt_ids + t.response_ids, len(t.prompt_ids), {
            "where": f"{trajectory}:{line}", "step": t.step, "engine": t.engine, "rollout": t.rollout,
            "trainer": t.trainer}
    if prompt_len is None:
        raise DoctorError("--tokens needs --prompt-len K (how many of the ids are the prompt)")
    return parse_tokens(tokens), prompt_len, None


def layers(engine_dir: str, *, trainer: Optional[str] = None, tokens: Optional[str] = None,
           prompt_len: Optional[int] = None, trajectory: Optional[str] = None, line: Optional[int] = None,
           engine_dtype: str = "float32", trainer_dtype: str = "float32", temperature: float = 1.0,
           engine_support: Support = Support(), trainer_support: Support = Support(),
           tolerance: Optional[float] = None) -> dict:
    """The comparison as plain data (what `render` prints and `--json` writes)."""
    from mgrpo.models.hf_config import read_hf_config

    if not os.path.isfile(os.path.join(engine_dir, "config.json")):
        raise DoctorError(f"--engine {engine_dir} is not an HF directory (no config.json)")
    engine_dtype, trainer_dtype = canonical(engine_dtype), canonical(trainer_dtype)
    ids, plen, recorded = sequence(tokens=tokens, prompt_len=prompt_len, trajectory=trajectory, line=line)
    source = resolve_trainer(trainer or engine_dir)
    engine_cfg = read_hf_config(engine_dir)
    for vocab, who in ((engine_cfg.get("vocab_size", 0), f"--engine {engine_dir}"),
                       (source.model.vocab_size, f"--trainer {source.path}")):
        problem = check_tokens(ids, plen, int(vocab), who)
        if problem:
            raise DoctorError(problem)
    if engine_cfg.get("num_hidden_layers") != source.model.num_layers:
        raise DoctorError(f"the engine has {engine_cfg.get('num_hidden_layers')} layers ({engine_dir}), the trainer "
                          f"{source.model.num_layers} ({source.path}): not the same architecture")
    theirs = trainer_trace(source, ids, plen, temperature=temperature, dtype=trainer_dtype, support=trainer_support)
    ours = engine_trace(engine_dir, ids, plen, dtype=engine_dtype, temperature=temperature, support=engine_support,
                        vocab_size=source.model.vocab_size)
    result = compare(ours, theirs, engine_dtype=engine_dtype, trainer_dtype=trainer_dtype, tolerance=tolerance)
    out = {"engine": os.path.abspath(engine_dir), "engine_dtype": engine_dtype, "trainer": source.path,
           "trainer_kind": source.kind, "trainer_dtype": trainer_dtype, "temperature": temperature,
           "engine_support": str(engine_support), "trainer_support": str(trainer_support),
           "ids": ids, "prompt_len": plen, "comparison": result,
           "verdict": verdict_line(result, ids, plen) + support_hint(result, engine_support, trainer_support),
           "logprobs": {"engine": ours["log-probs"].tolist(), "trainer": theirs["log-probs"].tolist()}}
    if recorded is not None:
        out["recorded"] = recorded
    return out


def support_hint(c: dict, engine: Support, trainer: Support) -> str:
    """Why the log-probs alone part: the two sides normalise over different supports (or, with the same
    support, the log-prob computation itself: temperature, kernel)."""
    if c["parts_at"] != "log-probs":
        return ""
    if engine != trainer:
        return (f"\nSUPPORT MISMATCH: every layer and the logits agree; the engine's log-probs are over {engine}, "
                f"the trainer's over {trainer}. Make them the same: algorithm.logprob_support=sampled (the trainer "
                "renormalises over the engine's supports) or sample from the whole distribution")
    return ("\nevery layer and the logits agree, the log-probs do not: the log-prob computation differs "
            "(the temperature each side divides by, or the kernel)")


def render(r: dict) -> str:
    c = r["comparison"]
    out = [f"mgrpo-doctor layers: {len(r['ids'])} tokens ({r['prompt_len']} prompt, "
           f"{len(r['ids']) - r['prompt_len']} response) at temperature {r['temperature']:g}",
           f"  engine  {r['engine']} (transformers, {r['engine_dtype']})",
           f"  trainer {r['trainer']} (megatron-core GPTModel from {SOURCES[r['trainer_kind']]}, "
           f"{r['trainer_dtype']}, log-probs through mgrpo_kernels)",
           f"  log-prob support: engine {r['engine_support']}, trainer {r['trainer_support']}",
           f"  tolerance {c['tolerance']:g} relative for {c['dtype']} (a site parts at >= {c['jump']:g}x every site "
           f"before it)", "", render_sites(c), "", r["verdict"]]
    lp = r["logprobs"]
    rows = [f"  {'token':>8} {'engine (here)':>14} {'trainer (here)':>15}"]
    rec = r.get("recorded")
    if rec:
        rows[0] += f" {'engine (run)':>13} {'trainer (run)':>14}"
    for k, (a, b) in enumerate(zip(lp["engine"], lp["trainer"])):
        row = f"  {r['ids'][r['prompt_len'] + k]:>8} {a:14.7g} {b:15.7g}"
        if rec:
            row += f" {rec['rollout'][k]:13.7g} {rec['trainer'][k]:14.7g}"
        rows.append(row)
    out += ["", "response log-probs" + (f" (the run's, from {rec['where']}, step {rec['step']}, engine {rec['engine']}: "
                                        "equal to these only on the same weights)" if rec else "")] + rows[:33]
    if len(rows) > 33:
        out.append(f"  ... {len(rows) - 33} more")
    return "\n".join(out)
