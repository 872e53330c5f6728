"""What the graph walker needs to know about single fx nodes and the tracer that makes them.

Which calls draw no random numbers (the runtime skips torch's RNG stash for units made of
them only), which write into an argument in place, which module a node belongs to, and a
tracer that records ``no_grad`` regions and keeps modules with hooks, and subclasses of
torch's own layers, whole.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

__all__ = [
    "META_METHODS",
    "PURE_FUNCTIONS",
    "PURE_METHODS",
    "GradModeTracer",
    "has_hooks",
    "module_path",
    "mutated_arg",
]

# Functions and methods that draw no random numbers; anything else in a unit makes the
# runtime keep torch's RNG stash for it (see _RNG_FREE in execution/checkpoint_args.py).
PURE_FUNCTIONS = {
    operator.add, operator.iadd, operator.mul, operator.imul, operator.sub, operator.truediv,
    operator.getitem, operator.matmul, operator.neg, getattr,
    torch.flatten, torch.cat, torch.stack, torch.add, torch.mul, torch.matmul, torch.relu,
    torch.tanh, torch.sigmoid, torch.softmax, torch.arange, torch.ones, torch.zeros, torch.tril,
    torch.transpose, torch.permute, torch.reshape, torch.chunk, torch.split, torch._C._set_grad_enabled,
    nn.functional.relu, nn.functional.gelu, nn.functional.silu, nn.functional.softmax,
    nn.functional.layer_norm, nn.functional.linear, nn.functional.adaptive_avg_pool2d,
    nn.functional.scaled_dot_product_attention,
}  # fmt: skip
PURE_METHODS = {
    "view", "reshape", "flatten", "size", "dim", "permute", "transpose", "contiguous", "add",
    "add_", "mul", "mul_", "relu", "relu_", "mean", "sum", "chunk", "split", "unsqueeze",
    "squeeze", "expand", "masked_fill", "masked_fill_", "softmax", "matmul", "t", "to", "float",
    "type_as", "__getitem__",
}  # fmt: skip
META_METHODS = {"size", "dim"}


def has_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has forward or backward hooks of its own."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def module_path(node: fx.Node) -> str:
    """The qualified name of the module whose code produced ``node`` (\"\" outside any)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return str(node.target) if node.op == "call_module" else ""
    key = list(stack.keys())[-1]
    value = stack[key]
    path = value[0] if isinstance(value, tuple) else key
    return str(path).split("@")[0]


def mutated_arg(node: fx.Node, module_at: Callable[[str], nn.Module]) -> fx.Node | None:
    """The argument ``node`` writes into in place (a trailing-underscore method, ``inplace=True``,
    ``+=``, a module with ``inplace=True``), or ``None``; ``module_at`` finds a module by its
    qualified name."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None:
        return None
    if node.op == "call_method" and _in_place_name(str(node.target)):
        return first
    if node.op == "call_function" and (
        node.kwargs.get("inplace") is True
        or node.target in (operator.iadd, operator.imul)
        or _in_place_name(getattr(node.target, "__name__", ""))
    ):
        return first
    if node.op == "call_module" and getattr(module_at(str(node.target)), "inplace", False) is True:
        return first
    return None


class GradModeTracer(fx.Tracer):
    """``fx.Tracer`` that also records grad-mode switches (``with torch.no_grad():``).

    Plain symbolic tracing drops them, which would make a no-grad region record gradients.
    Buffers are traced as graph values, so code may slice them with traced sizes. A
    parameter or buffer read is found by identity in a table made once per trace: fx
    searches all of the model's parameters at every read, which took seconds on models
    with a thousand parameters (timm's mobileone).
    """

    proxy_buffer_attributes = True
    _tensor_names: dict[int, str]

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """The ``get_attr`` proxy of a parameter or buffer of the root, else ``attr_val``."""
        if not isinstance(attr_val, torch.Tensor):
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        name = self._tensor_names.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Modules with hooks stay whole, so their hooks fire as in eager mode, and so do
        subclasses of torch's own layers (NOTE [Subclassed torch layers stay whole])."""
        return (
            super().is_leaf_module(m, module_qualified_name) or has_hooks(m) or _extends_torch_layer(type(m))
        )

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        real = torch._C._set_grad_enabled

        def record(mode: bool) -> None:
            self.create_proxy("call_function", real, (bool(mode),), {})
            real(mode)

        self._tensor_names = {}
        if isinstance(root, nn.Module):  # the first name wins, as in fx's own search
            for n, t in [*root.named_parameters(), *root.named_buffers()]:
                self._tensor_names.setdefault(id(t), n)
        torch._C._set_grad_enabled = record  # type: ignore[assignment]
        try:
            return super().trace(root, concrete_args)
        finally:
            torch._C._set_grad_enabled = real


# NOTE [Subclassed torch layers stay whole]
#     fx keeps torch's own layers (``nn.Conv2d``, ``nn.BatchNorm2d``) as single nodes but
#     traces through a library's subclass of one. timm's ``BatchNormAct2d`` (a ``BatchNorm2d``
#     that also applies its activation) became thirteen nodes: an input check (four), five
#     parameter and buffer reads, the counter's ``add_``, ``batch_norm``, dropout and the
#     activation. A cut inside one never helps (each value in it is the size of the layer's
#     input), yet every node costs time when tracing and again in every step the graph
#     runs. Kept whole, timm's mobilenetv2_035 traces to 161 nodes instead of 785, and its
#     "sqrt" plan takes 74 ms instead of 107 (a 40 ms training step). Containers
#     (``nn.Sequential``, an ``nn.ModuleDict`` with a ``forward`` such as torchvision's
#     backbone getter) are still traced through, and so is anything that derives from
#     ``nn.Module`` alone. In-place writes inside such a layer are the dry run's to find,
#     as for torch's own layers.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _extends_torch_layer(cls: type) -> bool:
    """Whether ``cls`` is defined outside torch and derives from one of torch's modules that
    is not a container (NOTE [Subclassed torch layers stay whole])."""
    if _from_torch_nn(cls) or issubclass(cls, _CONTAINERS):
        return False
    return any(
        _from_torch_nn(base) and base is not nn.Module and issubclass(base, nn.Module)
        for base in cls.__mro__[1:]
    )


def _from_torch_nn(cls: type) -> bool:
    return cls.__module__.startswith(("torch.nn.", "torch.ao.nn."))


def _in_place_name(name: str) -> bool:
    """torch's naming rule: ``relu_``, ``add_``, but not ``__getitem__``."""
    return name.endswith("_") and not name.startswith("__")
