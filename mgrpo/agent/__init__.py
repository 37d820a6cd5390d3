"""Agentic multi-turn rollouts: tools, tool-call parsing, token-in token-out trajectories.

  tools.py       tools as plain Python functions (schema from type hints and docstring) or veRL
                 `BaseTool` classes from a veRL tool-config YAML; sync or async; per-record selection
  parse.py       tool calls parsed by SGLang's own FunctionCallParser (read from the installed wheel)
  template.py    what the chat template appends after an assistant turn (tool messages as context
                 tokens), and the drift check against the template's own rendering
  trajectory.py  one trajectory as token ids with a sampled/context mask, its turns and finish reason
  runner.py      runs trajectories, each advancing on its own, through any `generate` callable
"""
