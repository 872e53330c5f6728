"""Code that ``torch.compile`` must run as Python, not trace: one typed decorator.

Dynamo traces what a compiled model calls into its graph; a function marked here is called
as it is, between the graphs before and after it (one graph break, where it is called).
autockpt marks the work that cannot be a graph: a walk or trace of the model made again
(NOTE [Planned once, compiled whole] in ``execution/forward.py``) and the chunked loss,
whose chunk loop, target checks and in-forward gradients are data-dependent Python (NOTE
[The chunked loss under torch.compile] in ``execution/linear_cross_entropy.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["outside_compiled_graphs"]

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_compiled_graphs(fn: _F) -> _F:
    """``fn``, run by Python even inside a compiled region (``torch.compiler.disable``)."""
    return cast(_F, torch.compiler.disable(fn))
