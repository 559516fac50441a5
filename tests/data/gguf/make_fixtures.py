"""Make the GGUF fixtures with llama.cpp's own converter, not with gpt2attn's writer.

    python tests/data/gguf/make_fixtures.py LLAMA_CPP_DIR [GPT2_TOKENIZER_DIR]

LLAMA_CPP_DIR is a checkout of github.com/ggerganov/llama.cpp (these were made at c392e509)
holding convert_hf_to_gguf.py and gguf-py/; GPT2_TOKENIZER_DIR holds OpenAI's GPT-2 vocab.json and
merges.txt (default: ../shared/data/gpt2-tokenizer). A random transformers GPT-2 (vocab 50257, as
the converter needs; n_embd 32, a multiple of Q8_0's 32-value blocks; n_positions 128, so the
context is not 1024) is saved with save_pretrained and converted to tiny-f16.gguf and
tiny-q8_0.gguf beside this script.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).resolve().parent


def main(llama_cpp: Path, tokenizer_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-gpt2"
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=50257, n_positions=128, n_embd=32, n_layer=2, n_head=2)
        model = transformers.GPT2LMHeadModel(config)
        with torch.no_grad():  # spread the weights so that quantization changes the logits visibly
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        model.save_pretrained(folder)
        # The hub's GPT-2 config.json has n_ctx (which the converter reads); transformers 5 no longer writes it.
        config_file = folder / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "n_ctx": config.n_positions}))
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(tokenizer_dir / name, folder / name)
        transformers.GPT2TokenizerFast.from_pretrained(folder).save_pretrained(folder)
        env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
        for outtype in ("f16", "q8_0"):
            out = HERE / f"tiny-{outtype}.gguf"
            subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder),
                            "--outtype", outtype, "--outfile", str(out)], check=True, env=env)


if __name__ == "__main__":
    default_tokenizer = HERE.parents[3] / "shared" / "data" / "gpt2-tokenizer"
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else default_tokenizer)
