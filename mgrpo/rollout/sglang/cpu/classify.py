"""`--is-embedding`: the CPU server serving a sequence classifier (a reward model) as SGLang 0.5.23 serves one.

SGLang (srt/entrypoints/http_server.py): `/classify` ("a reward model request ... the same as embedding
models") and `/encode` take an `EmbeddingReqInput` (io_struct.py: `text` or `input_ids`, one or a batch) and
answer, per input, `{"embedding": [...], "meta_info": {...}}` (tokenizer_manager.py::_handle_batch_output,
BatchEmbeddingOutput). For a sequence classifier (srt/models/llama_reward.py `LlamaForSequenceClassification`,
qwen3_classification.py `Qwen3ForSequenceClassification`) the "embedding" is the score head applied to the
last token's hidden state, unnormalised: `num_labels` floats, a Bradley-Terry reward model's one score.
Here transformers' `AutoModelForSequenceClassification` computes exactly that (its pooling takes the last
non-pad token; each input runs alone, so it is the last token). A generation request to such a server is
refused, as SGLang refuses an embedding request to a generation model.

Text is tokenised with the model's own tokenizer as SGLang's tokenizer manager does (`tokenizer.encode`);
clients that format a conversation with a chat template send the template's token ids (mgrpo's do).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from fastapi import Request  # module level: FastAPI resolves the string annotations here

from mgrpo.rollout.sglang.cpu.receive import RequestError

CLASSIFY_FIELDS = frozenset({"rid", "text", "input_ids", "sampling_params", "log_metrics", "priority",
                             "routing_key", "return_prompt_token_ids"})
"""EmbeddingReqInput's fields this server implements (tests/rollout/sglang/test_sglang_schema.py checks they are
SGLang's); any other field is refused, not ignored."""

NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. "
                 "Please add `--is-embedding` when launching the server or try another model.")
"""SGLang's words (tokenizer_manager.py) for an embedding request to a generation server."""
NOT_GENERATION = "this server was launched with --is-embedding: it serves /classify and /encode, not /generate"


class ClassifierModel:
    """A transformers sequence classifier, frozen (no weight updates, no memory release)."""

    def __init__(self, model_path: str, *, dtype: str = "auto"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch_dtype = torch.float32 if dtype in ("auto", "float32", "float") else getattr(torch, dtype)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=torch_dtype).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError):  # a checkpoint without tokenizer files: token ids only
            self.tokenizer = None
        self.released: set[str] = set()
        self.stale: set[str] = set()
        self.last_progress = time.monotonic()

    def info(self) -> dict[str, Any]:
        return {"parameters": sum(p.numel() for p in self.model.parameters()), "released": [], "stale": 0}

    def check_servable(self) -> None:
        """Nothing to check: a frozen classifier never releases its weights."""

    def scores(self, inputs: list[list[int]]) -> list[list[float]]:
        """The score head's output at each input's last token. Inputs of equal length run as one batch and
        nothing is padded: transformers pools at the last token that is not the pad id, which padding (or a
        response that ends in the pad token) would make another position than SGLang's last token."""
        out: list[list[float]] = [[] for _ in inputs]
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(inputs):
            by_len.setdefault(len(ids), []).append(i)
        with torch.no_grad():
            for idx in by_len.values():
                x = torch.tensor([inputs[i] for i in idx], dtype=torch.long)
                if len(idx) > 1 and self.model.config.pad_token_id is None:
                    logits = torch.cat([self.model(input_ids=row[None]).logits for row in x])  # batch>1 needs it
                else:
                    logits = self.model(input_ids=x).logits
                for i, row in zip(idx, logits.float().tolist()):
                    out[i] = row
                self.last_progress = time.monotonic()
        return out


def parse(body: Any, model: ClassifierModel, context_len: int, path: str) -> tuple[list[str], list[list[int]], bool]:
    """(rids, token ids per input, single) of an EmbeddingReqInput body; RequestError for what SGLang refuses or
    this server does not implement."""
    if not isinstance(body, dict):
        raise RequestError(f"{path}: the body must be a JSON object, got {type(body).__name__}", validation=True)
    unknown = set(body) - CLASSIFY_FIELDS
    if unknown:
        raise RequestError(f"{path}: fields {sorted(unknown)} are not implemented by the CPU server (it serves "
                           f"{sorted(CLASSIFY_FIELDS)} of SGLang's EmbeddingReqInput)")
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:  # io_struct.py's words (normalize_batch_and_arguments)
        raise RequestError("At least one of text, input_ids, image, video, or audio should be provided")
    if text is not None and ids is not None:
        raise RequestError("text and input_ids cannot be provided at the same time")
    if ids is not None:
        single = bool(ids) and isinstance(ids[0], int)
        batch = [ids] if single else ids
        if not all(isinstance(x, list) and x and all(isinstance(t, int) for t in x) for x in batch):
            raise RequestError(f"{path}: input_ids must be a non-empty list of token ids or a list of such lists",
                               validation=True)
    else:
        if model.tokenizer is None:
            raise RequestError(f"{path}: text given but {path} has no tokenizer here; send input_ids")
        single = isinstance(text, str)
        texts = [text] if single else text
        if not all(isinstance(t, str) for t in texts):
            raise RequestError(f"{path}: text must be a string or a list of strings", validation=True)
        batch = [model.tokenizer.encode(t) for t in texts]
    vocab = model.model.config.vocab_size
    for x in batch:
        if len(x) > context_len:
            raise RequestError(f"The input ({len(x)} tokens) is longer than the model's context length "
                               f"({context_len} tokens).")
        bad = [t for t in x if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{path}: token id {bad[0]} is outside the vocabulary ({vocab})")
    rid = body.get("rid")
    if rid is None:
        import uuid

        rids = [uuid.uuid4().hex for _ in batch]
    elif isinstance(rid, list):
        if len(set(rid)) != len(rid):
            raise RequestError(f"Duplicate request IDs detected within the request: {rid}")
        if len(rid) != len(batch):
            raise RequestError(f"{path}: {len(rid)} rids for {len(batch)} inputs")
        rids = [str(r) for r in rid]
    else:
        rids = [str(rid)] if single else [f"{rid}_{i}" for i in range(len(batch))]
    return rids, batch, single


def answer(rid: str, embedding: list[float], prompt_tokens: int, weight_version: str, t0: float,
           prompt_ids: Optional[list[int]] = None) -> dict:
    """One element of SGLang's /classify answer (BatchEmbeddingOutput -> out_dict)."""
    meta = {"id": rid, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": prompt_tokens,
            "weight_version": weight_version, "num_retractions": 0, "cached_tokens": 0,
            "e2e_latency": time.monotonic() - t0}
    out = {"embedding": embedding, "meta_info": meta}
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    return out


def add_routes(app, state, json_body) -> None:
    """/classify and /encode (the same handler in SGLang) on an --is-embedding server."""

    async def classify(request: Request):
        t0 = time.monotonic()
        path = request.url.path
        body = await json_body(request, path)
        rids, batch, single = parse(body, state.model, state.limits.context_len, path)
        scores = await state.on_model(state.model.scores, batch, generation=True)
        want_ids = bool(body.get("return_prompt_token_ids"))
        items = [answer(r, s, len(x), state.weight_version, t0, x if want_ids else None)
                 for r, s, x in zip(rids, scores, batch)]
        return items[0] if single else items

    app.api_route("/classify", methods=["POST", "PUT"])(classify)
    app.api_route("/encode", methods=["POST", "PUT"])(classify)
