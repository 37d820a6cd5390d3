"""SGLang's LoRA protocol on the CPU server: adapters loaded by name from tensors (/load_lora_adapter_from_tensors)
or from a PEFT folder (/load_lora_adapter), applied to the requests naming them (lora_path) and not to the others
in the same batch, checked against Hugging Face peft's forward of the same adapter; SGLang's refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.sglang_cpu import launch

pytestmark = pytest.mark.integration

RANK = 4


def _peft_adapter(ckpt: str, out_dir: str, seed: int, targets) -> tuple:
    """A PEFT adapter with non-zero factors on `ckpt`, saved to `out_dir`; (PeftModel, tensors, config)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # B of PEFT's non-default init is small: make the adapter's effect plain
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(20.0)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        config = json.load(f)
    return model.eval(), load_file(os.path.join(out_dir, "adapter_model.safetensors")), config


@torch.no_grad()
def _logprobs(model, prompt, tokens) -> list:
    ids = torch.tensor([list(prompt) + list(tokens)])
    logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _generate(engine, prompts, lora):
    body = {"input_ids": prompts, "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3},
            "return_logprob": True, "lora_path": lora}
    return engine.client.post("/generate", body, ok_statuses=(200, 400))


def test_adapters_apply_to_the_requests_that_name_them(ckpt, tmp_path):
    from mgrpo.rollout.sglang.client import SGLangEngine  # noqa: F401 - the client under test
    from transformers import AutoModelForCausalLM

    a_model, a_tensors, a_config = _peft_adapter(ckpt, str(tmp_path / "a"), 0, "all-linear")
    b_model, _, _ = _peft_adapter(ckpt, str(tmp_path / "b"), 1, ["q_proj", "v_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    eng = launch(ckpt, str(tmp_path / "logs"),
                 extra_args=["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"])
    try:
        sent = eng.load_lora_adapter("a-v1", a_tensors, a_config, use=False)
        assert sent == sum(t.numel() * t.element_size() for t in a_tensors.values())
        out = eng.client.post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "b")}).json()
        assert out == {"success": True, "error_message": "",
                       "loaded_adapters": {"a-v1": "__tensor__", "b": str(tmp_path / "b")}}
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
        resp = _generate(eng, prompts, ["a-v1", None, "b"])
        assert resp.status_code == 200, resp.text
        worst = 0.0
        for prompt, item, model in zip(prompts, resp.json(), (a_model, base, b_model)):
            tokens = [t[1] for t in item["meta_info"]["output_token_logprobs"]]
            got = [t[0] for t in item["meta_info"]["output_token_logprobs"]]
            want = _logprobs(model, prompt, tokens)
            worst = max(worst, max(abs(x - y) for x, y in zip(got, want)))
        assert worst < 1e-5, worst
        # the adapter changes the distribution: the base's log-probs of adapter a's tokens differ
        item = resp.json()[0]
        tokens = [t[1] for t in item["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(_logprobs(base, prompts[0], tokens),
                                              _logprobs(a_model, prompts[0], tokens))) > 1e-2

        # SGLang's refusals, word for word
        resp = _generate(eng, [[1, 2]], "nope")
        assert resp.status_code == 400
        assert resp.json()["error"]["message"].startswith("Got LoRA adapter that has never been loaded: nope")
        big = dict(a_config, r=16)
        refused = eng.client.post("/load_lora_adapter_from_tensors", {
            "lora_name": "c", "config_dict": big, "serialized_named_tensors": []}, ok_statuses=(400,)).json()
        assert refused["success"] is False
        dup = eng.client.post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "b")},
                              ok_statuses=(400,)).json()
        assert dup["error_message"] == "Failed to load LoRA adapter b because it is already loaded"
        eng.unload_lora_adapter("b")
        gone = eng.client.post("/unload_lora_adapter", {"lora_name": "b"}, ok_statuses=(400,)).json()
        assert gone["error_message"].startswith("LoRA with name b does not exist.")
    finally:
        eng.shutdown()


def test_lora_refused_without_enable_lora(engine):
    resp = _generate(engine, [[1, 2]], "a")
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("LoRA adapter 'a' was requested, but LoRA is not enabled.")
    out = engine.client.post("/unload_lora_adapter", {"lora_name": "a"}, ok_statuses=(400,)).json()
    assert out["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
