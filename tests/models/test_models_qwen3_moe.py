"""The qwen3_moe model family against transformers' own Qwen3MoeForCausalLM: routing (megatron's router
function vs transformers' router, both norm_topk_prob settings), parameter counts of the released
architectures, config.json both ways and what is refused by name, the checkpoint names of transformers'
in-memory experts (fused in 5.x, modules in 4.x), logits at TP / PP / EP layouts, and the bit-exact
HF -> Megatron -> HF round trip through mgrpo-convert at TP x PP x EP."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from mgrpo.config import ModelConfig
from mgrpo.models.registry import FAMILIES, family_of, param_counts
from tests.helpers import ROOT
from tests.helpers.distributed import run_ranks
from tests.helpers.convert import hf_state, init_rank, layout_kwargs, megatron_logits, token_ids, tiny_cfg


def odd_cfg(**kw) -> ModelConfig:
    """An odd shape: 6 query heads of width 20 over 2 key/value heads on a hidden size of 48, 4 layers,
    vocabulary 100 (padded), untied, 6 experts of width 36, 2 per token."""
    base = dict(family="qwen3_moe", name="odd-moe", vocab_size=100, hidden_size=48, num_layers=4,
                num_attention_heads=6, num_query_groups=2, head_dim=20, ffn_hidden_size=52,
                tie_word_embeddings=False, init_std=0.1, max_position_embeddings=64, rope_theta=10000.0,
                num_experts=6, moe_ffn_hidden_size=36, moe_router_topk=2)
    base.update(kw)
    return ModelConfig(**base)


def make_moe_checkpoint(out_dir: str, cfg: ModelConfig, seed: int = 0) -> str:
    """transformers' Qwen3MoeForCausalLM with every tensor random (norms around 1) via save_pretrained."""
    from transformers import Qwen3MoeForCausalLM

    from mgrpo.models.qwen3_moe import hf_config

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config(cfg)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------
# routing


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_routing_equals_transformers_router(norm_topk_prob):
    """megatron's topk_routing_with_score_function with the family's settings gives each token the
    experts and weights transformers' Qwen3MoeTopKRouter gives it."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from mgrpo.models.qwen3_moe import hf_config, megatron_config

    cfg = odd_cfg(num_experts=8, moe_router_topk=3, norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(hf_config(cfg))
    torch.nn.init.normal_(router.weight, std=0.05)
    hidden = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, experts = router(hidden)
    want = torch.zeros(64, cfg.num_experts).scatter(1, experts, weights)
    mc = megatron_config(cfg)
    assert mc["moe_router_pre_softmax"] is (not norm_topk_prob) and mc["moe_router_dtype"] == "fp32"
    probs, routing_map = topk_routing_with_score_function(logits, mc["moe_router_topk"],
                                                          use_pre_softmax=mc["moe_router_pre_softmax"],
                                                          score_function=mc["moe_router_score_function"])
    assert torch.equal(routing_map, want > 0)
    assert (probs - want).abs().max().item() < 1e-6
    sums = probs.sum(-1)
    if norm_topk_prob:
        assert torch.allclose(sums, torch.ones_like(sums))
    else:
        assert (sums < 1 - 1e-3).all()  # the top 3 of 8 keep their share of the whole softmax


# ---------------------------------------------------------------------------------------------
# sizes and configs


def test_param_counts_equal_transformers_for_the_released_architectures():
    from transformers import Qwen3MoeForCausalLM

    from mgrpo.models.qwen3_moe import hf_config
    from mgrpo_launchers.plan import compose_config

    presets = {name: compose_config([f"model={name}"]).model for name in ("tiny-moe", "qwen3-30b-a3b", "qwen3-235b-a22b")}
    for name, m in list(presets.items()) + [("odd", odd_cfg())]:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(hf_config(m))
        assert param_counts(m)["hf_total"] == sum(p.numel() for p in model.parameters()), name
        assert set(family_of(m).hf_shapes(m)) == set(family_of(m).hf_named_tensors(model)), name
    assert param_counts(presets["qwen3-30b-a3b"])["hf_total"] == 30_532_122_624  # "30.5B"
    assert param_counts(presets["qwen3-235b-a22b"])["hf_total"] == 235_093_634_560  # "235B"
    # experts split over EP, never over TP; attention over TP
    c1, c8 = param_counts(presets["qwen3-30b-a3b"]), param_counts(presets["qwen3-30b-a3b"], tp=2, ep=8)
    assert c8["expert_per_rank_by_stage"][0] * 8 == c1["expert_per_rank_by_stage"][0] == c1["expert_total"]


def test_config_json_both_ways_and_refusals(tmp_path):
    from mgrpo.models import check_hf_config, init_hf_checkpoint, model_config_from_hf

    cfg = odd_cfg(norm_topk_prob=False, router_aux_loss_coef=0.02)
    hf_dir = init_hf_checkpoint(str(tmp_path / "moe"), cfg, seed=1)
    with open(os.path.join(hf_dir, "config.json")) as f:
        raw = json.load(f)
    assert (raw["model_type"], raw["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    back = model_config_from_hf(hf_dir)
    for field in ("family", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "norm_topk_prob",
                  "router_aux_loss_coef", "head_dim", "ffn_hidden_size", "num_query_groups"):
        assert getattr(back, field) == getattr(cfg, field), field
    check_hf_config(hf_dir, cfg)
    with pytest.raises(ValueError, match=r"config.json num_experts=6 but model.num_experts=4"):
        check_hf_config(hf_dir, dataclasses.replace(cfg, num_experts=4))
    with pytest.raises(ValueError, match=r"model_type='qwen3_moe', expected 'qwen3'"):
        check_hf_config(hf_dir, dataclasses.replace(cfg, family="qwen3"))

    def refused(**changes) -> str:
        bad = str(tmp_path / f"bad{len(os.listdir(tmp_path))}")
        shutil.copytree(hf_dir, bad)
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump({**raw, **changes}, f)
        with pytest.raises(ValueError) as info:
            model_config_from_hf(bad)
        return str(info.value)

    assert "mlp_only_layers=[1]: dense MLP layers among the MoE layers are not supported" in refused(mlp_only_layers=[1])
    assert "decoder_sparse_step=2: only every layer sparse (1) is supported" in refused(decoder_sparse_step=2)
    assert "has shared experts (shared_expert_intermediate_size" in refused(shared_expert_intermediate_size=64)


def test_validation_names_bad_moe_configs():
    """Field-local checks (mgrpo.config.validate) and the family's own (mgrpo.preflight asks it)."""
    from mgrpo.config import ActorConfig, ConfigError, MGRPOConfig, TrainerConfig
    from mgrpo.preflight import preflight

    def validate(cfg, check_files=False):
        return preflight(cfg, check_files=check_files, check_memory=False).layout

    def errors(model=None, **actor) -> str:
        cfg = MGRPOConfig(model=model or odd_cfg(), actor=ActorConfig(**actor), trainer=TrainerConfig(device="cpu"))
        with pytest.raises(ConfigError) as info:
            validate(cfg, check_files=False)
        return str(info.value)

    assert "actor.ep=4 does not divide model.num_experts=6" in errors(ep=4)
    assert "actor.ep=2 splits experts, but model.num_experts=0" in errors(model=tiny_cfg(), ep=2)
    assert "model.num_experts=6 but model.family='qwen3' is dense" in errors(
        model=dataclasses.replace(odd_cfg(), family="qwen3"))
    assert "model.moe_router_topk=1 with model.norm_topk_prob=true" in errors(model=odd_cfg(moe_router_topk=1))
    assert "model.moe_router_topk=7 must be in 1..model.num_experts=6" in errors(model=odd_cfg(moe_router_topk=7))
    cfg = MGRPOConfig(model=odd_cfg(), actor=ActorConfig(ep=3), trainer=TrainerConfig(device="cpu", n_gpus_per_node=4))
    with pytest.raises(ConfigError, match=r"actor.ep=3 does not divide the 4 ranks of a pipeline stage"):
        validate(cfg, check_files=False)
    # the default world is the fewest ranks the layout needs: EP=2 at TP=1 is two data-parallel ranks
    ok = MGRPOConfig(model=odd_cfg(), actor=ActorConfig(ep=2, pp=2), trainer=TrainerConfig(device="cpu"))
    assert validate(ok, check_files=False).megatron_world == 4
    # the MoE model's dense intermediate_size (config.json only) is not split by TP
    assert validate(MGRPOConfig(model=odd_cfg(), actor=ActorConfig(tp=2), trainer=TrainerConfig(device="cpu")),
                    check_files=False).megatron_world == 2


def test_checkpoint_names_of_transformers_experts():
    """transformers 5 fuses each layer's experts ([E, 2I, H] gate-then-up, [E, H, I]); the family names
    them per expert, as views: writing through a name changes the model. transformers 4.x keeps one
    module per expert under the checkpoint names already, which pass through."""
    import transformers
    from transformers import Qwen3MoeForCausalLM

    from mgrpo.models.qwen3_moe import hf_config, hf_named_tensors

    cfg = odd_cfg()
    model = Qwen3MoeForCausalLM(hf_config(cfg))
    named = hf_named_tensors(model)
    assert set(named) == set(family_of(cfg).hf_shapes(cfg))
    assert all(tuple(named[k].shape) == s for k, s in family_of(cfg).hf_shapes(cfg).items())
    mlp = model.model.layers[2].mlp
    fused = int(transformers.__version__.split(".")[0]) >= 5
    assert hasattr(mlp.experts, "gate_up_proj") is fused  # which transformers this is
    with torch.no_grad():
        named["model.layers.2.mlp.experts.4.up_proj.weight"].fill_(7.0)
        named["model.layers.2.mlp.experts.5.down_proj.weight"].fill_(3.0)
    if fused:
        assert (mlp.experts.gate_up_proj[4, 36:] == 7).all() and not (mlp.experts.gate_up_proj[4, :36] == 7).any()
        assert (mlp.experts.down_proj[5] == 3).all()

    class PerExpert(torch.nn.Module):  # transformers 4.x's layout: the checkpoint names are module paths
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(4, 3), torch.nn.Linear(4, 3),
                                                            torch.nn.Linear(3, 4))

    old = torch.nn.Module()
    old.model = torch.nn.Module()
    old.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    old.model.layers[0].mlp = torch.nn.Module()
    old.model.layers[0].mlp.experts = torch.nn.ModuleList([PerExpert(), PerExpert()])
    names = hf_named_tensors(old)
    assert "model.layers.0.mlp.experts.1.down_proj.weight" in names
    assert names["model.layers.0.mlp.experts.1.down_proj.weight"] is old.model.layers[0].mlp.experts[1].down_proj.weight


# ---------------------------------------------------------------------------------------------
# Megatron against transformers


def _rank_logits(rank, world, port, cfg, hf_dir, layouts):
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from mgrpo.models import load_hf_into_megatron
    from mgrpo.models.gpt import build_gpt_model, transformer_config
    from mgrpo.training.parallel import init_parallel

    ids = token_ids(cfg)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
    out = []
    for tp, pp, ep in layouts:
        ctx = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, tp=tp, pp=pp, ep=ep)
        tf = transformer_config(cfg, tp=tp, pp=pp, ep=ep, use_cpu=True)
        model = build_gpt_model(cfg, tf, pre_process=ctx.is_first_stage, post_process=ctx.is_last_stage,
                                pg_collection=ctx.pg_collection).eval()
        load_hf_into_megatron(model, hf_dir, cfg, **layout_kwargs(ctx))
        logits = megatron_logits(model, ctx, cfg, ids)
        out.append(None if logits is None else ((logits - ref).abs().max().item(), ref.abs().max().item(),
                                               sorted(model.decoder.layers[0].mlp.local_expert_indices)))
        ps.destroy_model_parallel()
    return out


@pytest.mark.system
def test_logits_match_transformers_at_tp_pp_ep(tmp_path):
    cfg = odd_cfg()
    hf_dir = make_moe_checkpoint(str(tmp_path / "hf"), cfg, seed=5)
    (one,) = run_ranks(_rank_logits, 1, cfg, hf_dir, [(1, 1, 1)])
    two = run_ranks(_rank_logits, 2, cfg, hf_dir, [(1, 1, 2), (2, 1, 2), (2, 1, 1), (1, 2, 1)])
    four = run_ranks(_rank_logits, 4, cfg, hf_dir, [(1, 2, 2), (2, 2, 2)], timeout_s=600)
    results = {"tp1": one[0]}
    for i, name in enumerate(("ep2", "tp2ep2", "tp2", "pp2")):
        results[name] = [r[i] for r in two]
    for i, name in enumerate(("pp2ep2", "tp2pp2ep2")):
        results[name] = [r[i] for r in four]
    assert one[0][1] > 1.0  # logits of a real size
    for name, res in results.items():
        for r in (res if isinstance(res, list) else [res]):
            if r is not None:
                assert r[0] < 1e-4, (name, r)
    # each EP rank holds its contiguous half of the experts
    assert sorted(r[2] for r in results["ep2"]) == [[0, 1, 2], [3, 4, 5]]


# ---------------------------------------------------------------------------------------------
# mgrpo-convert


@pytest.mark.system
def test_round_trip_bit_exact_through_the_cli_at_tp_pp_ep(tmp_path, capsys):
    from mgrpo_launchers.convert import main

    cfg = odd_cfg()
    hf = make_moe_checkpoint(str(tmp_path / "hf"), cfg, seed=7)
    mc = str(tmp_path / "mcore")
    assert main(["hf-to-megatron", "--hf-dir", hf, "--out", mc, "--tp", "2", "--pp", "2", "--ep", "2"]) == 0
    assert "tp=2 pp=2 ep=2" in capsys.readouterr().out
    meta = json.load(open(os.path.join(mc, "mgrpo_model.json")))
    assert (meta["model"]["family"], meta["model"]["num_experts"], meta["ep"]) == ("qwen3_moe", 6, 2)
    a = hf_state(hf)
    assert sum(".mlp.experts." in k for k in a) == 4 * 6 * 3
    # at the layout it was written with (the default), and resharded to three expert-parallel ranks
    for i, layout in enumerate(([], ["--tp", "1", "--pp", "1", "--ep", "3"])):
        back = str(tmp_path / f"back{i}")
        assert main(["megatron-to-hf", "--ckpt", mc, "--out", back, *layout]) == 0, layout
        b = hf_state(back)
        assert set(a) == set(b), layout
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a), layout


def test_convert_refuses_layouts_by_name(tmp_path, capsys):
    from mgrpo_launchers.convert import main

    hf = make_moe_checkpoint(str(tmp_path / "hf"), odd_cfg(), seed=1)

    def err(*argv) -> str:
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    assert "--ep=4 does not divide model num_experts=6" in err("hf-to-megatron", "--hf-dir", hf, "--out",
                                                                str(tmp_path / "o"), "--ep", "4")
    assert "--tp=4 does not divide model num_attention_heads=6" in err("hf-to-megatron", "--hf-dir", hf, "--out",
                                                                       str(tmp_path / "o"), "--tp", "4")
    from tests.helpers.convert import make_hf_checkpoint

    dense = make_hf_checkpoint(str(tmp_path / "dense"), tiny_cfg())
    assert "--ep=2 splits experts, but model family 'qwen3' has none" in err(
        "hf-to-megatron", "--hf-dir", dense, "--out", str(tmp_path / "o2"), "--ep", "2")


def test_family_is_registered():
    assert FAMILIES["qwen3_moe"].hf_architecture == "Qwen3MoeForCausalLM" and FAMILIES["qwen3_moe"].has_experts


# ---------------------------------------------------------------------------------------------
# the routing-replay seam (transformer_config(..., routing_replay=True): megatron's moe_enable_routing_replay)


def _rank_replay(rank, world, port, cfg, hf_dir):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from mgrpo.models import load_hf_into_megatron
    from mgrpo.models.gpt import build_gpt_model, transformer_config
    from mgrpo.training.parallel import init_parallel

    ctx = init_rank(rank, world, port, tp=1, pp=1)
    RouterReplay.clear_global_router_replay_instances()
    model = build_gpt_model(cfg, transformer_config(cfg, use_cpu=True, routing_replay=True), pre_process=True,
                            post_process=True, pg_collection=ctx.pg_collection).eval()
    load_hf_into_megatron(model, hf_dir, cfg, **layout_kwargs(ctx))
    ids = token_ids(cfg)
    plain = megatron_logits(model, ctx, cfg, ids)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    recorded = megatron_logits(model, ctx, cfg, ids)
    experts = [x.clone() for x in RouterReplay.get_recorded_data()]
    RouterReplay.set_replay_data(experts)  # replaying what was recorded changes nothing
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replayed = megatron_logits(model, ctx, cfg, ids)
    RouterReplay.set_replay_data([(x + 1) % cfg.num_experts for x in experts])  # other experts: other logits
    moved = megatron_logits(model, ctx, cfg, ids)
    return dict(instances=len(RouterReplay.global_router_replay_instances), shapes=[tuple(x.shape) for x in experts],
                recorded=(recorded - plain).abs().max().item(), replayed=(replayed - plain).abs().max().item(),
                moved=(moved - plain).abs().max().item())


@pytest.mark.integration
def test_routing_replay_can_be_switched_on(tmp_path):
    """routing_replay=True builds megatron's RouterReplay in every router: the experts each token was routed
    to can be recorded, and replaying them reproduces the logits (what actor.router_replay builds on,
    tests/training/test_router_replay*.py); replaying other experts changes them."""
    cfg = odd_cfg()
    hf_dir = make_moe_checkpoint(str(tmp_path / "hf"), cfg, seed=2)
    (res,) = run_ranks(_rank_replay, 1, cfg, hf_dir)
    assert res["instances"] == cfg.num_layers
    assert res["shapes"] == [(2 * 12, cfg.moe_router_topk)] * cfg.num_layers  # every token's k experts, per layer
    assert res["recorded"] == 0.0 and res["replayed"] < 1e-6 and res["moved"] > 1e-2, res


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_released_presets_list_every_field(preset):
    import yaml

    path = os.path.join(ROOT, "configs", "model", preset + ".yaml")
    values = yaml.safe_load(open(path))
    assert set(values) == {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(**values)
    assert (m.family, m.num_experts, m.moe_router_topk, m.norm_topk_prob, m.num_query_groups, m.head_dim) == (
        "qwen3_moe", 128, 8, True, 4, 128)
