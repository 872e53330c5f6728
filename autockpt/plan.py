"""Plans: which stages of a chain run in which checkpointed segments.

A :class:`Plan` is a pure description. It knows nothing of torch and can be printed,
compared, stored as JSON and applied later to a model with the same stages.

NOTE [Which segments are recomputed]
    A plan cuts the chain into consecutive segments. A checkpointed segment keeps only its
    input during the forward pass and runs its forward again in backward. The last
    segment is normally *not* checkpointed: backward starts with it, so its activations
    would be recomputed right away and the peak would not drop, while the recompute would
    still cost time. This is why ``segments=1`` means "one plain segment" and lowers
    nothing (autockpt warns), unlike ``checkpoint_sequential(..., segments=1)`` which
    silently does nothing either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Plan",
    "Segment",
    "StageFigures",
    "format_bytes",
    "parse_budget",
    "set_applier",
    "validate_segments",
]

_JSON_VERSION = 1

# NOTE [Plan.apply without an import cycle]
#     A Plan is torch-free data, produced by planners and read by the execution layer, so this
#     module must not import the layer that applies it. ``autockpt.api`` hands its
#     ``apply_plan`` over with :func:`set_applier` when the package is imported; ``Plan.apply``
#     is a convenience spelling of ``auto_checkpoint(model, plan)``.
_applier: Callable[[Any, Plan], Any] | None = None


def set_applier(fn: Callable[[Any, Plan], Any]) -> None:
    """Register the function behind :meth:`Plan.apply` (``autockpt.api.apply_plan``)."""
    global _applier
    _applier = fn


@dataclass(frozen=True)
class Segment:
    """Stages ``start`` to ``stop - 1`` of a chain, run as one unit.

    Args:
        start: index of the first stage.
        stop: one past the last stage.
        checkpoint: whether the segment's activations are dropped after the forward pass
            and recomputed in backward.
        children: optional sub-segments covering ``[start, stop)`` exactly; a checkpointed
            segment with checkpointed children is recomputed in nested fashion.
        keep: ops whose outputs this checkpointed segment keeps instead of recomputing,
            chosen by ``policy="auto"``: ``"position:op"``, the op's place among the ops
            the segment's forward runs (as selective checkpointing sees them) and its name.
        kept_bytes: what the kept outputs hold from the forward to the segment's backward.
        kept_ms: the recompute time keeping them saves.
    """

    start: int
    stop: int
    checkpoint: bool
    children: tuple[Segment, ...] = ()
    keep: tuple[str, ...] = ()
    kept_bytes: int = 0
    kept_ms: float = 0.0

    def __len__(self) -> int:
        return self.stop - self.start

    def to_dict(self) -> dict[str, Any]:
        """This segment as plain JSON-ready data."""
        out: dict[str, Any] = {"start": self.start, "stop": self.stop, "checkpoint": self.checkpoint}
        if self.children:
            out["children"] = [c.to_dict() for c in self.children]
        if self.keep:
            out.update(keep=list(self.keep), kept_bytes=self.kept_bytes, kept_ms=self.kept_ms)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Segment:
        """Inverse of :meth:`to_dict`."""
        return cls(
            start=int(data["start"]),
            stop=int(data["stop"]),
            checkpoint=bool(data["checkpoint"]),
            children=tuple(cls.from_dict(c) for c in data.get("children", ())),
            keep=tuple(str(k) for k in data.get("keep", ())),
            kept_bytes=int(data.get("kept_bytes", 0)),
            kept_ms=float(data.get("kept_ms", 0.0)),
        )


def validate_segments(segments: Sequence[Segment], start: int, stop: int, *, where: str) -> None:
    """Raise ``ValueError`` unless ``segments`` tile ``[start, stop)`` in order.

    Args:
        segments: the segments to check (recursively, children included).
        start: first stage index the segments must cover.
        stop: one past the last stage index.
        where: API name used as the message prefix.
    """
    pos = start
    for seg in segments:
        if not isinstance(seg, Segment):
            raise TypeError(f"{where}: expected Segment objects, got {type(seg).__name__}: {seg!r}.")
        if seg.start != pos or seg.stop <= seg.start:
            raise ValueError(
                f"{where}: segments must be non-empty, ordered and contiguous over stages "
                f"{start}..{stop - 1}; got {seg} after stage {pos - 1}."
            )
        if seg.children:
            validate_segments(seg.children, seg.start, seg.stop, where=where)
        if seg.keep and (not seg.checkpoint or seg.children):
            raise ValueError(
                f"{where}: {seg} keeps op outputs, which only a checkpointed segment without "
                "sub-segments can; drop keep= or checkpoint the segment."
            )
        pos = seg.stop
    if pos != stop:
        raise ValueError(
            f"{where}: segments cover stages {start}..{pos - 1} but the chain has stages "
            f"{start}..{stop - 1}; every stage must be in exactly one segment."
        )


@dataclass(frozen=True)
class StageFigures:
    """One stage's figures, for :meth:`Plan.explain`.

    Attributes:
        in_bytes: its input: what a checkpoint starting at it keeps from forward to backward.
        saved_bytes: what it keeps for backward when not checkpointed (parameters excluded;
            its input included when it saves it and the stage before does not count it).
        fwd_ms: its forward time, what recomputing it costs (measured for budget plans).
        tail_ms: the part of ``fwd_ms`` a recompute ending with it skips (torch's early stop).
    """

    in_bytes: int
    saved_bytes: int
    fwd_ms: float | None = None
    tail_ms: float = 0.0


@dataclass(frozen=True)
class Plan:
    """How a model's chain of stages is checkpointed.

    Attributes:
        strategy: what produced the plan (``"sqrt"``, ``"4"``, ``"none"``, a planner name).
        walker: which walker found the stages (``"sequential"``, ...).
        stage_names: one name per stage; a fused stage joins its modules' names with ``+``.
        stage_kinds: one short description per stage (module class names joined by ``+``).
        segments: the top-level segments, tiling all stages in order.
        predicted_peak_bytes: peak memory the planner predicted, when it had costs.
        predicted_recompute_ms: recompute time the planner predicted, when it had costs.
        notes: remarks for the reader (fused stages, fallbacks, warnings).
        budget_bytes: the memory budget the plan was made for, if any.
        stage_figures: per stage, the bytes (and times) :meth:`explain` shows, if measured.
        policy: inside checkpointed segments, which ops' outputs are kept rather than
            recomputed: ``"recompute-all"`` (none), or a policy name (see
            ``autockpt.available_policies``).

    Examples:
        >>> plan = Plan("2", "sequential", ("0", "1", "2"), ("Linear", "Tanh", "Linear"),
        ...             (Segment(0, 2, True), Segment(2, 3, False)))
        >>> plan.recomputed_stages
        2
        >>> Plan.from_json(plan.to_json()) == plan
        True
    """

    strategy: str
    walker: str
    stage_names: tuple[str, ...]
    stage_kinds: tuple[str, ...]
    segments: tuple[Segment, ...]
    predicted_peak_bytes: int | None = None
    predicted_recompute_ms: float | None = None
    notes: tuple[str, ...] = field(default=())
    budget_bytes: int | None = None
    stage_figures: tuple[StageFigures, ...] | None = None
    policy: str = "recompute-all"

    def __post_init__(self) -> None:
        if len(self.stage_kinds) != len(self.stage_names):
            raise ValueError(
                f"Plan: {len(self.stage_names)} stage names but {len(self.stage_kinds)} stage kinds."
            )
        if self.stage_figures is not None and len(self.stage_figures) != len(self.stage_names):
            raise ValueError(
                f"Plan: {len(self.stage_names)} stage names but {len(self.stage_figures)} stage figures."
            )
        validate_segments(self.segments, 0, len(self.stage_names), where="Plan")

    @property
    def n_stages(self) -> int:
        """Number of stages in the chain."""
        return len(self.stage_names)

    @property
    def checkpointed_segments(self) -> int:
        """Number of top-level segments that are recomputed in backward."""
        return sum(1 for s in self.segments if s.checkpoint)

    @property
    def recomputed_stages(self) -> int:
        """Stage forwards run again in backward (a stage in nested checkpoints counts more than once)."""
        return _recomputed(self.segments)

    def apply(self, model: Any) -> Any:
        """Checkpoint ``model`` in place with exactly this plan and return it.

        Raises:
            AutockptError: the model's stages differ from the plan's.
        """
        if _applier is None:  # autockpt/__init__ imports autockpt.api, which sets it
            raise RuntimeError("Plan.apply: autockpt.api is not loaded; import autockpt.")
        return _applier(model, self)

    def to_json(self) -> str:
        """The plan as a JSON string; :meth:`from_json` reads it back."""
        data = {
            "autockpt_plan": _JSON_VERSION,
            "strategy": self.strategy,
            "walker": self.walker,
            "stage_names": list(self.stage_names),
            "stage_kinds": list(self.stage_kinds),
            "segments": [s.to_dict() for s in self.segments],
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_recompute_ms": self.predicted_recompute_ms,
            "notes": list(self.notes),
            "budget_bytes": self.budget_bytes,
            "stage_figures": None if self.stage_figures is None else [vars(f) for f in self.stage_figures],
            "policy": self.policy,
        }
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`.

        Raises:
            ValueError: the text is not an autockpt plan of a known version.
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("autockpt_plan") != _JSON_VERSION:
            raise ValueError(
                f"Plan.from_json: not an autockpt plan of version {_JSON_VERSION} "
                f"(missing or wrong 'autockpt_plan' key)."
            )
        return cls(
            strategy=str(data["strategy"]),
            walker=str(data["walker"]),
            stage_names=tuple(data["stage_names"]),
            stage_kinds=tuple(data["stage_kinds"]),
            segments=tuple(Segment.from_dict(s) for s in data["segments"]),
            predicted_peak_bytes=data.get("predicted_peak_bytes"),
            predicted_recompute_ms=data.get("predicted_recompute_ms"),
            notes=tuple(data.get("notes", ())),
            budget_bytes=data.get("budget_bytes"),
            stage_figures=None
            if data.get("stage_figures") is None
            else tuple(StageFigures(**f) for f in data["stage_figures"]),
            policy=str(data.get("policy", "recompute-all")),
        )

    def explain(self) -> str:
        """Why each segment is what it is, in plain text: its stages, the input a checkpoint
        keeps from forward to backward in place of what its stages would save, and the
        recompute that costs (bytes come from the dry run that example inputs allow, times
        from a budget's profile)."""
        figs = self.stage_figures
        lines = [
            f"autockpt plan ({self.strategy!r}, {self.walker} walker): {self.n_stages} stages in "
            f"{len(self.segments)} segments, {self.checkpointed_segments} checkpointed"
        ]
        if self.policy != "recompute-all":
            lines.append(
                f"policy {self.policy!r}: checkpointed segments keep the outputs of the ops it names "
                "and recompute only the rest"
            )
        kept = freed = 0
        times: list[float | None] = []
        for i, seg in enumerate(self.segments):
            what = "checkpointed" if seg.checkpoint else "plain"
            lines.append(f"segment {i}: {_stage_span(self, seg)}, {what}")
            if seg.children:
                inner = sum(1 for c in seg.children if c.checkpoint)
                lines.append(f"  inside: {len(seg.children)} nested segments, {inner} checkpointed")
            if seg.keep:
                lines.append(
                    f"  keeps the outputs of {len(seg.keep)} ops ({format_bytes(seg.kept_bytes)}, "
                    f"{seg.kept_ms:.2f} ms less recompute): {', '.join(seg.keep)}"
                )
            if figs is None:
                continue
            own = figs[seg.start : seg.stop]
            saved = sum(f.saved_bytes for f in own)
            if seg.checkpoint:
                ms = [f.fwd_ms for f in own]
                if ms[-1] is not None:  # the early stop skips the last stage's tail
                    ms[-1] = max(0.0, ms[-1] - own[-1].tail_ms)
                known = [m for m in ms if m is not None]
                cost = f" ({sum(known):.2f} ms)" if len(known) == len(ms) else ""
                lines.append(
                    f"  keeps its input, {format_bytes(own[0].in_bytes)}, from forward to backward, in "
                    f"place of the {format_bytes(saved)} its stages save"
                )
                lines.append(f"  recomputes {len(seg)} stage forward{'s' * (len(seg) > 1)} in backward{cost}")
                kept += own[0].in_bytes
                freed += saved
                times.extend(ms)
            else:
                lines.append(f"  keeps what its stages save for backward: {format_bytes(saved)}")
        if figs is None:
            lines.append(
                "no per-stage figures: plan with example_inputs (a dry run) or a budget (a profile) "
                "to see the bytes each segment keeps and frees"
            )
        else:
            total = (
                f"in all: checkpoints keep {format_bytes(kept)} of inputs in place of the "
                f"{format_bytes(freed)} their stages save"
            )
            if times and all(t is not None for t in times):
                total += f"; the recompute costs {sum(t for t in times if t is not None):.2f} ms per step"
            lines.append(total)
        if self.predicted_peak_bytes is not None:
            lines.append(f"predicted peak: {format_bytes(self.predicted_peak_bytes)}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"autockpt plan: strategy={self.strategy!r}, walker={self.walker!r}, "
            f"{self.n_stages} stages in {len(self.segments)} segments, "
            f"{self.checkpointed_segments} checkpointed"
        )
        if self.policy != "recompute-all":
            head += f", policy={self.policy!r}"
        rows = [("segment", "stages", "recomputed", "kept ops", "modules")]
        for i, seg in enumerate(self.segments):
            rows.extend(_rows(self, seg, str(i), ""))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [head]
        for r in rows:
            lines.append("  ".join(r[c].ljust(widths[c]) for c in range(4)) + "  " + r[4])
        why = (
            "each checkpointed block is recomputed on its own"
            if self.walker == "blocks"
            else "the last segment is not checkpointed: backward needs its activations at once"
        )
        lines.append(f"recomputed in backward: {self.recomputed_stages} of {self.n_stages} stage forwards")
        lines[-1] += f" ({why})"
        if self.predicted_peak_bytes is not None:
            lines.append(f"predicted peak: {format_bytes(self.predicted_peak_bytes)}")
        if self.predicted_recompute_ms is not None:
            lines.append(f"predicted recompute time: {self.predicted_recompute_ms:.2f} ms per step")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _kept(seg: Segment) -> str:
    """``"3 (1.50 MiB, -2.10 ms)"``: how many ops a segment keeps, their bytes, the recompute
    time saved; ``"-"`` for none."""
    if not seg.keep:
        return "-"
    return f"{len(seg.keep)} ({format_bytes(seg.kept_bytes)}, -{seg.kept_ms:.2f} ms)"


def _stage_span(plan: Plan, seg: Segment) -> str:
    names = plan.stage_names
    if len(seg) == 1:
        return f"stage {seg.start} ({names[seg.start]})"
    if len(seg) <= 3:
        return f"stages {seg.start}-{seg.stop - 1} ({', '.join(names[seg.start : seg.stop])})"
    return f"stages {seg.start}-{seg.stop - 1} ({names[seg.start]} .. {names[seg.stop - 1]})"


def _recomputed(segments: Sequence[Segment]) -> int:
    total = 0
    for seg in segments:
        inner = _recomputed(seg.children) if seg.children else 0
        total += (len(seg) if seg.checkpoint else 0) + inner
    return total


def _rows(plan: Plan, seg: Segment, label: str, indent: str) -> list[tuple[str, str, str, str, str]]:
    stages = f"{seg.start}" if len(seg) == 1 else f"{seg.start}-{seg.stop - 1}"
    mods = ", ".join(f"{plan.stage_names[i]}:{plan.stage_kinds[i]}" for i in range(seg.start, seg.stop))
    rows = [(indent + label, stages, "yes" if seg.checkpoint else "no", _kept(seg), mods)]
    for j, child in enumerate(seg.children):
        rows.extend(_rows(plan, child, f"{label}.{j}", indent + "  "))
    return rows


# --- bytes as people write and read them: budget= arguments in, "1.50 MiB" out ------------
# (torch-free, so planners, plans and the command line share one reading and one spelling)

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget: object, *, unwrapped_bytes: int, where: str) -> int:
    """Bytes for a budget given as an int, ``"2GiB"``/``"512MB"``, or a fraction in (0, 1].

    A fraction is of ``unwrapped_bytes``, the unwrapped model's peak for one training step
    with parameters, buffers and inputs included.

    Raises:
        TypeError: not an int, float or str.
        ValueError: not positive, a fraction above 1, or an unknown unit.
    """
    fix = "Use bytes (an int), a string such as '2GiB' or '512MB', or a fraction in (0, 1]."
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"{where}: budget={budget!r} is a {type(budget).__name__}. {fix}")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"{where}: budget={budget!r} is a float outside (0, 1]. {fix}")
        value = int(budget * unwrapped_bytes)
    else:
        match = _PATTERN.match(budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{where}: cannot read budget={budget!r}. {fix}")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{where}: budget={budget!r} is not positive. {fix}")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``"1.50 MiB"``.

    Examples:
        >>> format_bytes(1536 * 1024)
        '1.50 MiB'
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
