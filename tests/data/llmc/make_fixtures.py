"""Make the llm.c fixtures with llm.c's own code (see README.md).

    python tests/data/llmc/make_fixtures.py PATH/TO/llm.c/train_gpt2.py

imports llm.c's train_gpt2.py from the given path, builds its GPT (its own init, seed 42) and
writes tiny_fp32.bin and tiny_bf16.bin with its write_model, and expected.pt with tokens and
llm.c's forward logits (fp32 weights) for those tokens.
"""

import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
# llm.c's pad_vocab insists on GPT-2's vocabulary (50257), padded to 50304; the rest is tiny.
CONFIG = dict(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=16)
# Logit columns kept in expected.pt (the full (2, 8, 50257) would be 3 MB): both ends of the vocabulary.
COLUMNS = torch.cat([torch.arange(0, 256), torch.arange(50257 - 256, 50257)])


def main(train_gpt2: str) -> None:
    spec = importlib.util.spec_from_file_location("llmc_train_gpt2", train_gpt2)
    llmc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llmc)
    model = llmc.GPT(llmc.GPTConfig(**CONFIG)).eval()
    with torch.no_grad():  # llm.c zero-initialises biases and LayerNorms are ones: give them values
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "ln_" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    llmc.write_model(model, str(HERE / "tiny_fp32.bin"), dtype="float32")
    llmc.write_model(model, str(HERE / "tiny_bf16.bin"), dtype="bfloat16")
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(tokens, targets=tokens)  # with targets llm.c returns every position's logits
    torch.save({"tokens": tokens, "columns": COLUMNS, "logits": logits[..., COLUMNS].contiguous()},
               HERE / "expected.pt")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
