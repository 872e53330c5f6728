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

__all__ = ["Step", "compile_node", "reader"]

Step = tuple[str, Callable[[nn.Module, dict[str, Any]], Any], tuple[str, ...]]


def compile_node(node: fx.Node, i: int, last_use: dict[str, int]) -> Step:
    """One node as (output name, ``call(model, env)``, names to drop after it)."""
    drops = tuple(dict.fromkeys(u.name for u in node.all_input_nodes if last_use[u.name] <= i + 1))
    args, kwargs = reader(node.args), reader(node.kwargs)
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


def reader(value: Any) -> Callable[[dict[str, Any]], Any]:
    """A function of the value dict that rebuilds ``value`` (node arguments) with live values.

    Containers come back as plain ``list``, ``tuple`` and ``dict``, never fx's immutable
    ones, and no fx object is touched per call: dynamo can trace neither (NOTE [Traces
    under torch.compile] in ``walkers/graph.py``).
    """
    if isinstance(value, tuple) and all(not isinstance(v, (tuple, list, dict, slice)) for v in value):
        # the common case: a flat tuple of nodes and constants
        slots = tuple((True, v.name) if isinstance(v, fx.Node) else (False, v) for v in value)
        if all(not is_node for is_node, _ in slots):
            return lambda env: value
        return lambda env: tuple(env[v] if is_node else v for is_node, v in slots)
    if not _has_node(value):
        constant = _plain(value)
        if isinstance(constant, (list, dict)):  # a fresh one per call: a callee may change it
            return lambda env: _plain(constant)
        return lambda env: constant
    if isinstance(value, fx.Node):
        name = value.name
        return lambda env: env[name]
    if isinstance(value, slice):
        start, stop, step = reader(value.start), reader(value.stop), reader(value.step)
        return lambda env: slice(start(env), stop(env), step(env))
    if isinstance(value, dict):
        entries = tuple((k, reader(v)) for k, v in value.items())
        return lambda env: {k: read(env) for k, read in entries}
    readers = tuple(reader(v) for v in value)
    if isinstance(value, list):
        return lambda env: [read(env) for read in readers]
    if type(value) is tuple:
        return lambda env: tuple([read(env) for read in readers])
    kind = type(value)  # a named tuple
    return lambda env: kind(*[read(env) for read in readers])


def _has_node(value: Any) -> bool:
    if isinstance(value, fx.Node):
        return True
    if isinstance(value, slice):
        return any(_has_node(v) for v in (value.start, value.stop, value.step))
    if isinstance(value, dict):
        return any(_has_node(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_node(v) for v in value)
    return False


def _plain(value: Any) -> Any:
    """``value`` with fx's immutable lists and dicts made plain ones (node-free values)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value
