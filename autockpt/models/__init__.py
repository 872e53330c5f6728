"""Reference models shipped with autockpt."""

from autockpt.models.nin import NiN

__all__ = ["NiN"]
