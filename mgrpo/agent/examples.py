"""Tools of the built-in examples, written as users write theirs.

`PeekTool` is a veRL-style stateful tool (create / execute / calc_reward / release) for the `peek` task
(data.synthetic_task=peek): each record's hidden digit reaches its tool instance through veRL's
`extra_info.tools_kwargs.peek.create_kwargs`, and `execute` reveals it. configs/tools/peek.yaml lists it in veRL's
tool-config format.
"""

from __future__ import annotations

import uuid
from typing import Optional

from mgrpo.agent.tools import BaseTool


class PeekTool(BaseTool):
    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.secrets: dict[str, int] = {}

    async def create(self, instance_id: Optional[str] = None, secret: Optional[int] = None, **kwargs) -> str:
        if secret is None:
            raise ValueError("the peek tool needs extra_info.tools_kwargs.<its name>.create_kwargs.secret")
        iid = instance_id or str(uuid.uuid4())
        self.secrets[iid] = int(secret)
        return iid

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        # config.repeat: the digit said that many times (configs/tools/peek.yaml: a reply a random tiny model
        # can pick the digit out of by its frequency in the context; 1 by default)
        return str(self.secrets[instance_id]) * int(self.config.get("repeat", 1)), None, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        self.secrets.pop(instance_id, None)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: for example "3 * (4 + 5)"
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.USub: operator.neg}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    value = ev(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else str(value)
