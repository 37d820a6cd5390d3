"""`model.tokenizer=printable`: a character-level tokenizer for a user's own text task on the tiny model.

The synthetic tokenizer knows `0-9 + =`; the real Qwen3 vocabulary (151,936 tokens) leaves a randomly
initialised tiny model nothing to learn from. This one covers what a text task needs and stays small:

    0 <|endoftext|>  1 <|im_start|>  2 <|im_end|>  3 <think>  4 </think>  5 <tool_call>  6 </tool_call>
    7 <tool_response>  8 </tool_response>  9 <unk>  10 '\\t'  11 '\\n'  12..106 ' '..'~' (0x20-0x7E)

107 tokens. The first nine are Qwen3's own: as in Qwen3's tokenizer, <|endoftext|>, <|im_start|> and <|im_end|>
are special (dropped by skip_special_tokens), the think/tool tags are added but not special (they stay in
decoded text, where SGLang's qwen25 tool-call parser and reasoning parser look for them); <|im_end|> is the
EOS (a chat turn ends there, so generation stops there) and <|endoftext|> the padding, as in Qwen3's
tokenizer_config.json. Every other character is one token; whitespace is kept. A character outside the
vocabulary encodes as <unk>, which the prompt dataset refuses (naming file:line and field), never trains on.

The chat template is a minimal Qwen3 one: system / user / assistant / tool roles, a `tools` list rendered
into the system message (a shorter preamble than Qwen3's, which would cost ~300 character tokens), an
assistant's tool calls as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, consecutive tool
results as `<tool_response>` blocks in one user turn, and `add_generation_prompt` (with Qwen3's empty
think block when enable_thinking=False). Unlike Qwen3's template it keeps an earlier assistant turn's
<think> block as written (what the model generated is what it is trained on) and refuses an unknown role
rather than skipping it.
"""

from __future__ import annotations

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen3's special tokens (special=True in its tokenizer.json)."""
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Qwen3's added, non-special tokens: they survive skip_special_tokens, as parsers need."""
UNK = "<unk>"
CHARACTERS = ("\t", "\n") + tuple(chr(c) for c in range(0x20, 0x7F))
VOCAB = {tok: i for i, tok in enumerate(SPECIAL + ADDED + (UNK,) + CHARACTERS)}
PAD, EOS = "<|endoftext|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{{- raise_exception('unknown chat role ' + message.role + ' (system, user, assistant or tool)') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def printable_tokenizer():
    """The character-level tokenizer described in the module docstring, as a PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    # Every character its own word ('[\s\S]', not '.', which misses '\n'); WordLevel maps each to its id or <unk>.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "a", " ", "b" -> "a b" (the default decoder would join with spaces)
    # Matched before pre-tokenization, so "<|im_end|>" is one token, never thirteen characters.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL + (UNK,)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   additional_special_tokens=[SPECIAL[1]], chat_template=CHAT_TEMPLATE,
                                   model_max_length=1024, padding_side="left")
