"""The CPU server's tokenizer and grammar compiler: what SGLang's tokenizer manager and grammar backend hold,
for the requests that need text (stop strings and patterns, grammars). Prompts still arrive as token ids.

SGLang loads the tokenizer at `--tokenizer-path` (default: `--model-path`) unless `--skip-tokenizer-init`, and
builds its xgrammar backend from it (constrained/grammar_manager.py: none without a tokenizer). Here the same,
with one difference: a checkpoint without tokenizer files (the tests' tiny ones, written without one) does not
fail the launch as it fails SGLang's; the server runs as under `--skip-tokenizer-init`, says so in its log,
and refuses stop strings, stop patterns and grammars with SGLang's own messages for that case:
- stop, stop_regex: "stop=[...] (stop_regex=[...]) is unavailable when skip_tokenizer_init=True (...)"
  (sampling_params.py, 400);
- a grammar: "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when the
  server is launched with --grammar-backend none" (grammar_manager.py, the request aborted with 400).
Grammars compile with `mgrpo/rollout/grammar.py` (the in-process engine's path), built on first use, cached.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

from mgrpo.rollout.sglang.cpu.receive import RequestError

log = logging.getLogger("mgrpo.cpu_server")

NO_GRAMMAR_BACKEND = ("Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when "
                      "the server is launched with --grammar-backend none")
"""SGLang's words (constrained/grammar_manager.py) for a grammar request to a server without a grammar backend."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """SGLang's get_tokenizer for a local checkpoint: transformers' AutoTokenizer, with
    `additional_stop_token_ids` attached as hf_transformers_utils.py does (<|eom_id|> where the vocabulary has
    it). None where the directory has no tokenizer."""
    import os

    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        # transformers 5 builds an empty tokenizer from config.json alone instead of failing
        log.info("no tokenizer files in %s (%s)", path, ", ".join(TOKENIZER_FILES))
        return None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        log.info("no tokenizer at %s (%s: %s)", path, type(e).__name__, str(e).splitlines()[0][:200])
        return None
    added = tok.get_added_vocab()
    tok.additional_stop_token_ids = {added["<|eom_id|>"]} if "<|eom_id|>" in added else None
    return tok


class ServerText:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._grammars = None
        self.tokenizer_unsupported = False
        """xgrammar could not read the tokenizer: as SGLang, no grammar backend (grammars refused)."""
        self._lock = threading.Lock()

    @classmethod
    def load(cls, args, vocab_size: int, eos_ids: Sequence[int]) -> "ServerText":
        tok = None
        if not args.skip_tokenizer_init:
            path = args.tokenizer_path or args.model_path
            tok = load_tokenizer(path)
            if tok is None:
                log.warning("%s has no tokenizer: serving as with --skip-tokenizer-init (stop strings and grammars "
                            "are refused; SGLang would not start)", path)
        return cls(tok, vocab_size, eos_ids)

    def stop_ids(self) -> set[int]:
        """Token ids beyond the model's EOS that end a response (Req._check_token_based_finish: the tokenizer's
        eos_token_id and its additional_stop_token_ids)."""
        tok = self.tokenizer
        if tok is None:
            return set()
        extra = set(getattr(tok, "additional_stop_token_ids", None) or ())
        return extra | ({tok.eos_token_id} if tok.eos_token_id is not None else set())

    def grammars(self):
        """The xgrammar compiler over this tokenizer, SGLang's TokenizerInfo (the model's vocabulary size and
        EOS ids); built once, on the first grammar request."""
        with self._lock:
            if self._grammars is None:
                from mgrpo.rollout.grammar import Grammars

                try:
                    self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
                except Exception as e:  # noqa: BLE001 - SGLang: TokenizerNotSupportedError -> backend 'none'
                    log.warning("Grammar backend disabled because tokenizer is not supported by XGrammar: %s", e)
                    self.tokenizer_unsupported = True
                    raise RequestError(NO_GRAMMAR_BACKEND) from None
            return self._grammars

    def compile(self, reqs: Sequence) -> None:
        """Each request's grammar (`Req.grammar_key`: SGLang's (kind, value)) compiled into `Req.grammar`;
        RequestError with SGLang's message for one that does not compile. Runs off the event loop."""
        from mgrpo.rollout.grammar import GrammarError

        for r in reqs:
            if r.grammar_key is None:
                continue
            if self.tokenizer is None or self.tokenizer_unsupported:
                raise RequestError(NO_GRAMMAR_BACKEND)
            try:
                r.grammar = self.grammars().compile(*r.grammar_key)
            except GrammarError as e:
                raise RequestError(str(e)) from None


def grammar_key(sp: dict) -> Optional[tuple[str, str]]:
    """SGLang's grammar key of a request (grammar_manager.py::process_req_with_grammar): (kind, value) of its
    one grammar field, None without one. Empty values are unset (SamplingParams.__post_init__)."""
    for field, kind in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf"),
                        ("structural_tag", "structural_tag")):
        if sp.get(field):
            return kind, sp[field]
    return None
