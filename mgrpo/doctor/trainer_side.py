"""The trainer's side of `mgrpo-doctor layers`: one sequence through megatron-core's GPTModel, every layer hooked.

The model is the trainer's own: `models/gpt.py` builds it (local spec on CPU, the reference core attention),
`models/hf_checkpoint.py` fills it from an HF directory, `training/checkpoint.py` from a run's checkpoint
(`checkpoints/step_N`: its weights only; the model config is the fingerprint it stores), or
`models/megatron_ckpt.py` from an `mgrpo-convert` checkpoint (`mgrpo_model.json`). The response log-probs come from the final norm's output through the trainer's kernel
(`mgrpo_kernels.linear_logprobs`, chunked), as `training/forward.py` computes them. It runs on one CPU rank in a
spawned process (`training/spawn.py`), so megatron's global state and CPU patches never touch the caller's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional

from mgrpo.config import ModelConfig
from mgrpo.doctor import DoctorError
from mgrpo.doctor.engine_side import Support

MODEL_JSON = "mgrpo_model.json"
"""What `mgrpo-convert hf-to-megatron` writes next to its checkpoint (the ModelConfig under "model")."""


@dataclass
class TrainerSource:
    kind: str
    """'hf' (an HF directory), 'run' (a run's checkpoint: weights, optimizer, schedule) or 'megatron' (the
    weights-only distributed checkpoint mgrpo-convert writes)."""
    path: str
    """The directory loaded."""
    model: ModelConfig


def _model_from(fields: dict, where: str) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise DoctorError(f"{where}: model fields {unknown} are not ModelConfig fields")
    return ModelConfig(**fields)


def resolve_trainer(path: str) -> TrainerSource:
    """What `--trainer` names: an HF directory (config.json), a run's checkpoint folder (trainer_state.json and
    megatron/), or an mgrpo-convert checkpoint (mgrpo_model.json)."""
    from mgrpo.models import model_config_from_hf

    if not os.path.isdir(path):
        raise DoctorError(f"--trainer {path} does not exist")
    state = os.path.join(path, "trainer_state.json")
    if os.path.isfile(state):
        with open(state) as f:
            try:
                config = json.load(f).get("config") or {}
            except json.JSONDecodeError as e:
                raise DoctorError(f"{state}: not valid JSON ({e})") from None
        fields = {k[len("model."):]: v for k, v in config.items() if k.startswith("model.")}
        if not fields:
            raise DoctorError(f"{state} stores no model config (a checkpoint written before fingerprints)")
        return TrainerSource("run", os.path.join(path, "megatron"), _model_from(fields, state))
    meta = os.path.join(path, MODEL_JSON)
    if os.path.isfile(meta):
        with open(meta) as f:
            return TrainerSource("megatron", path, _model_from(json.load(f).get("model", {}), meta))
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            return TrainerSource("hf", path, model_config_from_hf(path))
        except (ValueError, FileNotFoundError) as e:
            raise DoctorError(str(e)) from None
    raise DoctorError(f"--trainer {path} is neither an HF directory (config.json), a run's checkpoint "
                      f"(trainer_state.json) nor an mgrpo-convert checkpoint ({MODEL_JSON})")


def _rank(rank, world_size, port, source: TrainerSource, ids, prompt_len, temperature, dtype, support):
    from mgrpo.training.cpu_compat import lean_megatron_import, quiet_megatron_warnings

    lean_megatron_import()  # a fresh process: megatron-core as a Megatron rank imports it (no torch.compile)
    quiet_megatron_warnings()
    import torch

    import mgrpo_kernels
    from mgrpo.doctor.engine_side import sites, torch_dtype
    from mgrpo.models import build_gpt_model, load_hf_into_megatron, load_megatron_checkpoint, transformer_config
    from mgrpo.training.checkpoint import load_model_weights
    from mgrpo.training.forward import output_weight
    from mgrpo.training.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, tp=1, pp=1)
    try:
        cfg = source.model
        tf = transformer_config(cfg, use_cpu=True, params_dtype=torch_dtype(dtype))
        gpt = build_gpt_model(cfg, tf, pre_process=True, post_process=True, pg_collection=ctx.pg_collection).eval()
        if source.kind == "hf":
            load_hf_into_megatron(gpt, source.path, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        elif source.kind == "run":
            load_model_weights(gpt, source.path)
        else:
            load_megatron_checkpoint(gpt, source.path)
        captured: dict = {}

        def keep(name):
            def hook(_module, _inputs, out):
                out = out[0] if isinstance(out, tuple) else out
                # a copy: megatron adds the residual in place into the tensor the module returned
                captured[name] = out.detach()[:, 0].clone()  # [positions, batch of one, features] -> [positions, features]
            return hook

        modules = [("embeddings", gpt.embedding)]
        for i, layer in enumerate(gpt.decoder.layers):
            modules += [(f"layer {i} attention", layer.self_attention), (f"layer {i} mlp", layer.mlp)]
        modules += [("final norm", gpt.decoder.final_layernorm), ("logits", gpt.output_layer)]
        hooks = [m.register_forward_hook(keep(name)) for name, m in modules]
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            gpt(x, torch.arange(len(ids))[None], None)
        for h in hooks:
            h.remove()
        vocab = cfg.vocab_size
        captured["logits"] = captured["logits"][:, :vocab]
        labels = torch.tensor(ids[prompt_len:], dtype=torch.long)
        hidden = captured["final norm"][prompt_len - 1:len(ids) - 1]
        with torch.no_grad():
            # the trainer's own path: the chunked kernel on the final hidden states, over the supports the
            # trainer's logits give (under top-k / top-p; both sides cut their own logits alike)
            offsets, support_ids = support.csr(captured["logits"][prompt_len - 1:len(ids) - 1], temperature)
            lp, _ = mgrpo_kernels.linear_logprobs(hidden, output_weight(gpt), labels, temperature=temperature or 1.0,
                                                  vocab_size=vocab, compute_entropy=False, impl="chunked",
                                                  support_offsets=offsets, support_ids=support_ids)
        out = {name: captured[name].double().numpy() for name, _ in modules}
        out["log-probs"] = lp.double().numpy()
        assert list(out) == sites(len(gpt.decoder.layers))
        return out
    finally:
        destroy_parallel()


def trainer_trace(source: TrainerSource, ids: list[int], prompt_len: int, *, temperature: float = 1.0,
                  dtype: str = "float32", support: Support = Support()) -> dict:
    """{site: float64 array} for `ids` through the trainer's model (see `engine_side.engine_trace`)."""
    from mgrpo.training.spawn import RankError, spawn_ranks

    try:
        return spawn_ranks(_rank, 1, source, list(ids), prompt_len, temperature, dtype, support, threads=None)[0]
    except RankError as err:
        if err.expected:  # a checkpoint that does not fit the model, a missing file: the rank says which
            raise DoctorError(f"the trainer's model: {str(err).split(': ', 1)[-1]}") from None
        raise RuntimeError(f"{err}\n{err.rank_traceback}") from None


def check_tokens(ids: list[int], prompt_len: int, vocab_size: int, where: str) -> Optional[str]:
    """A problem with the tokens given to `layers`, named, or None."""
    if prompt_len < 1 or prompt_len >= len(ids):
        return f"{where}: the prompt length must be in 1..{len(ids) - 1} (one response token at least), got {prompt_len}"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"{where}: token ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})"
    return None
