"""A reward model served as SGLang serves one (`--is-embedding`, `/classify`) by the CPU server: its scores equal
transformers' own forward of the same checkpoint within 1e-5 (fp32), for a Qwen3 and a Llama sequence classifier
(random-initialised small configs built here), through token ids and through text; the answer has SGLang's shape,
and what SGLang refuses is refused."""

from __future__ import annotations

import pytest
import requests
import torch

from mgrpo.data.synthetic import synthetic_tokenizer
from tests.helpers.reward_models import tiny_classifier
from tests.helpers.sglang_cpu import launch


@pytest.mark.integration
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_served_scores_equal_transformers_forward(tmp_path, family):
    from transformers import AutoModelForSequenceClassification

    hf_dir = tiny_classifier(str(tmp_path / "rm"), family)
    ref = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = synthetic_tokenizer()
    inputs = [[3, 13, 5, 14, 8, 1], [4], [12, 12, 11, 13, 3, 14, 5, 6, 1], [7, 13, 7, 14, 3, 4]]
    engine = launch(hf_dir, str(tmp_path), extra_args=["--is-embedding"], enable_memory_saver=False)
    try:
        served = engine.classify(inputs)
        with torch.no_grad():
            for ids, got in zip(inputs, served):
                x = torch.tensor([ids])
                want = ref(input_ids=x).logits[0]
                # and by hand: the score head on the last token's final hidden state
                by_hand = ref.model(input_ids=x).last_hidden_state[0, -1] @ ref.score.weight.T
                assert len(got) == 1
                assert abs(got[0] - float(want[0])) <= 1e-5 and abs(got[0] - float(by_hand[0])) <= 1e-5
            assert len({round(s[0], 4) for s in served}) == len(inputs)  # different inputs, different scores

        # SGLang's answer shape, text tokenised with the model's tokenizer, and SGLang's refusals
        url = engine.url
        one = requests.post(f"{url}/classify", json={"text": "1+2=3", "rid": "r1"}, timeout=30).json()
        assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["id"] == "r1"
        assert one["meta_info"]["prompt_tokens"] == len(tok.encode("1+2=3"))
        with torch.no_grad():
            assert abs(one["embedding"][0] - float(ref(input_ids=torch.tensor([tok.encode("1+2=3")])).logits[0, 0])) \
                <= 1e-5
        both = requests.post(f"{url}/classify", json={"text": "1", "input_ids": [3]}, timeout=30)
        assert both.status_code == 400 and "cannot be provided at the same time" in both.json()["error"]["message"]
        gen = requests.post(f"{url}/generate", json={"input_ids": [3], "sampling_params": {}}, timeout=30)
        assert gen.status_code == 400 and "--is-embedding" in gen.json()["error"]["message"]
        assert requests.get(f"{url}/model_info", timeout=30).json()["is_generation"] is False
        assert engine.health().ok
    finally:
        engine.shutdown()
