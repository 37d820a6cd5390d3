"""mgrpo-convert: model checkpoints between Hugging Face and Megatron's distributed format.

    mgrpo-convert hf-to-megatron --hf-dir D --out O --tp N --pp M [--ep E] [--dtype auto|float32|bfloat16]
    mgrpo-convert megatron-to-hf --ckpt O --out D2 [--tp N --pp M --ep E] [--max-shard-gb G]

hf-to-megatron spawns pp*lcm(tp, ep) ranks (gloo on CPU, NCCL on GPU), each loading only its slices of
the safetensors (an expert-parallel rank only its own experts), and writes a megatron distributed
checkpoint plus `mgrpo_model.json` (the ModelConfig, the layout and dtype it was written with) and the
source's tokenizer files under `O/tokenizer/`. megatron-to-hf loads that checkpoint at any TP/PP/EP
layout (default: the one it was written with) and streams it to an HF directory that transformers
loads (every expert under its own name). Expert-parallel ranks are carved out of tp x data-parallel
ranks, as in training: --ep beyond --tp adds data-parallel replicas of the dense weights. The source is
checked (files, config, tensor names and shapes, parallel sizes) before any process is spawned. The
model family (qwen3, qwen3_moe) comes from config.json's `model_type`, and is recorded in
`mgrpo_model.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from typing import Optional

from mgrpo.training.spawn import spawn_ranks

MODEL_JSON = "mgrpo_model.json"
TOKENIZER_SUBDIR = "tokenizer"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class ConvertError(Exception):
    """Bad input, reported as one message before any rank starts."""


# ---------------------------------------------------------------------------------------------
# ranks (spawned with mgrpo.training.spawn.spawn_ranks)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def _build(cfg, ctx, dtype: str):
    from mgrpo.models.gpt import build_gpt_model, transformer_config

    tf = transformer_config(cfg, tp=ctx.tp, pp=ctx.pp, ep=ctx.ep, use_cpu=ctx.device.type == "cpu",
                            params_dtype=_torch_dtype(dtype))
    model = build_gpt_model(cfg, tf, pre_process=ctx.is_first_stage, post_process=ctx.is_last_stage,
                            pg_collection=ctx.pg_collection)
    return model.to(ctx.device)


def _progress(ctx, total: int, desc: str, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", position=ctx.pp_rank, disable=not show, leave=True,
                file=sys.stderr)


def world_size(tp: int, pp: int, ep: int = 1) -> int:
    """Ranks of a conversion: one model replica, or as many as expert parallelism needs (its ranks come
    out of tp x data-parallel)."""
    return pp * math.lcm(tp, ep)


def _rank_hf_to_megatron(rank, world_size, port, cfg, hf_dir, out, tp, pp, ep, dtype):
    from mgrpo.models import load_hf_into_megatron, save_megatron_checkpoint
    from mgrpo.training.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, tp=tp, pp=pp,
                        ep=ep)
    model = _build(cfg, ctx, dtype)
    n = sum(1 for p in model.parameters() if p.numel())
    with _progress(ctx, n, f"load stage {ctx.pp_rank}", show=ctx.tp_rank == 0 and ctx.dp_rank == 0) as bar:
        load_hf_into_megatron(model, hf_dir, cfg, tp_rank=ctx.tp_rank, tp_size=tp, pp_rank=ctx.pp_rank, pp_size=pp,
                              on_weight=lambda _: bar.update())
    save_megatron_checkpoint(model, out)
    destroy_parallel()
    return n


def _rank_megatron_to_hf(rank, world_size, port, cfg, ckpt, out, tp, pp, ep, dtype, tokenizer_dir, max_shard_bytes):
    from mgrpo.models import family_of, iter_megatron_to_hf, load_megatron_checkpoint, save_hf_checkpoint_distributed
    from mgrpo.training.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, tp=tp, pp=pp,
                        ep=ep)
    model = _build(cfg, ctx, dtype)
    load_megatron_checkpoint(model, ckpt)
    layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    n = sum(len(w.hf) for w in family_of(cfg).stage_weights(cfg, layers=layers, pre_process=ctx.is_first_stage,
                                                            post_process=ctx.is_last_stage) if w.export)
    writer = ctx.is_weight_source
    experts = family_of(cfg).has_experts and ctx.exports_experts
    with _progress(ctx, n, f"write stage {ctx.pp_rank}", show=writer) as bar:
        # the writer's TP group gathers the dense weights, its expert-parallel group every expert to it
        named = (iter_megatron_to_hf(model, cfg, tp_group=ctx.tp_group, tp_size=tp, pp_rank=ctx.pp_rank, pp_size=pp,
                                     ep_group=ctx.ep_group, ep_size=ep, dense=ctx.exports_weights, experts=experts)
                 if ctx.exports_weights or experts else iter(()))
        save_hf_checkpoint_distributed(out, named, cfg, writer=writer, stage=ctx.pp_rank, tokenizer_dir=tokenizer_dir,
                                       max_shard_bytes=max_shard_bytes, on_tensor=lambda *_: bar.update())
    destroy_parallel()
    return n


# ---------------------------------------------------------------------------------------------
# checks before spawning


def _check_layout(cfg, tp: int, pp: int, ep: int = 1) -> None:
    errors = []
    for name, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if value < 1:
            errors.append(f"{name}={value} must be >= 1")
    if tp >= 1:
        # a MoE model has no dense MLP to split, and TP never splits its experts
        fields = ("num_attention_heads", "num_query_groups") + (() if cfg.num_experts else ("ffn_hidden_size",))
        for field in fields:
            if getattr(cfg, field) % tp:
                errors.append(f"--tp={tp} does not divide model {field}={getattr(cfg, field)}")
    if pp >= 1 and cfg.num_layers % pp:
        errors.append(f"--pp={pp} does not divide model num_layers={cfg.num_layers}")
    if ep > 1 and not cfg.num_experts:
        errors.append(f"--ep={ep} splits experts, but model family {cfg.family!r} has none")
    elif ep >= 1 and cfg.num_experts and cfg.num_experts % ep:
        errors.append(f"--ep={ep} does not divide model num_experts={cfg.num_experts}")
    if errors:
        raise ConvertError("; ".join(errors))


def _prepare_out(out: str, force: bool) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        if not force:
            raise ConvertError(f"--out {out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    os.makedirs(out, exist_ok=True)


def _source_dtype(hf_dir: str) -> str:
    from mgrpo.models.hf_io import read_hf_config

    raw = read_hf_config(hf_dir)
    name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    return DTYPES.get(name, "float32")


def hf_to_megatron(hf_dir: str, out: str, tp: int, pp: int, dtype: str = "auto", force: bool = False,
                   ep: int = 1) -> dict:
    from mgrpo.models import model_config_from_hf
    from mgrpo.models.hf_io import GENERATION_CONFIG, TOKENIZER_FILES, SafetensorsCheckpoint, check_hf_tensors

    try:
        cfg = model_config_from_hf(hf_dir)
        problems = check_hf_tensors(SafetensorsCheckpoint(hf_dir), cfg)
    except (ValueError, FileNotFoundError) as e:
        raise ConvertError(str(e)) from e
    if problems:
        raise ConvertError(f"{hf_dir} does not hold the model its config.json describes:\n  - " + "\n  - ".join(problems))
    _check_layout(cfg, tp, pp, ep)
    dtype = _source_dtype(hf_dir) if dtype == "auto" else DTYPES[dtype]
    _prepare_out(out, force)

    spawn_ranks(_rank_hf_to_megatron, world_size(tp, pp, ep), cfg, hf_dir, out, tp, pp, ep, dtype)

    tok_files = [f for f in TOKENIZER_FILES + (GENERATION_CONFIG,) if os.path.exists(os.path.join(hf_dir, f))]
    if tok_files:
        os.makedirs(os.path.join(out, TOKENIZER_SUBDIR), exist_ok=True)
        for f in tok_files:
            shutil.copyfile(os.path.join(hf_dir, f), os.path.join(out, TOKENIZER_SUBDIR, f))
        shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(out, TOKENIZER_SUBDIR, "config.json"))
    meta = {"format": "megatron-core dist_checkpointing (torch_dist), model weights only",
            "model": dataclasses.asdict(cfg), "tp": tp, "pp": pp, "ep": ep, "dtype": dtype,
            "source": os.path.abspath(hf_dir),
            "tokenizer_dir": TOKENIZER_SUBDIR if tok_files else None}
    with open(os.path.join(out, MODEL_JSON), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def read_model_json(ckpt: str):
    """(ModelConfig, metadata) of a checkpoint written by hf-to-megatron."""
    from mgrpo.config import ModelConfig

    path = os.path.join(ckpt, MODEL_JSON)
    if not os.path.isdir(ckpt):
        raise ConvertError(f"--ckpt {ckpt} does not exist")
    if not os.path.exists(path):
        raise ConvertError(f"{ckpt} has no {MODEL_JSON}: not written by `mgrpo-convert hf-to-megatron`")
    if not os.path.exists(os.path.join(ckpt, "metadata.json")):
        raise ConvertError(f"{ckpt} has no metadata.json: not a megatron distributed checkpoint")
    with open(path) as f:
        meta = json.load(f)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(meta.get("model", {})) - fields)
    if unknown:
        raise ConvertError(f"{path}: model fields {unknown} are not ModelConfig fields")
    return ModelConfig(**meta["model"]), meta


def megatron_to_hf(ckpt: str, out: str, tp: Optional[int] = None, pp: Optional[int] = None,
                   max_shard_bytes: int = 2**30, force: bool = False, ep: Optional[int] = None) -> dict:
    cfg, meta = read_model_json(ckpt)
    tp = tp or meta["tp"]
    pp = pp or meta["pp"]
    ep = ep or meta.get("ep", 1)
    _check_layout(cfg, tp, pp, ep)
    if os.path.abspath(out) == os.path.abspath(ckpt):
        raise ConvertError("--out must differ from --ckpt")
    _prepare_out(out, force)
    tok = os.path.join(ckpt, meta["tokenizer_dir"]) if meta.get("tokenizer_dir") else None
    spawn_ranks(_rank_megatron_to_hf, world_size(tp, pp, ep), cfg, ckpt, out, tp, pp, ep, meta["dtype"], tok,
                max_shard_bytes)
    return {"tp": tp, "pp": pp, "ep": ep, "out": out}


# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mgrpo-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF safetensors directory -> megatron distributed checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--tp", type=int, default=1)
    a.add_argument("--pp", type=int, default=1)
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    a.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="parameter dtype of the megatron model (auto: config.json's dtype)")
    a.add_argument("--force", action="store_true", help="replace a non-empty --out")
    b = sub.add_parser("megatron-to-hf", help="megatron distributed checkpoint -> HF safetensors directory")
    b.add_argument("--ckpt", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--tp", type=int, default=None, help="layout to load at (default: the one it was saved with)")
    b.add_argument("--pp", type=int, default=None)
    b.add_argument("--ep", type=int, default=None)
    b.add_argument("--max-shard-gb", type=float, default=1.0, help="safetensors shard size")
    b.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "hf-to-megatron":
            meta = hf_to_megatron(args.hf_dir, args.out, args.tp, args.pp, args.dtype, args.force, args.ep)
            print(f"wrote megatron checkpoint {args.out} (tp={meta['tp']} pp={meta['pp']} ep={meta['ep']} "
                  f"dtype={meta['dtype']})")
        else:
            if args.max_shard_gb <= 0:
                raise ConvertError(f"--max-shard-gb={args.max_shard_gb} must be positive")
            res = megatron_to_hf(args.ckpt, args.out, args.tp, args.pp, int(args.max_shard_gb * 2**30), args.force,
                                 args.ep)
            print(f"wrote HF checkpoint {res['out']} (loaded at tp={res['tp']} pp={res['pp']} ep={res['ep']})")
    except ConvertError as e:
        print(f"mgrpo-convert {args.command}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"mgrpo-convert {args.command}: {e}", file=sys.stderr)
        if not getattr(e, "expected", True):
            print(e.rank_traceback, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
