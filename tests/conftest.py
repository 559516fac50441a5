import os

import pytest
import torch

from tests.helpers import kernel_builds, needs_kernels, num_threads

# The user's warning filters must not decide a test's outcome, in the subprocesses tests start too
# (pyproject.toml's filterwarnings does the same for this process).
os.environ.pop("PYTHONWARNINGS", None)

# Two cores: keep intra-op threads predictable for the whole suite.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(params=sorted(kernel_builds()) or [pytest.param(None, marks=needs_kernels)])
def build(request, monkeypatch):
    """Each build of the kernels this CPU can run in turn, as kernels.library(), on 2 threads."""
    from gpt2attn import kernels

    lib = kernel_builds()[request.param]
    monkeypatch.setattr(kernels, "library", lambda: lib)
    with num_threads(2):
        yield request.param
