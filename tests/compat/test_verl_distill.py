"""veRL's on-policy distillation keys (distillation.*) composed into the mgrpo config they mean, and the refusals
(one line each): more than one teacher, loss modes mgrpo does not have, a teacher on vLLM."""

from __future__ import annotations

import pytest

from mgrpo.compat.verl import VerlKeyError, translate
from mgrpo_launchers.plan import compose_config

T = "+distillation.teacher_models.math_teacher."
L = "distillation.distillation_loss."
# the keys of veRL's on-policy distillation examples (forward_kl_topk, the teacher alone)
LINE = ["algorithm.adv_estimator=grpo", "distillation.enabled=True", T + "model_path=/models/teacher",
        T + "num_replicas=2", T + "inference.name=sglang", T + "inference.tensor_model_parallel_size=2",
        T + "inference.gpu_memory_utilization=0.4", T + "inference.max_model_len=4096", L + "loss_mode=forward_kl_topk",
        L + "topk=16", L + "use_task_rewards=False", L + "use_policy_gradient=False", L + "loss_max_clamp=10.0",
        L + "log_prob_min_clamp=-10.0", "distillation.n_gpus_per_node=4", "distillation.nnodes=1"]


def test_forward_kl_topk_line_composes_to_the_teacher_and_loss_it_means():
    cfg = compose_config(translate(LINE).args)
    t, opd = cfg.teacher, cfg.algorithm.opd
    assert (t.hf_path, t.mode, t.num_engines, t.tp, t.gpu_memory_utilization) == ("/models/teacher", "sglang", 2, 2, 0.4)
    assert (opd.loss_mode, opd.topk, opd.loss_max_clamp, opd.log_prob_min_clamp) == ("forward_kl_topk", 16, 10.0, -10.0)
    assert cfg.algorithm.adv_estimator == "none"  # use_task_rewards=false: the teacher alone, grpo superseded
    assert opd.coef == 1.0


def test_k1_policy_gradient_with_task_rewards_is_the_reverse_kl_advantage_term():
    line = ["algorithm.adv_estimator=grpo", "distillation.enabled=True", "+distillation.teacher_model.model_path=/m/t",
            L + "loss_mode=k1", L + "use_policy_gradient=True", L + "use_task_rewards=True",
            L + "distillation_loss_coef=0.5", "distillation.num_workers=3"]
    cfg = compose_config(translate(line).args)
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.opd.loss_mode, cfg.algorithm.opd.coef) == ("grpo", "reverse_kl", 0.5)
    assert (cfg.teacher.hf_path, cfg.teacher.num_engines) == ("/m/t", 3)


def test_distillation_off_leaves_the_teacher_keys_unused():
    line = ["distillation.enabled=False", T + "model_path=/models/teacher", L + "loss_mode=forward_kl_topk"]
    t = translate(line)
    cfg = compose_config(t.args)
    assert cfg.teacher.hf_path is None and cfg.algorithm.opd.loss_mode == "reverse_kl"
    assert all("distillation.enabled is not true" in what for key, what in t.rows if key.startswith(("+dist", "dist."))
               and "enabled=" not in key)


@pytest.mark.parametrize("extra, says", [
    ([T.replace("math", "code") + "model_path=/models/code"],
     "mgrpo distils from one teacher; this line names 2 (math_teacher, code_teacher)"),
    ([L + "loss_mode=k3"], "'k3': mgrpo has the k1 reverse KL as an advantage term"),
    ([L + "use_policy_gradient=True"], "forward_kl_topk as a policy-gradient reward has no mgrpo equivalent"),
    ([T + "inference.name=vllm"], "mgrpo serves the teacher with SGLang"),
    (["distillation.teacher_model_sharding=2"], "this distillation setting has no mgrpo equivalent"),
])
def test_refusals_are_one_line_naming_the_key(extra, says):
    keys = {tok.split("=")[0] for tok in extra}
    line = [tok for tok in LINE if tok.split("=")[0] not in keys] + extra
    with pytest.raises(VerlKeyError) as info:
        translate(line)
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 1 and says in lines[0] and lines[0].split(": ")[0].strip(" -") in line  # the key named


def test_enabled_without_a_teacher_is_refused():
    with pytest.raises(VerlKeyError, match="needs a teacher: set distillation.teacher_models.<name>.model_path"):
        translate(["distillation.enabled=True", L + "loss_mode=k1"])
