import os
import sys

import pytest
import torch

# Triton reads this when a kernel is decorated, so it must precede importing the package's kernels.
# Without a GPU the kernels run in the interpreter; with one they compile.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run through the device tool: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
