import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("AUTOCKPT_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def _close_figures():
    """Close the matplotlib figures a test leaves open: pyplot keeps every figure until it is
    closed, and opening a 21st warns (an error under our filterwarnings), so figures left
    by earlier tests failed whichever test opened that one."""
    yield
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")
