"""Reference models shipped with autockpt."""

from autockpt.models.gpt2 import gpt2_decoder
from autockpt.models.nin import NiN

__all__ = ["NiN", "gpt2_decoder"]
