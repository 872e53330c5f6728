"""Property: random models through the graph walker train bitwise like the originals.

Random residual networks (random depth, widths and skip connections inside blocks): the
checkpointed network trains bitwise like the original, and every checkpointed segment
receives exactly the values that cross its first cut: nothing it needs is missing, nothing
else is kept.

Random graphs (``RandomGraph``): residual adds, concatenation, dropout, BatchNorm called
more than once, no-grad regions, buffers, writes into values in place without an
``inplace`` flag, and forward hooks, checkpointed with any segment count (with and
without ``example_inputs``) or under a random budget, train bitwise like the unwrapped
model for two steps: outputs, input and parameter gradients, buffers, the RNG stream and
the hook calls that are not recomputations. The budget test runs an eighth of the
profile's examples (``AUTOCKPT_HYPOTHESIS_PROFILE=thorough`` for more).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Iterator

import torch
from helpers import assert_same_state, count_checkpoint_calls, seeded_step
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F  # noqa: N812

import autockpt
from autockpt.walkers.graph import GraphPiece

D = torch.float64


class RandomResidual(nn.Module):
    """Blocks of tanh(Linear) layers; layer i of a block may add the output of layer j < i."""

    def __init__(self, width_in: int, spec: list[tuple[int, list[int | None]]]) -> None:
        super().__init__()
        self.spec = spec
        widths = [width_in] + [w for w, _ in spec]
        self.stems = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.layers = nn.ModuleList(nn.ModuleList(nn.Linear(w, w) for _ in skips) for w, skips in spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b, (_, skips) in enumerate(self.spec):
            h = [torch.tanh(self.stems[b](x))]
            for i, src in enumerate(skips):
                y = torch.tanh(self.layers[b][i](h[-1]))
                if src is not None:
                    y = y + h[src]
                h.append(y)
            x = h[-1]
        return x


@st.composite
def residual_nets(draw: st.DrawFn) -> RandomResidual:
    spec = []
    for _ in range(draw(st.integers(1, 5))):
        depth = draw(st.integers(0, 4))
        skips = [draw(st.none() | st.integers(0, i)) for i in range(depth)]
        spec.append((draw(st.integers(1, 6)), skips))
    return RandomResidual(draw(st.integers(1, 5)), spec).to(D)


def crossing(program, p: int) -> set[str]:  # type: ignore[no-untyped-def]
    """Values defined before node ``p`` and read at or after it, from the graph alone."""
    names = set()
    for node in (*program.placeholders, *program.nodes[:p]):
        for user in node.users:
            if user.op == "output" or program.nodes.index(user) >= p:
                names.add(node.name)
    return names


@given(residual_nets(), st.data())
def test_random_residual_networks(model: RandomResidual, data: st.DataObject) -> None:
    x = torch.randn(3, model.stems[0].in_features, dtype=D)
    ref = copy.deepcopy(model)
    n = autockpt.make_plan(model, "none", mode="graph").n_stages
    segments = data.draw(st.integers(2, n)) if n >= 2 else "none"
    autockpt.auto_checkpoint(model, segments, mode="graph", example_inputs=(x,))
    fwd = model.forward
    program = fwd.walked.program

    # the values carried into every stage are exactly those crossing its first cut
    env = program.bind((x,), {})
    for unit in fwd.units:
        assert isinstance(unit.fn, GraphPiece)
        assert set(env) == crossing(program, unit.fn.start)
        env = unit.fn(env)

    # and those are what each checkpoint call receives
    starts = {s.start for s in fwd.plan.segments if s.checkpoint}
    first_piece = [u.fn.start for u in fwd.units]
    stage_first = {}
    j = 0
    for i, stage_name in enumerate(fwd.plan.stage_names):
        stage_first[i] = first_piece[j]
        j += len(stage_name.split("+"))
    with count_checkpoint_calls() as spy:
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xa).sum().backward()
        model(xb).sum().backward()
    received = [len(args) for args in spy.tensor_args()]
    assert received == [len(crossing(program, stage_first[s])) for s in sorted(starts)]
    assert torch.equal(xa.grad, xb.grad)
    assert_same_state(ref, model)


# --- random graph-walked models: every feature the graph walker must respect ---------------
#
# A RandomGraph keeps a list of values ``h`` (``h[0]`` is the input, every value is batch x
# width) and runs a random program over it: Linear layers (tanh, GELU or no activation),
# residual adds, concatenations, dropout (module and functional), BatchNorm (instances
# reused, so running statistics move twice per forward), a module with a buffer updated
# in a no-grad region, a no-grad statistic that scales a value, and writes into a value in
# place without any ``inplace`` flag: a module whose forward calls ``x.mul_()``,
# ``torch.relu_`` or ``torch.ops.aten.mul_`` (which static analysis cannot recognise, so
# only the dry run finds it), and the same at the top level. Writes only go to values the
# unwrapped model can legally modify (not the input, not a tensor autograd saved). Forward
# hooks and pre-hooks, some changing values and some counting calls guarded by
# ``is_recomputing``, are registered before the first forward, before or after wrapping.


class InPlace(nn.Module):
    """Writes into its input and returns it; nothing marks it but what it does."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def extra_repr(self) -> str:
        return self.how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "mul_":
            return x.mul_(2.0)
        if self.how == "relu_":
            return torch.relu_(x)
        return torch.ops.aten.mul_.Scalar(x, 0.5)  # no trailing underscore for fx to see


class RunningMean(nn.Module):
    """Centres its input by a running mean that it updates in a no-grad region."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.mean


Op = tuple[str, int, int, int, str]  # kind, source a, source b, module index, variant


class RandomGraph(nn.Module):
    def __init__(self, width: int, modules: list[nn.Module], program: list[Op]) -> None:
        super().__init__()
        self.width = width
        self.mods = nn.ModuleList(modules)
        self.program = program

    def extra_repr(self) -> str:
        """The program, one op a line, so that a falsifying example can be read."""
        lines, n = [f"width={self.width}"], 1
        for kind, a, b, m, variant in self.program:
            call = " ".join(x for x in (kind, f"mods[{m}]" if m >= 0 else "", variant) if x)
            if kind.startswith("in_place"):
                lines.append(f"h{a} <- {call}(h{a})")
                continue
            args = f"h{a}, h{b}" if kind in ("add", "cat", "no_grad") else f"h{a}"
            lines.append(f"h{n} = {call}({args})")
            n += 1
        return "\n".join(lines)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = [x]
        for kind, a, b, m, variant in self.program:
            if kind == "linear":
                y = self.mods[m](h[a])
                h.append(torch.tanh(y) if variant == "tanh" else F.gelu(y) if variant == "gelu" else y)
            elif kind == "add":
                h.append(h[a] + h[b])
            elif kind == "cat":
                h.append(self.mods[m](torch.cat([h[a], h[b]], dim=1)))
            elif kind == "dropout":
                h.append(self.mods[m](h[a]) if variant == "module" else F.dropout(h[a], 0.3, self.training))
            elif kind in ("bn", "running_mean"):
                h.append(self.mods[m](h[a]))
            elif kind == "no_grad":
                with torch.no_grad():
                    scale = h[b].abs().mean() + 1.0
                h.append(h[a] / scale)
            elif kind == "in_place_module":
                h[a] = self.mods[m](h[a])
            elif kind == "in_place":
                h[a] = h[a].mul_(0.5) if variant == "method" else torch.ops.aten.mul_.Scalar(h[a], 3.0)
        return h[-1]


Hook = tuple[int, str]  # module index, kind


def add_hooks(model: RandomGraph, hooks: list[Hook], log: list[str]) -> None:
    """Hooks that change values (``scale``, ``pre``) and one that counts calls (``count``)."""
    for m, kind in hooks:
        module = model.mods[m]
        if kind == "scale":
            module.register_forward_hook(lambda mod, args, out: out * 0.5)
        elif kind == "pre":
            module.register_forward_pre_hook(lambda mod, args: (args[0] * 1.5,))
        else:
            module.register_forward_hook(
                lambda mod, args, out, m=m: None if autockpt.is_recomputing() else log.append(f"{m}")
            )


@st.composite
def random_graphs(draw: st.DrawFn) -> tuple[RandomGraph, list[Hook]]:
    width = draw(st.integers(2, 8))
    modules: list[nn.Module] = []
    program: list[Op] = []
    saved = [True]  # per value: autograd keeps it for backward (or it is the input), so no writes

    def source() -> int:  # mostly the latest value (so that cuts exist), sometimes a skip
        n = len(saved)
        return draw(
            st.just(n - 1) | st.just(n - 1) | st.integers(max(0, n - 3), n - 1) | st.integers(0, n - 1)
        )

    def module(m: nn.Module) -> int:
        modules.append(m)
        return len(modules) - 1

    for _ in range(draw(st.integers(2, 14))):
        kind = draw(
            st.sampled_from(
                ["linear", "linear", "add", "cat", "dropout", "bn", "running_mean", "no_grad",
                 "in_place_module", "in_place"]
            )
        )  # fmt: skip
        a, b, m, variant = source(), source(), -1, ""
        if kind == "linear":
            m, variant = module(nn.Linear(width, width)), draw(st.sampled_from(["tanh", "gelu", "none"]))
            saved[a] = True
            saved.append(variant == "tanh")  # tanh keeps its output
        elif kind == "cat":
            m = module(nn.Linear(2 * width, width))
            saved.append(False)
        elif kind == "dropout":
            variant = draw(st.sampled_from(["module", "functional"]))
            if variant == "module":
                m = module(nn.Dropout(draw(st.sampled_from([0.1, 0.5]))))
            saved.append(False)
        elif kind == "bn":
            norms = [i for i, x in enumerate(modules) if isinstance(x, nn.BatchNorm1d)]
            if norms and draw(st.booleans()):
                m = draw(st.sampled_from(norms))  # the same BatchNorm called again
            else:
                m = module(nn.BatchNorm1d(width, momentum=draw(st.sampled_from([0.1, None]))))
            saved[a] = True
            saved.append(False)
        elif kind == "running_mean":
            m = module(RunningMean(width))
            saved.append(False)
        elif kind == "no_grad":
            saved[a] = True  # the division may keep its input
            saved.append(False)
        elif kind in ("in_place_module", "in_place"):
            writable = [i for i, s in enumerate(saved) if not s]
            if not writable:
                continue
            a = draw(st.sampled_from(writable))
            if kind == "in_place_module":
                variant = draw(st.sampled_from(["mul_", "relu_", "aten"]))
                m = module(InPlace(variant))
                saved[a] = variant == "relu_"  # relu_ keeps its output
            else:
                variant = draw(st.sampled_from(["method", "aten"]))
        else:  # add
            saved.append(False)
        program.append((kind, a, b, m, variant))
    if not modules:
        program.append(("linear", len(saved) - 1, 0, module(nn.Linear(width, width)), "tanh"))
    hooks = draw(
        st.lists(
            st.tuples(st.integers(0, len(modules) - 1), st.sampled_from(["scale", "pre", "count"])),
            max_size=3,
        )
    )
    return RandomGraph(width, modules, program).to(D), hooks


def train_side_by_side(
    ref: nn.Module, model: nn.Module, x: torch.Tensor, logs: tuple[list[str], list[str]], steps: int = 2
) -> None:
    """``steps`` seeded training steps of both; outputs, input gradients, the RNG stream
    afterwards, hook calls, and finally parameters, gradients and buffers are bitwise equal."""
    for i in range(steps):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, rng_a = seeded_step(ref, xa, seed=i)
        out_b, rng_b = seeded_step(model, xb, seed=i)
        assert torch.equal(out_a, out_b), f"step {i}: outputs differ"
        assert torch.equal(rng_a, rng_b), f"step {i}: the RNG stream afterwards differs"
        assert torch.equal(xa.grad, xb.grad), f"step {i}: input gradients differ"
        assert logs[0] == logs[1], f"step {i}: hooks fired {logs[1]}, unwrapped {logs[0]}"
    assert_same_state(ref, model)


def prepared(
    arch: tuple[RandomGraph, list[Hook]], hooks_first: bool
) -> tuple[RandomGraph, RandomGraph, torch.Tensor, tuple[list[str], list[str]]]:
    model, hooks = arch
    ref = copy.deepcopy(model)
    logs: tuple[list[str], list[str]] = ([], [])
    add_hooks(ref, hooks, logs[0])
    if hooks_first:
        add_hooks(model, hooks, logs[1])
    return ref, model, torch.randn(32, model.width, dtype=D), logs


@contextlib.contextmanager
def expected_warnings() -> Iterator[None]:
    """Warnings a random model may earn: a plan that saves little or checkpoints nothing, a
    segment count lowered after the first forward's dry run fused stages, or a budget plan
    replaced after hooks added to a traced module made it trace again. Any other warning
    (such as a call that runs without checkpointing) still fails the test."""
    with warnings.catch_warnings():
        messages = ("save little memory", "never recomputed", "dry run fused modules", "no longer matches")
        for message in messages:
            warnings.filterwarnings("ignore", message=f".*{message}", category=UserWarning)
        yield


# each example trains two models twice: a third of the profile's examples (a third of 300
# under AUTOCKPT_HYPOTHESIS_PROFILE=thorough); a budget also profiles every stage: a twelfth
GRAPH_EXAMPLES = settings(max_examples=max(10, settings.default.max_examples // 3))
BUDGET_EXAMPLES = settings(max_examples=max(8, settings.default.max_examples // 12))


@GRAPH_EXAMPLES
@given(random_graphs(), st.data())
def test_random_graph_models_train_exactly(arch: tuple[RandomGraph, list[Hook]], data: st.DataObject) -> None:
    """Any segment count and op policy, with or without example inputs, hooks added before or
    after wrapping."""
    hooks_first, with_inputs = data.draw(st.booleans()), data.draw(st.booleans())
    ref, model, x, logs = prepared(arch, hooks_first)
    example = {"example_inputs": (x,)} if with_inputs else {}
    with expected_warnings():
        n = autockpt.make_plan(model, "none", **example).n_stages
        segments = data.draw(st.one_of(st.integers(2, n), st.just("sqrt")) if n >= 2 else st.just("none"))
        policy = data.draw(st.sampled_from(["recompute-all", "save-matmuls", "save-compute"]))
        autockpt.auto_checkpoint(model, segments, policy=policy, **example)
        assert model.forward.plan.walker == "graph", model.forward.plan
        if not hooks_first:
            add_hooks(model, arch[1], logs[1])
        train_side_by_side(ref, model, x, logs)


@BUDGET_EXAMPLES
@given(random_graphs(), st.data())
def test_random_graph_models_under_budgets_train_exactly(
    arch: tuple[RandomGraph, list[Hook]], data: st.DataObject
) -> None:
    """A budget between 0.3 and 1 of the unwrapped peak (below the floor: the floor it
    names), with or without ``check=True``'s measured step; hooks before or after wrapping."""
    hooks_first, check = data.draw(st.booleans()), data.draw(st.booleans())
    ref, model, x, logs = prepared(arch, hooks_first)
    budget = data.draw(st.floats(0.3, 1.0))
    with expected_warnings(), warnings.catch_warnings():
        # check=True says so when the measured peak stays above the budget: expected here
        warnings.filterwarnings("ignore", message=".*no plan found that keeps it", category=UserWarning)
        try:
            autockpt.auto_checkpoint(model, budget=budget, example_inputs=(x,), check=check)
        except autockpt.PlanInfeasibleError as err:
            assert err.min_budget_bytes is not None, str(err)
            autockpt.auto_checkpoint(model, budget=err.min_budget_bytes, example_inputs=(x,), check=check)
        assert model.forward.plan.walker == "graph", model.forward.plan
        if not hooks_first:
            add_hooks(model, arch[1], logs[1])
        train_side_by_side(ref, model, x, logs)
