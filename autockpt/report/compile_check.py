"""Which checkpointed segments torch.compile cannot capture whole.

Under ``torch.compile`` each checkpointed segment becomes one higher-order op whose body
dynamo must trace as a single graph; see NOTE [Under torch.compile] in ``execution/runtime.py``. A
graph break inside a body (data-dependent control flow, ``.item()``, an unsupported
call) makes dynamo give up on the op, and the segment may then run without being
checkpointed. Dynamo itself does not count these as graph breaks, so
:func:`find_graph_breaks` traces every checkpointed segment alone, on the values a
forward pass hands it, and reports the ones that fail, with dynamo's reason.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autockpt.errors import AutockptError
from autockpt.execution.forward import installed
from autockpt.execution.runtime import compiled_body, run_body
from autockpt.measure.sandbox import dry_run_state
from autockpt.measure.tensors import as_args

__all__ = ["GraphBreak", "find_graph_breaks"]


@dataclass(frozen=True)
class GraphBreak:
    """A checkpointed segment that dynamo cannot trace as one graph.

    Attributes:
        segment: index of the segment in the plan.
        stages: names of its stages.
        reason: dynamo's explanation (first lines), with the user code location.
    """

    segment: int
    stages: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return f"segment {self.segment} ({', '.join(self.stages)}): {self.reason}"


def find_graph_breaks(
    model: nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    example_kwargs: dict[str, Any] | None = None,
) -> list[GraphBreak]:
    """Trace each checkpointed segment of ``model`` with dynamo; list those that break.

    The model must be checkpointed (``auto_checkpoint``) by the sequential or graph
    walker. It runs one forward on the example inputs without changing buffers or the RNG;
    each checkpointed segment is traced with ``fullgraph=True`` and the ``"eager"`` backend
    (no code is generated). An empty list means every segment compiles as one checkpoint.

    Examples:
        >>> import autockpt, torch
        >>> model = autockpt.auto_checkpoint(torch.nn.Sequential(*[torch.nn.Linear(4, 4)] * 4), 2)
        >>> autockpt.find_graph_breaks(model, (torch.randn(2, 4),))
        []
    """
    fwd = installed(getattr(model, "_orig_mod", model))
    if fwd is None:
        raise AutockptError(
            "find_graph_breaks: the model is not checkpointed. Call autockpt.auto_checkpoint(model) first."
        )
    if fwd.walked.walker == "blocks":
        raise AutockptError(
            "find_graph_breaks: the model is checkpointed block by block (fx could not trace it), "
            "so its segments cannot be traced alone. Use torch._dynamo.explain(model) instead."
        )
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    x = fwd.walked.entry_value(args, kwargs, where="find_graph_breaks")
    breaks: list[GraphBreak] = []
    with dry_run_state(fwd.model, x), torch.no_grad():
        for i, rt in enumerate(fwd.runtime):
            if rt.segment.checkpoint:
                leaves, spec = tree_flatten(x)
                body = functools.partial(compiled_body, rt, spec)
                try:
                    torch.compile(body, fullgraph=True, backend="eager")(*leaves)
                except Exception as err:
                    reason = _reason(str(err))
                    breaks.append(GraphBreak(i, tuple(s.name for s in rt.stages), reason))
            x = run_body(rt, x)
    return breaks


def _reason(message: str) -> str:
    """Dynamo's first line, and the user code line it points at when it says."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    where = next((line for line in lines if line.startswith("# File ") or line.startswith("File ")), None)
    head = lines[0] if lines else "dynamo could not trace it"
    return f"{head} ({where.lstrip('# ')})" if where else head
