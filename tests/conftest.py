import torch

# Two cores: keep intra-op threads predictable for the whole suite.
torch.set_num_threads(min(2, torch.get_num_threads()))
