"""The graph walker: any traceable model, cut into a chain where one tensor crosses.

``torch.fx.symbolic_trace`` turns the forward into a list of nodes. A cut between two
nodes is a *candidate* when exactly one activation is alive across it (an articulation
point of the data flow, e.g. between residual blocks). Values that every later part may
read without costing extra memory do not count: model inputs, parameters, values computed
from those alone by plain functions (attention masks, position ids), and values whose only
reader is the model's output (auxiliary logits). Nodes between two candidate cuts form one
:class:`~autockpt.walkers.chain.Unit`, so glue code (residual adds, reshapes, ``getitem``) stays with
the block that owns it.

At run time the value carried from unit to unit is a dict of the live values by node name,
so the sequential runtime (segments, checkpointing, buffers, RNG) works unchanged: a
checkpointed segment receives exactly the values crossing its first cut and returns exactly
those crossing its last.

Complexity: O(nodes) to find the cuts.

NOTE [Traces under torch.compile]
    A graph-walked model runs its trace on every call, inside the compiled frame when the
    model is compiled, so the program must be plain Python that dynamo traces: fx objects
    are not (``Node.args`` is on dynamo's skip list, fx's immutable lists cannot be passed
    to a traced op). Everything read off the nodes is taken once, when the trace is loaded:
    the placeholders' names and defaults, whether each is used, and a reader of the
    output; node arguments are rebuilt as plain lists, tuples and dicts
    (``graph_steps.reader``). Before, a torchvision ViT compiled to 8 graphs with 3 breaks
    and hit dynamo's recompile limit in ``checkpoint_segment``; now to 1, as unwrapped.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autockpt.walkers.chain import Unit
from autockpt.walkers.graph_nodes import (
    META_METHODS,
    PURE_FUNCTIONS,
    PURE_METHODS,
    GradModeTracer,
    has_hooks,
    module_path,
    mutated_arg,
)
from autockpt.walkers.graph_steps import compile_node, reader

__all__ = [
    "GraphProgram",
    "UnbindableError",
    "UntraceableError",
    "none_pattern",
    "trace_program",
    "units_of",
]


class UnbindableError(Exception):
    """A call gives an optional argument where the trace had ``None``, or the reverse.

    NOTE [Optional arguments]
        fx cannot trace ``if mask is not None:`` on a proxy, so a forward with optional
        arguments is traced for one pattern of which arguments are ``None``
        (``concrete_args``): the example inputs' pattern, or without them the defaults'.
        A call with another pattern raises this inside autockpt, and the installed forward
        traces again for that call's pattern and plans again.
    """

    def __init__(self, name: str, why: str = "") -> None:
        super().__init__(f"argument {name!r} {why}".strip())
        self.name = name


class UntraceableError(Exception):
    """``torch.fx`` could not trace the model (the walker then tries the next one)."""


@dataclass(frozen=True, eq=False)
class GraphPiece:
    """Runs nodes ``[start, stop)`` on a dict of live values and returns the next dict."""

    program: GraphProgram
    start: int
    stop: int

    def __call__(self, env: dict[str, Any]) -> dict[str, Any]:
        return self.program.run(env, self.start, self.stop)


class GraphProgram:
    """A traced forward, runnable node range by node range against the original modules.

    Pickling and deep copies keep only the model and trace it again on first use, so the
    copy's nodes call the copy's modules.
    """

    def __init__(self, model: nn.Module, none_args: frozenset[str] = frozenset()) -> None:
        self.model = model
        self.none_args = none_args  # arguments traced as None (NOTE [Optional arguments])
        self._ready = False

    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model, "none_args": self.none_args, "_ready": False}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or self.__dict__.get("_ready", True):
            raise AttributeError(name)
        self.load(GradModeTracer().trace(self.model, concrete_args=_concrete(self.none_args)))
        return getattr(self, name)

    def load(self, graph: fx.Graph) -> None:
        """Take ``graph`` as the program (tracing done elsewhere)."""
        self._ready = True
        nodes = list(graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        # fx renames a placeholder it specialises ("mask" -> "mask_1"): take the forward's names
        params = _parameter_names(self.model)
        self.arg_names = (
            params if len(params) == len(self.placeholders) else [str(n.target) for n in self.placeholders]
        )
        self.output = next(n for n in nodes if n.op == "output")
        # read off the nodes once: dynamo cannot trace fx objects (NOTE [Traces under torch.compile])
        self.slots = [n.name for n in self.placeholders]
        self.defaults = {n.name: n.args[0] for n in self.placeholders if n.args}
        self.used = {n.name: bool(n.users) for n in self.placeholders}
        self.read_result = reader(self.output.args[0])
        self.nodes = [n for n in nodes if n.op not in ("placeholder", "output")]
        index = {n: i for i, n in enumerate(self.nodes)}
        end = len(self.nodes)
        # last position (exclusive) at which each value is still needed
        self.last_use: dict[str, int] = {}
        for n in (*self.placeholders, *self.nodes):
            users = [index.get(u, end) for u in n.users]
            self.last_use[n.name] = max(users, default=-1) + 1 if users else 0
        self.index = index
        self.steps = [compile_node(n, i, self.last_use) for i, n in enumerate(self.nodes)]
        # every module by every path it has, once: with get_submodule per node a small timm
        # model's "sqrt" plan took 0.29 s, with this 0.22 (still read by path, as fx names them)
        self.modules_by_path = dict(self.model.named_modules(remove_duplicate=False))
        called = {id(self.module_at(str(n.target))) for n in self.nodes if n.op == "call_module"}
        leaves_inside = {id(m) for n in self.nodes if n.op == "call_module"
                         for m in self.module_at(str(n.target)).modules()}  # fmt: skip
        self.traced_through = tuple(
            m
            for m in self.model.modules()
            if m is not self.model and id(m) not in called and id(m) not in leaves_inside
        )

    def module_at(self, path: str) -> nn.Module:
        """The module at qualified name ``path`` (``""``: the model)."""
        found = self.modules_by_path.get(path)
        return found if found is not None else self.model.get_submodule(path)

    def hooks_added(self) -> bool:
        """Whether a module that tracing went through has gained hooks since (re-trace then)."""
        return any(has_hooks(m) for m in self.traced_through)

    # --- running ----------------------------------------------------------------------

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map forward arguments onto the graph's placeholders.

        Raises:
            UnbindableError: the call's pattern of ``None`` arguments is not the trace's.
        """
        env, mismatch = self.try_bind(args, kwargs)
        if mismatch is not None:
            raise UnbindableError(*mismatch)
        return env

    def try_bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], tuple[str, str] | None]:
        """:meth:`bind` without raising for a pattern of ``None`` arguments other than the
        trace's: ``(values, (argument, why))`` then (an exception made inside a compiled call
        sends dynamo back to eager for the whole frame; NOTE [Traces under torch.compile])."""
        env: dict[str, Any] = {}
        args_left = list(args)
        mismatch: tuple[str, str] | None = None
        for slot, name in zip(self.slots, self.arg_names):
            if args_left:
                env[slot] = args_left.pop(0)
            elif name in kwargs:
                env[slot] = kwargs[name]
            elif slot in self.defaults:
                env[slot] = self.defaults[slot]
            else:
                raise TypeError(f"{type(self.model).__name__}.forward() missing argument {name!r}")
            if mismatch is not None:
                continue
            if name in self.none_args:
                if env[slot] is not None:
                    mismatch = (name, "was traced as None and is given now")
            elif env[slot] is None and self.used[slot]:
                mismatch = (name, "was traced as given and is None now")
        if args_left:
            raise TypeError(
                f"{type(self.model).__name__}.forward() got {len(args)} positional arguments, too many"
            )
        return {k: v for k, v in env.items() if self.last_use[k] > 0}, mismatch

    def run(self, env: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
        """Execute nodes ``[start, stop)``; return the values still needed after ``stop``."""
        env = dict(env)
        model = self.model
        for name, call, drops in self.steps[start:stop]:
            env[name] = call(model, env)
            for used in drops:
                env.pop(used, None)
        return {k: v for k, v in env.items() if self.last_use[k] > stop}

    def result(self, env: dict[str, Any]) -> Any:
        """The forward's return value from the final dict."""
        return self.read_result(env)

        # --- cutting ----------------------------------------------------------------------

    def _global(self) -> set[str]:
        """Values that cost nothing extra to pass along (see the module docstring)."""
        out: set[str] = {n.name for n in self.placeholders}
        for node in self.nodes:
            inputs = node.all_input_nodes
            only_output = bool(node.users) and all(u.op == "output" for u in node.users)
            meta = node.op == "call_method" and node.target in META_METHODS
            derived = node.op in ("call_function", "call_method") and all(i.name in out for i in inputs)
            if node.op == "get_attr" or only_output or meta or derived:
                out.add(node.name)
        return out

    def cuts(self) -> list[int]:
        """Candidate cut positions (cut before node ``p``), in order, 0 included."""
        glob = self._global()
        delta = [0] * (len(self.nodes) + 2)
        for i, node in enumerate(self.nodes):
            if node.name in glob:
                continue
            last = self.last_use[node.name]
            if last > i + 1:  # alive across cuts i+1 .. last-1
                delta[i + 1] += 1
                delta[last] -= 1
        cuts, alive, grad = [0], 0, True
        for p in range(1, len(self.nodes)):
            alive += delta[p]
            prev = self.nodes[p - 1]
            if prev.op == "call_function" and prev.target is torch._C._set_grad_enabled:
                grad = bool(prev.args[0])
            if alive <= 1 and grad:  # never cut inside a no-grad region
                cuts.append(p)
        return self._past_in_place(cuts)

    def _past_in_place(self, cuts: list[int]) -> list[int]:
        """Move each cut in front of an in-place write into the value crossing it to just
        after that write, where the cut is as good.

        A block whose code starts with ``torch.relu_(x)`` writes into its input; a checkpoint
        starting there would keep a tensor that is then changed, so the dry run would fuse
        the block with the one before (NOTE [In-place boundaries] in ``walkers/chain.py``), and a
        stack of such blocks would become one stage. The write runs at the same moment
        either way; after the move it ends the previous piece and the checkpoint keeps
        its result.
        """
        valid = set(cuts)
        out = []
        for p in cuts:
            target = mutated_arg(self.nodes[p], self.module_at) if 0 < p < len(self.nodes) else None
            if target is not None and self.index.get(target, p) < p and p + 1 in valid:
                continue
            out.append(p)
        return out

    def mutates_before(self, start: int, stop: int) -> bool:
        """Whether a node in ``[start, stop)`` writes in place into a value defined before ``start``."""
        for node in self.nodes[start:stop]:
            target = mutated_arg(node, self.module_at)
            if target is not None and (target.op == "placeholder" or self.index.get(target, start) < start):
                return True
        return False

    def piece_modules(self, start: int, stop: int) -> tuple[nn.Module, ...]:
        """The modules nodes ``[start, stop)`` call."""
        seen: dict[int, nn.Module] = {}
        for node in self.nodes[start:stop]:
            if node.op == "call_module":
                mod = self.module_at(str(node.target))
                seen.setdefault(id(mod), mod)
        return tuple(seen.values())

    def piece_reads(self, start: int, stop: int) -> tuple[nn.Module, ...]:
        """The modules whose own parameters or buffers nodes ``[start, stop)`` read
        (``Unit.reads``); the root too."""
        seen: dict[int, nn.Module] = {}
        for node in self.nodes[start:stop]:
            if node.op == "get_attr":
                owner = self.module_at(str(node.target).rpartition(".")[0])
                seen.setdefault(id(owner), owner)
        return tuple(seen.values())

    def calls_module(self, start: int, stop: int) -> bool:
        """Whether nodes ``[start, stop)`` call a module."""
        return any(n.op == "call_module" for n in self.nodes[start:stop])

    def piece_pure(self, start: int, stop: int) -> bool:
        for node in self.nodes[start:stop]:
            if node.op == "call_function" and node.target not in PURE_FUNCTIONS:
                return False
            if node.op == "call_method" and node.target not in PURE_METHODS:
                return False
        return True

    def piece_name(self, start: int, stop: int) -> str:
        """The deepest module path holding the piece's nodes; an in-place write moved to the
        end of the piece (:meth:`_past_in_place`) belongs to the next block and is left out."""
        while stop - start > 1 and mutated_arg(self.nodes[stop - 1], self.module_at) is not None:
            stop -= 1
        paths = [module_path(n) for n in self.nodes[start:stop]]
        named = [p for p in paths if p]
        if not named:
            return str(self.nodes[start].name)
        common = named[0].split(".")
        for p in named[1:]:
            parts = p.split(".")
            k = 0
            while k < min(len(common), len(parts)) and common[k] == parts[k]:
                k += 1
            common = common[:k]
        if common:
            return ".".join(common)
        return f"{named[0]}..{named[-1]}" if named[0] != named[-1] else named[0]

    def piece_kind(self, start: int, stop: int) -> str:
        kinds: list[str] = []
        for node in self.nodes[start:stop]:
            if node.op == "call_module":
                kinds.append(type(self.module_at(str(node.target))).__name__)
        if not kinds:
            return "ops"
        if len(kinds) > 3:
            return f"{kinds[0]}..{kinds[-1]} ({len(kinds)} modules)"
        return "+".join(kinds)


def none_pattern(
    model: nn.Module, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None
) -> frozenset[str]:
    """The forward's arguments that are ``None`` in a call ``model(*args, **kwargs)``, or with
    ``args=None``, those whose default is ``None`` (NOTE [Optional arguments])."""
    signature = _forward_signature(model)
    if signature is None:
        return frozenset()
    if args is None:
        return frozenset(n for n, p in signature.parameters.items() if p.default is None)
    try:
        bound = signature.bind(*args, **(kwargs or {}))
    except TypeError:
        return frozenset()  # the call itself is wrong; binding will say so
    bound.apply_defaults()
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        n for n, v in bound.arguments.items() if v is None and signature.parameters[n].kind in plain
    )


def _forward_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature fx traces: the class's ``forward``, without ``self``."""
    try:
        signature = inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return None
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _parameter_names(model: nn.Module) -> list[str]:
    signature = _forward_signature(model)
    return [] if signature is None else list(signature.parameters)


def _concrete(none_args: frozenset[str]) -> dict[str, Any] | None:
    return {name: None for name in sorted(none_args)} or None


def trace_program(model: nn.Module, none_args: frozenset[str] = frozenset()) -> GraphProgram:
    """Trace ``model`` with ``torch.fx``, the arguments in ``none_args`` specialised to ``None``.

    Raises:
        UntraceableError: tracing failed. Tracing runs the model's own code on proxies, so any
            exception it raises means "not traceable"; its type and first line are kept.
    """
    program = GraphProgram(model, none_args)
    try:
        graph = GradModeTracer().trace(model, concrete_args=_concrete(none_args))
    except Exception as err:  # the model's code, run on proxies, may raise anything
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UntraceableError(f"{type(err).__name__}: {first}") from err
    program.load(graph)
    return program


def units_of(program: GraphProgram) -> tuple[Unit, ...]:
    """Cut a traced program into units at the candidate cuts."""
    cuts = [*program.cuts(), len(program.nodes)]
    # a piece with no module call (mask arithmetic, reshapes) joins the piece after it
    cuts = [c for i, c in enumerate(cuts) if i == 0 or c == cuts[-1] or program.calls_module(cuts[i - 1], c)]
    units = []
    for start, stop in itertools.pairwise(cuts):
        units.append(
            Unit(
                name=program.piece_name(start, stop),
                fn=GraphPiece(program, start, stop),
                modules=program.piece_modules(start, stop),
                kind=program.piece_kind(start, stop),
                mutates_input=program.mutates_before(start, stop),
                pure=program.piece_pure(start, stop),
                reads=program.piece_reads(start, stop),
                hooks_outside=program.traced_through,
                names_root=program.model,
            )
        )
    return tuple(_unique_names(units))


def _unique_names(units: list[Unit]) -> list[Unit]:
    """Make unit names unique (a ``+`` would be read as fusion), suffixing repeats."""
    seen: dict[str, int] = {}
    out = []
    for u in units:
        name = u.name.replace("+", "_")
        count = seen.get(name, 0)
        seen[name] = count + 1
        if count:
            name = f"{name}#{count}"
        out.append(dataclasses.replace(u, name=name))
    return out
