"""Property: any random Sequential, checkpointed with any segment count, equals the original.

Architectures are drawn from Linear, Conv2d, BatchNorm1d/2d, LayerNorm, Dropout,
ReLU (in place or not), GELU, MaxPool2d, AvgPool2d and Flatten, with nested Sequentials and
reused instances, in float64. Outputs, input and parameter gradients and BatchNorm buffers
must be bitwise equal after 3 training steps, and so must the RNG stream, under every
built-in op policy. Run with
``AUTOCKPT_HYPOTHESIS_PROFILE=thorough`` for many more examples.
"""

from __future__ import annotations

import copy
import warnings

import torch
from helpers import assert_same_state, seeded_step
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import autockpt

D = torch.float64
POLICIES = ["recompute-all", "save-matmuls", "save-compute"]  # the first step of a policy learns


@st.composite
def sequentials(draw: st.DrawFn) -> tuple[nn.Sequential, tuple[int, ...]]:
    """A random valid Sequential and its input shape (batch first)."""
    image = draw(st.booleans())
    channels, size, features = draw(st.integers(1, 4)), draw(st.integers(4, 8)), draw(st.integers(2, 6))
    shape: tuple[int, ...] = (3, channels, size, size) if image else (3, features)
    in_shape = shape
    layers: list[nn.Module] = []
    used: list[tuple[nn.Module, tuple[int, ...]]] = []  # shape-preserving instances, reusable
    # ReLU(inplace=True) is only valid where the unwrapped model accepts it: not on (a view
    # of) the input leaf, and not on a tensor that the previous op saved for backward.
    fresh = saved = False
    for _ in range(draw(st.integers(1, 24))):
        if len(shape) == 4:
            c, h = shape[1], shape[2]
            choice = draw(
                st.sampled_from(
                    [
                        "conv",
                        "bn",
                        "relu",
                        "relu_",
                        "gelu",
                        "drop",
                        "maxpool",
                        "avgpool",
                        "flatten",
                        "reuse",
                        "nest",
                    ]
                )
            )
            if choice == "conv":
                out_c = draw(st.integers(1, 4))
                layer: nn.Module = nn.Conv2d(c, out_c, 3, padding=1)
                shape = (3, out_c, h, h)
                if out_c == c:
                    used.append((layer, shape))
            elif choice in ("maxpool", "avgpool") and h >= 2:
                layer = nn.MaxPool2d(2) if choice == "maxpool" else nn.AvgPool2d(2)
                shape = (3, c, h // 2, h // 2)
            elif choice == "flatten":
                layer = nn.Flatten()
                shape = (3, c * h * h)
            elif choice == "bn":
                layer = nn.BatchNorm2d(c, momentum=draw(st.sampled_from([0.1, None])))
            else:
                layer = _common(draw, choice, used, shape)
        else:
            f = shape[1]
            choice = draw(
                st.sampled_from(["linear", "bn", "ln", "relu", "relu_", "gelu", "drop", "reuse", "nest"])
            )
            if choice == "linear":
                out_f = draw(st.integers(1, 6))
                layer = nn.Linear(f, out_f)
                shape = (3, out_f)
                if out_f == f:
                    used.append((layer, shape))
            elif choice == "bn":
                layer = nn.BatchNorm1d(f, momentum=draw(st.sampled_from([0.1, None])))
            elif choice == "ln":
                layer = nn.LayerNorm(f)
            else:
                layer = _common(draw, choice, used, shape)
        if isinstance(layer, nn.ReLU) and layer.inplace and not (fresh and not saved):
            layer = nn.ReLU()
        if (
            isinstance(layer, nn.Sequential)
            and any(getattr(m, "inplace", False) for m in layer)
            and not fresh
        ):
            layer = nn.Sequential(nn.Tanh(), nn.Dropout(0.25))
        if not isinstance(layer, (nn.Flatten, nn.Identity)):
            fresh = True
            saved = isinstance(layer, nn.ReLU) or (isinstance(layer, nn.Sequential) and len(layer) == 3)
        layers.append(layer)
    return nn.Sequential(*layers).to(D), in_shape


def _common(
    draw: st.DrawFn, choice: str, used: list[tuple[nn.Module, tuple[int, ...]]], shape: tuple[int, ...]
) -> nn.Module:
    """Shape-preserving layers shared by both modes."""
    fitting = [layer for layer, s in used if s == shape]
    if choice == "reuse" and fitting:
        return draw(st.sampled_from(fitting))
    if choice == "nest":
        inner = [nn.Tanh(), nn.Dropout(0.25)]
        if draw(st.booleans()):
            inner.append(nn.Sequential(nn.ReLU(inplace=True), nn.Identity()))
        return nn.Sequential(*inner)
    if choice == "relu_":
        return nn.ReLU(inplace=True)
    if choice == "gelu":
        return nn.GELU()
    if choice == "drop":
        return nn.Dropout(draw(st.sampled_from([0.1, 0.5])))
    return nn.ReLU()


@given(sequentials(), st.data())
def test_random_sequentials_train_exactly_like_the_original(
    arch: tuple[nn.Sequential, tuple[int, ...]], data: st.DataObject
) -> None:
    model, shape = arch
    n = autockpt.make_plan(model, "none").n_stages
    segments = data.draw(st.one_of(st.integers(2, n), st.just("sqrt")) if n >= 2 else st.just("none"))
    policy = data.draw(st.sampled_from(POLICIES))
    ref = copy.deepcopy(model)
    autockpt.auto_checkpoint(model, segments, policy=policy)
    # The first forward's dry run may fuse more stages than the static view saw; autockpt then
    # warns (fewer segments, or nothing left to checkpoint). Those warnings are expected here.
    warnings.simplefilter("ignore", UserWarning)
    for i in range(3):
        x = torch.randn(shape, dtype=D)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, rng_a = seeded_step(ref, xa, seed=i)
        out_b, rng_b = seeded_step(model, xb, seed=i)
        assert torch.equal(out_a, out_b)
        assert torch.equal(rng_a, rng_b)
        assert (xa.grad is None) == (xb.grad is None)
        if xa.grad is not None:
            assert torch.equal(xa.grad, xb.grad)
    assert_same_state(ref, model)
