"""``head="chunked"``: a causal language model's head and loss run by ``linear_cross_entropy``.

NOTE [The head inside the model's own forward]
    A Hugging Face causal LM's forward runs its decoder, then ``logits = self.lm_head(h)``,
    maybe Gemma 2's soft-capping, then ``self.loss_function(logits, labels, ...)``. Rather
    than write that forward again for every architecture (each has its own decoder call,
    arguments and outputs), the model's own forward runs, and for the length of the call
    two things are swapped: the head's ``forward`` keeps its input and returns a 0-d
    stand-in, and ``loss_function`` computes the loss from that input by
    ``linear_cross_entropy`` with the same label shift, ``ignore_index``,
    ``num_items_in_batch`` and ``.float()``. The stand-in goes through the soft-capping
    ops (which are then applied per chunk) and out of the forward as ``logits``, where it
    is replaced by ``None``.

    That is only right when nothing else happens to the logits or the loss, so the
    forward's source is read once (``_check_forward``): the head's line must be
    ``logits = self.<head>(x)`` and nothing more (Falcon-H1 scales it there), the lines
    after it none or exactly Gemma 2's soft-capping, the loss ``loss =
    self.loss_function(logits, ...)`` alone in its ``if labels is not None:`` (Bamba adds a
    z-loss there), and nothing may change ``loss`` after it (a mixture of experts adds its
    router loss). Anything else is refused with the line that was found, never run
    half-right. What was checked of the head itself (the same ``nn.Linear``, no forward of
    its own, no hooks, no ``_loss_function`` set) is checked again at every call, since
    adapters and hooks arrive after wrapping. Only calls with ``labels`` and gradients on
    take this path; the others run the model's forward untouched and return their logits.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autockpt.errors import AutockptError
from autockpt.execution.linear_cross_entropy import auto_rows, linear_cross_entropy
from autockpt.plan import format_bytes

__all__ = [
    "HEADS",
    "ChunkedHeadForward",
    "can_chunk",
    "head_parameters",
    "installed_head",
    "set_head",
    "whole_head_note",
]

HEADS = ("whole", "chunked")

_SOFTCAP = (  # Gemma 2's final logit soft-capping, line by line
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
)
_SOFTCAP_IF = "self.config.final_logit_softcapping is not None"


class ChunkedHeadForward:
    """What a causal LM's ``forward`` is under ``head="chunked"`` (below autockpt's own
    checkpointed forward, which calls it as the model's forward)."""

    _autockpt_head = True

    def __init__(
        self,
        model: nn.Module,
        head_name: str,
        softcap: bool,
        chunks: int | str,
        original: Callable[..., Any] | None,
    ) -> None:
        self.model = model
        self.head_name = head_name  # the attribute the forward calls: lm_head, embed_out, ...
        self.softcap = softcap  # the forward soft-caps its logits (Gemma 2)
        self.chunks = chunks
        self.original = original  # the user's own instance forward, if any
        self.head = getattr(model, head_name)

    def _head_as_installed(self) -> nn.Linear:
        """The head, as it was checked when installed; anything changed since raises."""
        model, name = self.model, type(self.model).__name__
        head = getattr(model, self.head_name)
        changed = (
            "it was replaced" if head is not self.head
            else "it has a forward of its own" if "forward" in head.__dict__
            else "it has forward hooks" if head._forward_hooks or head._forward_pre_hooks
            else "_loss_function was set" if "_loss_function" in model.__dict__
            else ""
        )  # fmt: skip
        if changed:
            raise AutockptError(
                f"head='chunked': {name}'s head {self.head_name} changed after auto_checkpoint "
                f"({changed}), so the chunked loss would no longer be the model's. Call "
                f"auto_checkpoint(model, head='chunked') again to check it, or head='whole'."
            )
        return head  # type: ignore[no-any-return]

    @property
    def profile_key(self) -> tuple[str, int | str]:
        """What a cached profile of the model depends on here (``measure/model_profile.py``)."""
        return ("chunked head", self.chunks)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._plain())

    def _plain(self) -> Callable[..., Any]:
        return self.original or type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plain = self._plain()
        if "labels" in kwargs:  # how Hugging Face's callers pass them; reading a signature costs more
            labels = kwargs["labels"]
        else:
            labels = inspect.signature(plain).bind_partial(*args, **kwargs).arguments.get("labels")
        if labels is None or not torch.is_grad_enabled():
            return plain(*args, **kwargs)
        model, head = self.model, self._head_as_installed()
        seen: dict[str, torch.Tensor] = {}

        def keep_input(hidden: torch.Tensor) -> torch.Tensor:
            seen["hidden"] = hidden
            seen["stand_in"] = hidden.new_zeros(())
            return seen["stand_in"]

        def chunked_loss(
            logits: torch.Tensor,
            labels: torch.Tensor,
            vocab_size: int | None = None,
            num_items_in_batch: torch.Tensor | int | None = None,
            ignore_index: int = -100,
            shift_labels: torch.Tensor | None = None,
            **_: Any,
        ) -> torch.Tensor:
            if "hidden" not in seen:
                raise AutockptError(f"head='chunked': {type(model).__name__} computed a loss without a head.")
            return self._loss(seen["hidden"], labels, num_items_in_batch, ignore_index, shift_labels)

        had_head = head.__dict__.get("forward")
        had_loss = model.__dict__.get("_loss_function")
        head.__dict__["forward"] = keep_input
        model.__dict__["_loss_function"] = chunked_loss
        try:
            out = plain(*args, **kwargs)
        finally:
            _put_back(head.__dict__, "forward", had_head)
            _put_back(model.__dict__, "_loss_function", had_loss)
        return _without_logits(out, seen.get("stand_in"))

    def _loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        num_items_in_batch: torch.Tensor | int | None,
        ignore_index: int,
        shift_labels: torch.Tensor | None,
    ) -> torch.Tensor:
        """``ForCausalLMLoss`` (transformers' ``loss_utils``) by ``linear_cross_entropy``."""
        if shift_labels is None:  # tokens < n predict n; the last predicts nothing
            padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:].contiguous()
        target = shift_labels.to(hidden.device)
        if tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise AutockptError(
                f"head='chunked': {type(self.model).__name__} kept logits for {tuple(hidden.shape[:-1])} "
                f"tokens but the labels are {tuple(target.shape)}; with logits_to_keep the loss needs labels "
                f"for the kept tokens only (shift_labels=...)."
            )
        head = getattr(self.model, self.head_name)
        config = getattr(self.model, "config", None)
        return linear_cross_entropy(
            hidden,
            head.weight,
            target,
            head.bias,
            ignore_index=ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
            softcap=getattr(config, "final_logit_softcapping", None) if self.softcap else None,
            chunks=self.chunks,
            divisor=num_items_in_batch,
            logits_dtype=torch.float32,
        )


def _put_back(where: dict[str, Any], name: str, value: object) -> None:
    if value is None:
        where.pop(name, None)
    else:
        where[name] = value


def _without_logits(out: Any, stand_in: torch.Tensor | None) -> Any:
    """The model's output with ``logits=None`` in place of the stand-in (or what the
    soft-capping made of it: a 0-d tensor)."""
    if stand_in is None:
        return out
    if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...), None fields left out
        return type(out)(x for i, x in enumerate(out) if i != 1 or not _is_stand_in(x))
    if hasattr(out, "items") and _is_stand_in(out.get("logits")):
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return out


def _is_stand_in(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


def _holder(model: nn.Module) -> nn.Module:
    """The causal LM whose forward the chunked head takes over: the model inside a PEFT
    wrapper (``get_base_model()``, which PEFT's forward ends in), else the model itself."""
    get = getattr(model, "get_base_model", None)
    inner = get() if callable(get) else None
    return inner if isinstance(inner, nn.Module) and inner is not model else model


def installed_head(model: nn.Module) -> ChunkedHeadForward | None:
    """The chunked head forward on ``model`` (or the model a PEFT wrapper holds), under any
    checkpointed forward, if any."""
    model = _holder(model)
    fwd = model.__dict__.get("forward")
    fwd = getattr(fwd, "original_forward", fwd)
    return fwd if isinstance(fwd, ChunkedHeadForward) else None


def head_parameters(model: nn.Module) -> tuple[str, ...]:
    """The names of the chunked head's parameters (a tied embedding's name where Hugging
    Face lists the shared weight under it): the gradients chunking sums in another order."""
    fwd = installed_head(model)
    if fwd is None:
        return ()
    head = getattr(fwd.model, fwd.head_name)
    mine = {id(p) for p in head.parameters()}
    return tuple(n for n, p in model.named_parameters() if id(p) in mine)


def set_head(model: nn.Module, head: str, chunks: int | str = "auto", *, where: str) -> None:
    """Make ``model``'s forward compute its loss by ``linear_cross_entropy`` (``"chunked"``,
    NOTE [The head inside the model's own forward]) or not (``"whole"``), below autockpt's
    checkpointed forward if one is installed, above the user's own instance forward.

    Raises:
        ValueError: ``head`` is neither.
        AutockptError: ``"chunked"`` on a model whose loss this cannot take over; the
            message says what was found and what to do instead.
    """
    if head not in HEADS:
        raise ValueError(f"{where}: head={head!r}; use one of {HEADS}.")
    model = _holder(model)
    outer = model.__dict__.get("forward")
    checkpointed = getattr(outer, "_autockpt_forward", False) and hasattr(outer, "original_forward")
    current = getattr(outer, "original_forward") if checkpointed else outer  # noqa: B009
    base = current.original if isinstance(current, ChunkedHeadForward) else current
    new = _chunked_head(model, base, chunks, where) if head == "chunked" else base
    if checkpointed:
        outer.original_forward = new  # type: ignore[union-attr]
    else:
        _put_back(model.__dict__, "forward", new)


def whole_head_note(model: nn.Module, labels: object, predicted_peak: int | None) -> str | None:
    """For a plan with the whole head of a model ``head="chunked"`` could take over, called
    with ``labels``: what the head and loss hold at once, against the plan's predicted
    peak, and what the chunked head would hold instead. Counted, not measured: the logits,
    their log-probabilities and their gradient, in float32 as Hugging Face's loss casts
    them, for every labelled token."""
    if not isinstance(labels, torch.Tensor) or not predicted_peak or not can_chunk(model):
        return None
    head = _holder(model).get_output_embeddings()  # type: ignore[operator]
    classes, tokens = int(head.weight.shape[0]), labels.numel()
    whole = 3 * tokens * classes * 4
    chunked = 2 * min(tokens, auto_rows(head.weight, torch.float32)) * classes * 4
    return (
        f"the LM head and loss hold about {format_bytes(whole)} at once (logits, log-probabilities and "
        f"their gradient for {tokens} tokens x {classes} classes, {whole / predicted_peak:.0%} of the "
        f"predicted peak); head='chunked' would hold about {format_bytes(chunked)} of them"
    )


def can_chunk(model: nn.Module) -> bool:
    """Whether ``head="chunked"`` can take over ``model``'s head and loss."""
    try:
        _chunked_head(_holder(model), None, "auto", "can_chunk")
    except AutockptError:
        return False
    return True


def _chunked_head(
    model: nn.Module, original: Callable[..., Any] | None, chunks: int | str, where: str
) -> ChunkedHeadForward:
    """A chunked head forward for ``model``, checking first that it gives the model's loss."""
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        found = "no output embeddings" if head is None else f"a {type(head).__name__} head"
        raise AutockptError(
            f"{where}: head='chunked' takes over a Hugging Face causal LM's nn.Linear head and loss; "
            f"{name} has {found}. Compute the loss with autockpt.linear_cross_entropy(hidden, weight, "
            f"target) in the training step instead, or use head='whole'."
        )
    if head._forward_hooks or head._forward_pre_hooks:
        raise AutockptError(
            f"{where}: head='chunked': {name}'s head has forward hooks, which would see a stand-in "
            f"instead of the logits. Remove them, or use head='whole'."
        )
    loss_fn = getattr(model, "loss_function", None)
    if getattr(loss_fn, "__name__", None) != "ForCausalLMLoss":
        raise AutockptError(
            f"{where}: head='chunked' computes Hugging Face's ForCausalLMLoss; {name}'s loss function "
            f"is {getattr(loss_fn, '__name__', loss_fn)!r}. Use head='whole', or compute the loss with "
            f"autockpt.linear_cross_entropy in the training step."
        )
    if not _loss_function_swappable(model):
        raise AutockptError(
            f"{where}: head='chunked' replaces the loss through Hugging Face's loss_function property "
            f"(which reads _loss_function); {name}.loss_function does not read it. Use head='whole'."
        )
    head_name = next((n for n, m in model.named_children() if m is head), None)
    if head_name is None:
        raise AutockptError(f"{where}: head='chunked': {name}'s output embeddings are not a child of it.")
    softcap = _check_forward(type(model), head_name, where)
    return ChunkedHeadForward(model, head_name, softcap, chunks, original)


def _loss_function_swappable(model: nn.Module) -> bool:
    """Whether ``model.loss_function`` returns what ``_loss_function`` holds, as the
    property of Hugging Face's ``PreTrainedModel`` does."""
    had = model.__dict__.get("_loss_function")
    probe = _loss_function_swappable  # any object the property could not return otherwise
    model.__dict__["_loss_function"] = probe
    try:
        return getattr(model, "loss_function", None) is probe
    finally:
        _put_back(model.__dict__, "_loss_function", had)


def _check_forward(cls: type, head_name: str, where: str) -> bool:
    """Read ``cls.forward``: ``logits = self.<head>(x)`` (any name; ``.contiguous()`` or
    ``.float()`` after it), then nothing or Gemma 2's soft-capping, then ``loss =
    self.loss_function(logits, ...)`` (alone, or alone under ``if labels is not None:``),
    which nothing changes after. Returns whether it soft-caps."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))  # type: ignore[attr-defined]
    except (OSError, TypeError, SyntaxError) as err:
        raise AutockptError(f"{where}: head='chunked' cannot read {cls.__name__}.forward ({err}).") from err
    body = tree.body[0].body  # type: ignore[attr-defined]
    lines = [ast.unparse(s) for s in body]
    head_at = [i for i, line in enumerate(lines) if f"self.{head_name}(" in line]
    loss_at = [i for i, line in enumerate(lines) if "self.loss_function(" in line]
    refuse = f"{where}: head='chunked' cannot take over {cls.__name__}'s loss: "
    if len(head_at) != 1 or len(loss_at) != 1 or not head_at[0] < loss_at[0]:
        raise AutockptError(
            refuse + f"its forward does not call self.{head_name}(...) once and then self.loss_function(...) "
            "once. Use head='whole', or autockpt.linear_cross_entropy in the training step."
        )
    logits_name = _head_output(body[head_at[0]], head_name)
    if logits_name is None:
        raise AutockptError(
            refuse + f"its head line is {lines[head_at[0]]!r}, not logits = self.{head_name}(x): the chunked "
            "loss would leave the rest of that line out. Use head='whole'."
        )
    between = [ln for s in body[head_at[0] + 1 : loss_at[0]] for ln in _statements(s)]
    between = [ln for ln in between if ln != "loss = None"]
    if between and (between != list(_SOFTCAP) or logits_name != "logits"):
        raise AutockptError(
            refuse + f"between the head and the loss its forward runs {between[0]!r}, which the chunked "
            "loss would leave out. Use head='whole'."
        )
    if not _is_loss_call(body[loss_at[0]], logits_name):
        raise AutockptError(
            refuse + f"its loss is computed by {lines[loss_at[0]]!r}, not by loss = "
            "self.loss_function(logits, ...) alone, which is all the chunked loss computes. Use head='whole'."
        )
    for node in ast.walk(tree):
        changes = isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == "loss"
        if changes or (isinstance(node, ast.Assign) and node.lineno > body[loss_at[0]].end_lineno
                       and any(getattr(t, "id", None) == "loss" for t in node.targets)):  # fmt: skip
            raise AutockptError(
                refuse + f"its forward changes the loss after computing it ({ast.unparse(node)!r}, such as a "
                "mixture of experts' router loss). Use head='whole'."
            )
    return bool(between)


def _head_output(stmt: ast.stmt, head_name: str) -> str | None:
    """The name ``name = self.<head>(x)`` assigns, where the line is that and nothing more
    but ``.contiguous()`` or ``.float()`` (which change no value the loss sees: it upcasts
    the logits itself); ``None`` for any other line."""
    if not (
        isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
    ):
        return None
    call = stmt.value
    while (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in ("contiguous", "float")
        and not call.args
        and not call.keywords
    ):
        call = call.func.value
    if not (isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords):
        return None
    return stmt.targets[0].id if ast.unparse(call.func) == f"self.{head_name}" else None


def _is_loss_call(stmt: ast.stmt, logits_name: str) -> bool:
    """``loss = self.loss_function(<logits>, ...)``, alone or alone under ``if labels is not None:``."""
    if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "labels is not None" and not stmt.orelse:
        if len(stmt.body) != 1:
            return False
        stmt = stmt.body[0]
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return False
    call, target = stmt.value, stmt.targets[0]
    if not (isinstance(target, ast.Name) and target.id == "loss" and isinstance(call, ast.Call)):
        return False
    logits = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
    passes_logits = isinstance(logits, ast.Name) and logits.id == logits_name
    return ast.unparse(call.func) == "self.loss_function" and passes_logits


def _statements(stmt: ast.stmt) -> list[str]:
    """A statement's lines, an ``if`` on the soft-capping setting opened up."""
    if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == _SOFTCAP_IF and not stmt.orelse:
        return [ln for s in stmt.body for ln in _statements(s)]
    return [ast.unparse(stmt)]
