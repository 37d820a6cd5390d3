"""Agentic multi-turn rollouts: tools, tool-call parsing, token-in token-out trajectories.

  tools.py       tools as plain Python functions (schema from type hints and docstring) or veRL
                 `BaseTool` classes from a veRL tool-config YAML; sync or async; per-record selection
  parse.py       tool calls parsed by SGLang's own FunctionCallParser (read from the installed wheel)
  template.py    what the chat template appends after an assistant turn (tool messages as context
                 tokens), and the drift check against the template's own rendering
  trajectory.py  one trajectory as token ids with a sampled/context mask, its turns and finish reason
  runner.py      runs trajectories, each advancing on its own, through any `generate` callable
episode.py     one trajectory's run as a typed record and the states of the runner's state machine
threads.py     synchronous user code (tools, environments) in daemon threads, never holding the process
  calls.py       a trajectory's tool calls: timeouts, parallel calls, veRL's tool lifecycle, truncated replies
  constrain.py   constrained tool calls (tool_choice, reset_tool_choice, stop_after_call) as SGLang constrains them
  environment.py environments (games, user simulators): `reset` / `step` after turns without tool calls
  interaction.py veRL's interactions (BaseInteraction, interaction config YAML) as an environment
  examples.py    the tools of the built-in examples (the peek task's veRL-style tool)
  turn_routes.py a trajectory's routed experts (R3) assembled from its turns
"""
