"""veRL's reward keys, both layouts: reward_model.* / custom_reward_function.* and the newer reward.reward_model.* /
reward.custom_reward_function.* / reward.reward_manager.* (NEW_RM) -> mgrpo's reward.models / reward.compose /
reward.custom_functions; part of the key table in rules.py."""

from __future__ import annotations

from mgrpo.compat.verl.kit import Refuse, Rule, falsy, ignore, only, refuse

NEW_RM = "reward.reward_model."
"""veRL's newer reward layout (verl/trainer/config/reward/reward.yaml, migrate_legacy_reward_impl): reward_model.* ->
reward.reward_model.* (model.path -> model_path), custom_reward_function.* -> reward.custom_reward_function.*,
reward_model.reward_manager -> reward.reward_manager.name, sandbox_fusion.* -> reward.sandbox_fusion.*."""


def _reward_model_at(prefix: str, path_key: str):
    """veRL's reward model (<prefix>enable with its checkpoint at `path_key`): the reward of every data_source is the
    model's score (veRL's reward managers return rm_scores when there are any), served as reward.models.rm. veRL's
    resource pool becomes the placement: enable_resource_pool=true, n_gpus_per_node x nnodes GPUs of its own
    (engines = GPUs / the reward rollout's tensor_model_parallel_size); false, the global pool: the rollout's cards."""

    def rule(v, ctx):
        if falsy(v):
            return [("", "false: rule-based rewards, as in mgrpo")]
        path = ctx.get(path_key)
        if not path:
            raise Refuse(f"{prefix}enable=true needs {path_key} (the classifier's checkpoint)")
        model = {"hf_path": str(path)}
        batch = ctx.get(prefix + "micro_batch_size_per_gpu") or ctx.get(prefix + "micro_batch_size")
        if batch:
            model["batch_size"] = int(batch)
        tp = ctx.get(prefix + "rollout.tensor_model_parallel_size")
        if tp:
            model["tp"] = int(tp)
        share = ctx.get(prefix + "rollout.gpu_memory_utilization")
        if share is not None:
            model["gpu_memory_utilization"] = float(share)
        if falsy(ctx.get(prefix + "enable_resource_pool", False)):
            model["placement"] = "shared"
        else:
            gpus = int(ctx.get(prefix + "n_gpus_per_node") or 8) * int(ctx.get(prefix + "nnodes") or 1)
            if gpus % int(tp or 2):  # veRL's reward rollout defaults to tensor_model_parallel_size 2
                raise Refuse(f"{prefix}n_gpus_per_node x nnodes = {gpus} GPUs do not divide into engines of "
                             f"tensor_model_parallel_size {int(tp or 2)}")
            model.update(placement="own", engines=gpus // int(tp or 2), tp=int(tp or 2))
        return [("reward.models", {"rm": model}), ("reward.compose", {"*": {"rm": 1.0}})]

    return rule


_reward_model = _reward_model_at("reward_model.", "reward_model.model.path")


def _rm_rollout_name(v, ctx):
    if v not in (None, "???", "sglang", "vllm"):
        raise Refuse(f"mgrpo serves reward models with SGLang; {v!r} has no mgrpo equivalent")
    return [("", f"{v}: mgrpo serves the reward model with SGLang (--is-embedding), as its rollout")]


def _rm_keys(prefix: str) -> dict:
    """The serving and pool keys of veRL's reward model under `prefix` (both layouts), read by its enable rule."""
    used = "read with {}enable (reward.models.rm)".format(prefix)
    return {
        **{prefix + k: ignore(used) for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes",
                                              "rollout.tensor_model_parallel_size", "rollout.gpu_memory_utilization",
                                              "micro_batch_size_per_gpu", "micro_batch_size")},
        prefix + "rollout.name": _rm_rollout_name,
        prefix + "num_workers": ignore("mgrpo scores a step's reward-model requests in batches of "
                                       "reward.models.rm.batch_size spread over its engines"),
    }


def _custom_reward_at(name_key: str):
    """veRL's reward file (custom_reward_function.path, or reward.custom_reward_function.path in the newer layout):
    its function (`name_key`, default compute_score) scores every data_source, which is reward.custom_functions' '*'
    entry. A pkg://<module> path (veRL's package loading) is the module's function."""

    def rule(v, ctx):
        if not v:
            return [("", "null: the reward function of each data_source")]
        name = ctx.get(name_key) or "compute_score"
        if str(v).startswith("pkg://"):
            return [("reward.custom_functions", {"*": f"{str(v)[len('pkg://'):]}:{name}"})]
        if not str(v).endswith(".py"):
            raise Refuse("veRL imports a Python file here; give the path of a .py file (or mgrpo's "
                         "reward.custom_functions={<data_source>: 'module:function'})")
        return [("reward.custom_functions", {"*": f"{v}:{name}"})]

    return rule


_custom_reward = _custom_reward_at("custom_reward_function.name")


REWARD_RULES: dict[str, Rule] = {
    "reward_model.enable": _reward_model,
    "reward_model.model.path": ignore("the reward model's checkpoint, with reward_model.enable"),
    **{f"reward_model.{k}": ignore("reward.models.rm.batch_size, with reward_model.enable")
       for k in ("micro_batch_size_per_gpu", "micro_batch_size")},
    "reward_model.model.input_tokenizer": ignore("mgrpo formats each conversation with the reward model's own "
                                                 "tokenizer and chat template"),
    **{f"reward_model.{k}": ignore("the reward model is served by SGLang (--is-embedding), not run by a trainer "
                                   "worker") for k in ("strategy", "use_dynamic_bsz", "forward_max_token_len_per_gpu",
                                                      "ulysses_sequence_parallel_size", "model.trust_remote_code",
                                                      "model.use_remove_padding", "max_length", "use_reward_loop")},
    **{k: only(lambda v: v in ("naive", "dapo", None),
               "one score per sample by data_source, as in mgrpo (DAPO's overlong shaping is "
               "algorithm.overlong_buffer)",
               "mgrpo scores each sample with the function of its data_source")
       for k in ("reward_model.reward_manager", "reward.reward_manager.name")},
    "custom_reward_function.path": _custom_reward,
    "custom_reward_function.name": ignore("used with custom_reward_function.path"),
    # veRL's newer reward layout (NEW_RM): the same keys one level down
    NEW_RM + "enable": _reward_model_at(NEW_RM, NEW_RM + "model_path"),
    NEW_RM + "model_path": ignore(f"the reward model's checkpoint, with {NEW_RM}enable"),
    **_rm_keys("reward_model."), **_rm_keys(NEW_RM),
    "reward.custom_reward_function.path": _custom_reward_at("reward.custom_reward_function.name"),
    "reward.custom_reward_function.name": ignore("used with reward.custom_reward_function.path"),
    "reward.reward_manager.source": only(lambda v: v in ("register", None), "register: veRL's own managers",
                                         "mgrpo scores each sample with the function of its data_source"),
}
# veRL's reward-manager group in both layouts (reward_manager.yaml's top-level reward_manager.*, the newer
# reward.reward_manager.*) and SandboxFusion's settings at their defaults (no server): what each key means in mgrpo.
MANAGER_INSTEAD = ("mgrpo scores each sample with the function of its data_source: reward.custom_functions="
                   "{<data_source>: 'module:function'} (or custom_reward_function.path)")
for _p in ("reward_manager.", "reward.reward_manager."):
    REWARD_RULES.update({
        _p + "source": only(lambda v: v in ("register", None), "register: veRL's own managers", MANAGER_INSTEAD),
        _p + "name": only(lambda v: v in ("naive", "dapo", None),
                          "one score per sample by data_source, as in mgrpo (DAPO's overlong shaping is "
                          "algorithm.overlong_buffer)", MANAGER_INSTEAD),
        _p + "module.path": only(falsy, "null: no manager module of the user's", MANAGER_INSTEAD),
        _p + "module.name": ignore("used with module.path"),
    })
for _p in ("sandbox_fusion.", "reward.sandbox_fusion.", "reward_model.sandbox_fusion."):
    REWARD_RULES.update({
        _p + "url": only(falsy, "null: no SandboxFusion server", "SandboxFusion code execution has no mgrpo "
                                                                 "equivalent: mgrpo runs code in its own sandbox "
                                                                 "(sandbox.*, the code tool)"),
        **{_p + k: ignore("used with sandbox_fusion.url") for k in ("max_concurrent", "memory_limit_mb")},
    })
REWARD_RULES["reward.reward_kwargs"] = only(falsy, "empty", "keyword arguments of veRL's reward manager: give them to "
                                                           "your function in mgrpo (reward.custom_functions)")

REWARD_PREFIX_RULES: dict[str, Rule] = {
    "reward_model.model.fsdp_config.": ignore("the reward model is served by SGLang (--is-embedding), not FSDP"),
    **{p + "rollout.": ignore("a vLLM/SGLang engine setting of veRL's reward rollout: mgrpo launches the reward "
                              "model's SGLang servers itself (reward.models.rm.server_args)")
       for p in ("reward_model.", NEW_RM)},
    **{p: refuse("SandboxFusion code execution has no mgrpo equivalent: mgrpo runs code in its own sandbox "
                 "(sandbox.*, the code tool)") for p in ("sandbox_fusion.", "reward.sandbox_fusion.",
                                                          "reward_model.sandbox_fusion.")},
    "reward.reward_kwargs.": refuse("keyword arguments of veRL's reward manager: give them to your function in mgrpo "
                                    "(reward.custom_functions)"),
    "reward_manager.": refuse(MANAGER_INSTEAD), "reward.reward_manager.": refuse(MANAGER_INSTEAD),
}
