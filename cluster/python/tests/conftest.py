"""What the tests need besides the wheel: torch (and torchvision) for the tests against PyTorch.

Where torch cannot be imported those tests skip with the reason, unless LEGION_REQUIRE lists
`torch`: then they fail, as every test of the repository does for a need it was promised.
"""

import os

import pytest


def required(need):
    return need in [n.strip() for n in os.environ.get("LEGION_REQUIRE", "").split(",")]


@pytest.fixture
def torch():
    try:
        import torch
        import torchvision  # noqa: F401
        import onnx  # noqa: F401
    except ImportError as e:
        if required("torch"):
            pytest.fail(f"LEGION_REQUIRE requires torch here, but: {e}")
        pytest.skip(f"torch, torchvision or onnx cannot be imported: {e}")
    torch.manual_seed(0)
    return torch
