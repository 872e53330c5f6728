"""Graph programs' nodes as closures, so running a trace costs little per node.

NOTE [Running a trace]
    Graph-walked models run their trace node by node in Python on every training step, so
    the per-node cost is overhead on every step (tens of nodes per millisecond of compute
    in small convnets). Each node is turned once into a closure: constant arguments bound,
    node arguments read straight from the value dict, and the values it is the last user
    of listed. Submodules are still looked up on every call, through ``_modules`` (what
    ``setattr`` on a module updates), so replacing a layer after planning (a new
    classifier head) is seen, as it was with ``get_submodule``. Before: mobilenetv3 at
    64 px spent a fifth of a checkpointed step interpreting nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx, nn

__all__ = ["Step", "compile_node"]

Step = tuple[str, Callable[[nn.Module, dict[str, Any]], Any], tuple[str, ...]]


def compile_node(node: fx.Node, i: int, last_use: dict[str, int]) -> Step:
    """One node as (output name, ``call(model, env)``, names to drop after it)."""
    drops = tuple(dict.fromkeys(u.name for u in node.all_input_nodes if last_use[u.name] <= i + 1))
    args, kwargs = _reader(node.args), _reader(node.kwargs)
    target = node.target
    call: Callable[[nn.Module, dict[str, Any]], Any]
    if node.op == "call_module":
        path = tuple(str(target).split("."))

        def call(model: nn.Module, env: dict[str, Any]) -> Any:
            module = model
            for part in path:
                module = module._modules[part]  # type: ignore[assignment]
            return module(*args(env), **kwargs(env))

    elif node.op == "call_function":
        fn = target

        def call(model: nn.Module, env: dict[str, Any]) -> Any:
            return fn(*args(env), **kwargs(env))  # type: ignore[operator]

    elif node.op == "call_method":
        method = str(target)

        def call(model: nn.Module, env: dict[str, Any]) -> Any:
            self_arg, *rest = args(env)
            return getattr(self_arg, method)(*rest, **kwargs(env))

    elif node.op == "get_attr":
        parts = str(target).split(".")

        def call(model: nn.Module, env: dict[str, Any]) -> Any:
            attr: Any = model
            for part in parts:
                attr = getattr(attr, part)
            return attr

    else:
        raise AssertionError(f"unexpected fx node op {node.op!r}")
    return node.name, call, drops


def _reader(value: Any) -> Callable[[dict[str, Any]], Any]:
    """A function of the value dict that rebuilds ``value`` (node arguments) with live values."""
    if isinstance(value, tuple) and all(not isinstance(v, (tuple, list, dict)) for v in value):
        # the common case: a flat tuple of nodes and constants
        slots = tuple((True, v.name) if isinstance(v, fx.Node) else (False, v) for v in value)
        if all(not is_node for is_node, _ in slots):
            return lambda env: value
        return lambda env: tuple(env[v] if is_node else v for is_node, v in slots)
    if isinstance(value, dict) and not value:
        return lambda env: value
    return lambda env: fx.node.map_arg(value, lambda n: env[n.name])
