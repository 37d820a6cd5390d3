"""A reward model (reward.models.<name>, kind=classifier): a sequence classifier served as SGLang serves one,
`--is-embedding`, scored through `/classify` (on CPU the CPU server does the same over transformers,
rollout/sglang/cpu/classify.py). Its servers are hosted by an `EngineHosting` (hosting.py).

Each conversation is formatted with the reward model's own tokenizer: its chat template over the record's prompt
messages plus the response as the assistant's turn; a tokenizer without a chat template (the synthetic one) reads
prompt text + response, and EOS when the response ended with it (a stopped answer is the complete answer). A request
that fails (timeout, 5xx, an answer that is not SGLang's, each retried within reward.models.<name>.max_retries with
backoff, and once more after a dead server was started again) leaves its samples without a score, never 0.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mgrpo.config.reward import RewardModelConfig
from mgrpo.rewards.hosting import EngineHosting, EngineKit
from mgrpo.rewards.scoring import ScoreRequest, ScoreResult


class RewardModel:
    """One named classifier reward model: its tokenizer, its servers (`hosting`), its scoring."""

    label = "model"
    """How a failure it causes is named (failed_by 'model:<name>', reward/failed/model:<name>)."""

    def __init__(self, name: str, cfg: RewardModelConfig, engines: EngineKit, *, api_key: Optional[str],
                 log_dir: str, placement=None, devices: Optional[list[list[str]]] = None, cpus: float = 1):
        """`engines`: how servers are started and reached; `placement`, `devices`, `cpus`: where (EngineHosting)."""
        from transformers import AutoTokenizer

        self.name, self.cfg = name, cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.hf_path)
        # Not behind SGLang's router: sglang-router 0.3.x serves SGLang's /classify only as the OpenAI /v1/classify,
        # which answers softmax probabilities (SGLang's serving_classify.py: [1.0] for a one-label reward head), so
        # the requests go to the servers in turn.
        self.hosting = EngineHosting(name, cfg, engines, api_key=api_key, log_dir=log_dir,
                                     server_flags=("--is-embedding",), routed=False, label=self.label,
                                     placement=placement, devices=devices, cpus=cpus)

    @property
    def restarts(self) -> int:
        return self.hosting.restarts

    def inputs(self, req: ScoreRequest) -> list[int]:
        """The token ids the reward model reads for one response (see the module docstring)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            prompt = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": str(req.prompt)}]
            text = tok.apply_chat_template(list(prompt) + [{"role": "assistant", "content": req.response}],
                                           tokenize=False, add_generation_prompt=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        ids = tok(str(req.prompt or "") + req.response, add_special_tokens=False)["input_ids"]
        stopped = (req.extra_info or {}).get("finish_reason") == "stop"
        return ids + ([tok.eos_token_id] if stopped and tok.eos_token_id is not None else [])

    def score(self, reqs: Sequence[ScoreRequest]) -> ScoreResult:
        """A score or None per request; never raises for a server's failure."""
        inputs = [self.inputs(r) for r in reqs]
        values, result = self.hosting.spread(
            len(reqs), self.cfg.batch_size, len(self.hosting.engines),
            lambda engine, idx: engine.classify([inputs[i] for i in idx]), by=f"{self.label}:{self.name}")
        for i, v in enumerate(values):
            if v is not None:
                result.scores[i] = v[0]  # a Bradley-Terry head: one score (num_labels=1)
        return result

    def close(self) -> None:
        self.hosting.close()
