import os

import torch

# The user's warning filters must not decide a test's outcome, in the subprocesses tests start too
# (pyproject.toml's filterwarnings does the same for this process).
os.environ.pop("PYTHONWARNINGS", None)

# Two cores: keep intra-op threads predictable for the whole suite.
torch.set_num_threads(min(2, torch.get_num_threads()))
