"""Property: random residual networks through the graph walker.

Random depth, widths and skip connections inside blocks. The checkpointed network trains
bitwise like the original, and every checkpointed segment receives exactly the values that
cross its first cut: nothing it needs is missing, nothing else is kept.
"""

from __future__ import annotations

import copy
import itertools
from unittest import mock

import torch
import torch.utils.checkpoint as tuc
from helpers import assert_same_state
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

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
    with mock.patch.object(tuc, "checkpoint", wraps=tuc.checkpoint) as spy:
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xa).sum().backward()
        model(xb).sum().backward()
    received = [sum(isinstance(a, torch.Tensor) for a in call.args[1:]) for call in spy.call_args_list]
    assert received == [len(crossing(program, stage_first[s])) for s in sorted(starts)]
    assert torch.equal(xa.grad, xb.grad)
    assert_same_state(ref, model)
