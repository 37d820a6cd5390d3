"""The model vocabulary that follows the tokenizer: `${tokenizer_vocab:${model.tokenizer}}` in configs/model/.

configs/model/tiny.yaml sets `vocab_size: ${tokenizer_vocab:${model.tokenizer}}`, so `model.tokenizer=printable`
alone gives the tiny model the printable tokenizer's 107 rows (an explicit `model.vocab_size=N` still wins).
Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP anyway (128 on one rank), so the
tiny model costs the same with 16 or 107 rows. The sizes are those of the built-in tokenizers
(mgrpo.data.tokenizer checks each against its tokenizer); a tokenizer directory has no known size here and
needs model.vocab_size given (the run refuses a vocabulary smaller than its tokenizer, naming both keys).
"""

from __future__ import annotations

BUILTIN_TOKENIZER_VOCAB = {
    "synthetic": 16,  # 15 tokens (mgrpo.data.synthetic), one spare row: the default job's vocabulary
    "printable": 107,  # mgrpo.data.printable
    "qwen3": 151936,  # Qwen3 checkpoints' embedding rows (151,669 tokens, padded by Qwen)
}


def tokenizer_vocab(name: str) -> int:
    """The model.vocab_size for a built-in model.tokenizer."""
    if name not in BUILTIN_TOKENIZER_VOCAB:
        from mgrpo.config.validate import ConfigError

        raise ConfigError(f"model.tokenizer={name!r} is not built in ({', '.join(BUILTIN_TOKENIZER_VOCAB)}), so "
                          "the model preset cannot size its vocabulary from it: give model.vocab_size=N "
                          "(at least the tokenizer's length, len(AutoTokenizer.from_pretrained(DIR)))")
    return BUILTIN_TOKENIZER_VOCAB[name]


def register_resolver() -> None:
    """Make `${tokenizer_vocab:NAME}` available to every config composed in this process."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("tokenizer_vocab"):
        OmegaConf.register_new_resolver("tokenizer_vocab", tokenizer_vocab)
