"""megatron-core CPU patches: each still matches the code it works around, and together they let a
real training step (pipeline schedule, tied embeddings across stages, DDP, optimizer with clipping)
run over gloo. When a megatron-core upgrade breaks one, the failing test names the patch."""

import pytest
import torch

from mgrpo.training.cpu_compat import MOE_PATCHES, PATCHES, SWIGLU_PATCH, swiglu_back
from tests.helpers.distributed import run_ranks


CHECKED = PATCHES + MOE_PATCHES + (SWIGLU_PATCH,)


@pytest.mark.parametrize("patch", CHECKED, ids=[p.name for p in CHECKED])
def test_patch_premise_still_holds(patch):
    """The mixture-of-experts patches and the SwiGLU one are applied only where their premise holds (optional),
    but on the installed megatron-core they must hold: a MoE model needs each of them here, and without the
    SwiGLU one every CPU update runs megatron's slow eager gradient."""
    assert patch.premise(), (f"cpu_compat patch {patch.name!r} no longer matches megatron-core ({patch.why}); "
                             "re-check it in mgrpo/training/cpu_compat.py")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_back_is_the_unfused_glus_gradient_bit_for_bit(dtype):
    """What the CPU ranks' SwiGLU function returns in backward equals autograd's gradient of the unfused glu (the
    local spec's MLP before bias_activation_fusion) exactly, and the calculus in float64 closely: the swap
    changes memory, not numbers."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(257, 2 * 96, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(257, 96, generator=gen).to(dtype)
    a, b = torch.chunk(y, 2, -1)
    (torch.nn.functional.silu(a) * b).backward(g)
    ours = swiglu_back(g, y.detach())
    assert ours.dtype == dtype and torch.equal(ours, y.grad)
    y1, y2 = torch.chunk(y.detach().double(), 2, -1)
    sig = torch.sigmoid(y1)
    exact = torch.cat([g.double() * sig * (1 + y1 * (1 - sig)) * y2, g.double() * y1 * sig], -1)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.double(), exact, **tol)


def test_torch_norm_refuses_sequence_parallelism_and_the_wrapper_marks_its_weight():
    """The premise of models/gpt.py::SequenceParallelTorchNorm (MoE with TP runs sequence parallel on the
    local spec): megatron's torch norm still refuses the flag, the wrapper builds the same norm without it
    and marks its weight for megatron's sum of sequence-parallel gradients over TP."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mgrpo.models.gpt import SequenceParallelTorchNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, normalization="RMSNorm",
                            use_cpu_initialization=True)
    cfg.sequence_parallel = True  # as megatron's config has it at TP > 1 (its checks want TP > 1 to set it)
    with pytest.raises(AssertionError, match="sequence parallel not supported by torch LayerNorm"):
        WrappedTorchNorm(cfg, 8, 1e-6)
    norm = SequenceParallelTorchNorm(cfg, 8, 1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert cfg.sequence_parallel is True  # the caller's config is left as it was


def _train_two_steps(rank, world, port, tp, pp):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mgrpo.config import ModelConfig
    from mgrpo.models.gpt import build_gpt_model, transformer_config
    from mgrpo.training.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, tp=tp, pp=pp)
    m = ModelConfig(tie_word_embeddings=True)
    cfg = transformer_config(m, tp=tp, pp=pp, use_cpu=True)
    gpt = build_gpt_model(m, cfg, pre_process=ctx.is_first_stage, post_process=ctx.is_last_stage,
                          pg_collection=ctx.pg_collection)
    model = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=gpt)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e-3), [model])
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)

    def step(it, model):
        out = model(next(it), pos, attention_mask=None)
        return out, lambda o: (o.float().pow(2).mean(), {"l": o.float().pow(2).mean().detach()})

    norms = []
    for _ in range(2):
        model.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens, tokens]), model=[model],
                                    num_microbatches=2, seq_length=8, micro_batch_size=2, forward_only=False)
        ok, grad_norm, _ = opt.step()  # clip_grad=1e-3 forces the clipping path
        assert ok
        norms.append(float(grad_norm))
    destroy_parallel()
    return norms


@pytest.mark.integration
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_training_step_runs_on_cpu(tp, pp):
    norms = run_ranks(_train_two_steps, tp * pp, tp, pp)
    # The gradient norm is a model-parallel quantity: every rank must report the same value.
    for n in norms[1:]:
        assert n == pytest.approx(norms[0], rel=1e-6)
    assert all(x > 0 and x == x for x in norms[0])


def test_eager_jit_module_matches_megatrons():
    """The `jit` module put in place before megatron-core is imported defines what megatron's defines
    (read from its source, which cannot be imported here: this process already holds the stand-in)."""
    import ast
    import importlib.util
    import os

    from mgrpo.training.cpu_compat import JIT_NAMES

    root = importlib.util.find_spec("megatron").submodule_search_locations[0]
    tree = ast.parse(open(os.path.join(root, "core", "jit.py")).read())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert defined == set(JIT_NAMES)


@pytest.mark.integration
def test_megatron_imports_without_torch_compile_on_cpu():
    """lean_megatron_import() first (as a Megatron rank does) keeps megatron-core's fusions eager on CPU: no TorchDynamo or
    Inductor in the process (~70 MiB per Megatron rank), and megatron sees a fuser that changes nothing;
    Triton is not imported unless TRITON_INTERPRET=1 (then the fused kernel stays available)."""
    import subprocess
    import sys

    import os

    code = ("import sys\n"
            "from mgrpo.training.cpu_compat import lean_megatron_import\n"
            "lean_megatron_import()\n"
            "import megatron.core, mgrpo_kernels\n"
            "from megatron.core.jit import jit_fuser\n"
            "f = lambda x: x\n"
            "assert jit_fuser(f) is f\n"
            "print(mgrpo_kernels.capabilities()['fused'])\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton') if sys.modules.get(m)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for interpret, loaded in (("0", "[]"), ("1", "['triton']")):  # Triton stays where the interpreter asks for it
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={**env, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": interpret})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-2:] == [str(interpret == "1"), loaded]


@pytest.mark.integration
def test_rank_leaves_out_optional_packages_it_never_uses(tmp_path):
    """After lean_megatron_import() a rank's libraries see accelerate, kernels, scipy and boto3 as not installed
    (RANK_UNUSED_OPTIONAL) and still do a rank's work: megatron-core with its tensorboard timers, and the hybrid
    engine's transformers model loaded from a checkpoint and sampling; none of the four is imported."""
    import os
    import subprocess
    import sys

    from tests.helpers.sglang_cpu import tiny_checkpoint

    ckpt = tiny_checkpoint(str(tmp_path))
    code = ("import sys, torch\n"
            "from mgrpo.training.cpu_compat import RANK_UNUSED_OPTIONAL, lean_megatron_import\n"
            "print(lean_megatron_import())\n"
            "import megatron.core.timers\n"
            "from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({ckpt!r}, dtype=torch.float32)\n"
            "out = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4, do_sample=True)\n"
            "print(tuple(out.shape))\n"
            "print(sorted(n for n in RANK_UNUSED_OPTIONAL if sys.modules.get(n) is not None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    done, shape, loaded = out.stdout.strip().splitlines()[-3:]
    assert all(f"no_{n}" in done for n in ("accelerate", "kernels", "scipy", "boto3")), done
    assert shape == "(1, 7)"
    assert loaded == "[]"
