"""Memory that follows the weights: quantize() keeps no fp32 copy of the matrices, loading with
quantize= reads one fp32 matrix at a time, and the GGUF and llm.c writers convert one tensor at a
time (writing the very bytes they wrote when they converted everything first), killable mid-file.
The peak RSS these give is measured by scripts/bench_memory.py, not here."""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import re
import resource
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gpt2attn import GPT2Config, GPT2LMHeadModel, loader, memory, quantize
from gpt2attn.formats import gguf, hf, llmc, nanogpt, save
from gpt2attn.formats.tf_checkpoint import load_tf_checkpoint
from gpt2attn.layers import Conv1D
from tests.helpers import REPO, randomize, tiny_config

pytest.importorskip("gguf")


@pytest.mark.parametrize("mode", ["fp16", "bf16", "int8"])
def test_quantize_keeps_no_fp32_copy_of_the_matrices(mode):
    model = randomize(GPT2LMHeadModel(tiny_config(n_embd=64, n_layer=3))).eval()
    expected = {name: t.clone() for name, t in model.state_dict().items()}
    matrices = [StorageWeakRef(m.weight.untyped_storage()) for m in model.modules() if isinstance(m, Conv1D)]
    wte = StorageWeakRef(model.transformer.wte.weight.untyped_storage())
    model.quantize(mode)
    alive = [i for i, ref in enumerate(matrices) if not ref.expired()]
    assert len(matrices) == 4 * 3 and alive == [], f"fp32 Conv1D weights still held after quantize({mode!r}): {alive}"
    assert not wte.expired()  # the embedding stays fp32 (and is what the tied head's state_dict gives)
    state = model.state_dict()  # Hugging Face's fp32 keys and shapes, computed when asked
    assert state.keys() == expected.keys()
    assert all(state[k].dtype == torch.float32 and state[k].shape == t.shape for k, t in expected.items())


def resident_bytes_of(path: Path) -> int:
    """Bytes of the file at `path` mapped into this process and resident: the Rss of its maps in
    /proc/self/smaps (pages of a map count once used, until the map goes)."""
    total, ours, name = 0, False, os.path.realpath(path)
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                ours = line.rstrip("\n").endswith(" " + name)
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def write_source(model: GPT2LMHeadModel, folder: Path, source: str) -> tuple[Path, Path]:
    """model written as `source` (a format, and the type its tensors are stored in: f32 unless
    named) under folder: what from_pretrained takes, and the file of the weights."""
    fmt, _, kind = source.partition(" ")
    kind = kind or "f32"
    if fmt == "gguf":
        path = folder / "model.gguf"
        save(model, path, dtype=kind)
    elif fmt == "llm.c":
        path = folder / "model.bin"
        save(model, path, dtype={"f32": "fp32", "bf16": "bf16"}[kind])
    elif fmt == "nanogpt":  # nn.Linear's (out, in) weights, transposed to Conv1D's when read
        path = folder / "ckpt.pt"
        state = {name: t.t().contiguous() if name.endswith(nanogpt.NANOGPT_LINEARS) else t
                 for name, t in model.state_dict().items() if name != "lm_head.weight"}
        c = model.config
        args = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions, bias=True,
                    vocab_size=c.vocab_size, dropout=0.0)
        torch.save({"model": state, "model_args": args}, path)
    else:  # an HF folder: "safetensors" or "pytorch_model.bin"
        stored = copy.deepcopy(model).half() if kind == "f16" else model
        stored.save_pretrained(folder / "model", safe_serialization=fmt == "safetensors")
        return folder / "model", folder / "model" / ("model.safetensors" if fmt == "safetensors" else fmt)
    return path, path


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the maps' resident pages from /proc/self/smaps (Linux)")
@pytest.mark.parametrize("source", ["safetensors", "llm.c", "gguf", "pytorch_model.bin", "nanogpt"])
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_loading_with_quantize_holds_one_fp32_matrix_at_a_time(tmp_path, monkeypatch, source, mode):
    """After each layer is packed, the file's resident pages are at most every tensor that stays
    fp32 (embeddings, norms, biases) and the one matrix being packed: a layer's pages go before
    the next is read (also from a pytorch_model.bin or a nanoGPT checkpoint, which torch maps as
    one piece that stays while any of its tensors does), so the whole fp32 model is never in memory
    at once."""
    config = tiny_config(vocab_size=512, n_positions=64, n_embd=128, n_layer=6)  # the matrices are most of it
    model = randomize(GPT2LMHeadModel(config))
    path, file = write_source(model, tmp_path, source)
    sizes = {name: t.numel() * 4 for name, t in model.state_dict().items() if name != "lm_head.weight"}
    matrices = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    kept = sum(size for name, size in sizes.items() if name.removesuffix(".weight") not in matrices)
    largest = max(sizes[f"{name}.weight"] for name in matrices)
    bound = kept + largest + 2 * len(sizes) * resource.getpagesize()  # a map may start and end inside a page
    assert bound < sum(sizes.values()) / 3  # so the whole model (or half of it) cannot pass

    steps = []
    pack = quantize.PackedLinear.__init__

    def packing(self, *args, **kwargs):
        pack(self, *args, **kwargs)
        steps.append(resident_bytes_of(file))

    monkeypatch.setattr(quantize.PackedLinear, "__init__", packing)
    GPT2LMHeadModel.from_pretrained(path, quantize=mode)
    assert len(steps) == len(matrices) + 1  # and the head
    assert steps[0] > 0 and max(steps) <= bound, (max(steps), bound, steps)


def whole_pages(t: torch.Tensor) -> range:
    page = resource.getpagesize()
    return range(-(-t.data_ptr() // page), (t.data_ptr() + t.numel() * t.element_size()) // page)


def present_pages(t: torch.Tensor) -> int:
    """Of t's whole pages, how many are mapped in (/proc/self/pagemap)."""
    pages = whole_pages(t)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(pages.start * 8)
        entries = np.frombuffer(f.read(len(pages) * 8), dtype=np.uint64)
    return int(((entries & np.uint64(memory.PRESENT)) != 0).sum())


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap (Linux)")
def test_a_file_s_16_bit_tensor_widened_as_it_loads_gives_back_its_pages(tmp_path):
    """torch maps a pytorch_model.bin as one piece, which stays while any of its tensors does: a
    tensor the loader widens to fp32 unmaps its 16-bit pages at once. A caller's tensor is left
    as it is."""
    model = randomize(GPT2LMHeadModel(tiny_config(n_embd=256, n_layer=2))).half()
    model.save_pretrained(tmp_path, safe_serialization=False)
    _, state, _ = hf.read(tmp_path)  # one map of the file, alive while any of these tensors is
    source = state["transformer.h.0.mlp.c_fc.weight"]  # (256, 1024) fp16: 512 KiB
    callers = state["transformer.h.1.mlp.c_fc.weight"]
    expected = source.float()  # every page read
    assert present_pages(source) >= 60 and source.dtype == torch.float16
    widened = loader.cast(source, torch.float32, None, copy=False)
    assert torch.equal(widened, expected) and present_pages(source) == 0
    assert torch.equal(source.float(), expected)  # read back from the file
    callers.float()
    loader.cast(callers, torch.float32, None, copy=True)
    assert present_pages(callers) >= 60


MADE_AS_READ = ["gguf f16", "gguf q8_0", "safetensors f16", "pytorch_model.bin f16", "llm.c bf16", "nanogpt"]


@pytest.mark.parametrize("source", MADE_AS_READ)
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_loading_with_quantize_makes_each_fp32_matrix_only_as_it_is_packed(tmp_path, monkeypatch, source, mode):
    """From a file whose matrices become fp32 only when read (16-bit or Q8_0 weights widened,
    nanoGPT's transposed), from_pretrained(quantize=) makes each just before it is packed and lets
    it go before the next: when any layer is packed, at most one fp32 matrix is alive. The model
    computes what the same file loaded in fp32 and then quantized computes."""
    config = tiny_config(vocab_size=1000, n_positions=64, n_embd=128, n_layer=4)
    model = randomize(GPT2LMHeadModel(config))
    path, _ = write_source(model, tmp_path, source)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Conv1D)}
    shapes |= {shape[::-1] for shape in shapes}  # as Conv1D's (in, out) or Linear's (out, in)
    assert (config.vocab_size, config.n_embd) not in shapes and (config.n_positions, config.n_embd) not in shapes

    made = []  # the fp32 matrices the loader made, by their storage
    cast = loader.cast

    def casting(*args, **kwargs):
        t = cast(*args, **kwargs)
        if t.dtype == torch.float32 and tuple(t.shape) in shapes:
            made.append(StorageWeakRef(t.untyped_storage()))
        return t

    alive = []  # fp32 matrices alive as each layer is packed
    pack = quantize.PackedLinear.__init__

    def packing(self, *args, **kwargs):
        pack(self, *args, **kwargs)
        alive.append(sum(not ref.expired() for ref in made))

    monkeypatch.setattr(loader, "cast", casting)
    monkeypatch.setattr(quantize.PackedLinear, "__init__", packing)
    loaded = GPT2LMHeadModel.from_pretrained(path, quantize=mode)
    monkeypatch.undo()
    assert len(made) == 4 * config.n_layer and len(alive) == 4 * config.n_layer + 1  # and the tied head
    assert max(alive) == 1, alive
    ids = torch.tensor([[5, 999, 17, 512, 5]])
    expected = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).quantize(mode)
    assert torch.equal(loaded(ids).logits, expected(ids).logits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_quantizing_a_16_bit_model_widens_each_matrix_only_as_it_is_packed(monkeypatch, dtype, mode):
    """quantize() on a model in fp16 or bf16: as each layer is packed, the fp32 matrices widened
    for the layers before it are gone and the layers after it are still 16-bit."""
    config = tiny_config(vocab_size=1000, n_positions=64, n_embd=128, n_layer=4)
    model = randomize(GPT2LMHeadModel(config)).eval().to(dtype)
    widened, alive, still_16_bit = [], [], []
    pack = quantize.PackedLinear.__init__

    def packing(self, weight, *args, **kwargs):
        pack(self, weight, *args, **kwargs)
        if weight is not model.transformer.wte.weight:  # the tied embedding is widened in place, and stays
            widened.append(StorageWeakRef(weight.untyped_storage()))
        alive.append(sum(not ref.expired() for ref in widened))
        still_16_bit.append({m.weight.dtype for m in model.modules() if isinstance(m, Conv1D)})

    monkeypatch.setattr(quantize.PackedLinear, "__init__", packing)
    model.quantize(mode)
    monkeypatch.undo()
    assert len(alive) == 4 * config.n_layer + 1 and len(widened) == 4 * config.n_layer  # and the tied head
    assert max(alive) == 1, alive
    assert all(dtypes <= {dtype} for dtypes in still_16_bit) and still_16_bit[0] == {dtype}, still_16_bit


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap (Linux)")
@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_quantizing_a_16_bit_model_gives_back_each_matrix_s_pages_of_its_file(tmp_path, mode):
    """A 16-bit pytorch_model.bin loaded as stored lies in torch's one map of the file, which stays
    while any tensor of it does: quantize() unmaps each 16-bit matrix's pages once it is packed
    (in fp32 mode too, where the layer keeps a widened copy, not the file's tensor)."""
    half = randomize(GPT2LMHeadModel(tiny_config(n_embd=256, n_layer=2))).half()
    half.save_pretrained(tmp_path, safe_serialization=False)
    model = GPT2LMHeadModel.from_pretrained(tmp_path)
    matrices = [m.weight for m in model.modules() if isinstance(m, Conv1D)]  # kept here: their pages can be read
    for w in matrices:
        w.float()  # every page read in
    assert model.dtype == torch.float16 and all(present_pages(w) >= 30 for w in matrices)
    model.quantize(mode)
    assert [present_pages(w) for w in matrices] == [0] * len(matrices)


def test_loading_with_quantize_refuses_what_cannot_go_with_it_before_reading(tmp_path):
    missing = tmp_path / "no such folder"
    with pytest.raises(ValueError, match="unknown quantize mode 'int4'"):
        GPT2LMHeadModel.from_pretrained(missing, quantize="int4")
    with pytest.raises(ValueError, match=r"quantize='int8' sets the matrices' precision .* dtype=torch.bfloat16 "):
        GPT2LMHeadModel.from_pretrained(missing, quantize="int8", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="quantize='bf16' is for the CPU; device='meta'"):
        GPT2LMHeadModel.from_pretrained(missing, quantize="bf16", device="meta")
    model = randomize(GPT2LMHeadModel(tiny_config()))
    model.save_pretrained(tmp_path / "model")
    for dtype in (None, "auto", "float32", torch.float32):  # what keeps fp32 is welcome
        loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "model", quantize="int8", dtype=dtype, device="cpu")
        assert loaded.transformer.wte.weight.dtype == torch.float32


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the maps' resident pages from /proc/self/smaps (Linux)")
@pytest.mark.parametrize("fmt", ["safetensors", "gguf f32"])
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_a_tied_embedding_s_file_pages_go_once_the_head_has_its_copy(tmp_path, monkeypatch, fmt, mode):
    """The tied head is packed first, from the embedding; from then on the embedding's pages of the
    file are not resident (the layers are packed without them, and lookups read their rows back),
    and the model computes what the same weights quantized in memory compute."""
    config = tiny_config(vocab_size=4096, n_positions=64, n_embd=128, n_layer=3)  # the embedding: 2 MiB
    model = randomize(GPT2LMHeadModel(config)).eval()
    if fmt == "safetensors":
        model.save_pretrained(tmp_path / "model")
        source = file = tmp_path / "model" / "model.safetensors"
    else:
        source = file = tmp_path / "model.gguf"
        save(model, file, dtype="f32")
    sizes = {name: t.numel() * 4 for name, t in model.state_dict().items() if name != "lm_head.weight"}
    matrices = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    kept = sum(size for name, size in sizes.items() if name.removesuffix(".weight") not in matrices)
    largest = max(sizes[f"{name}.weight"] for name in matrices)
    embedding = sizes["transformer.wte.weight"]
    slack = 2 * len(sizes) * resource.getpagesize()  # a map may start and end inside a page
    bound = kept - embedding + largest + slack
    assert bound < embedding / 2  # the embedding's pages cannot pass

    packed = []  # (outputs, the file's resident bytes) after each layer is packed
    pack = quantize.PackedLinear.__init__

    def packing(self, *args, **kwargs):
        pack(self, *args, **kwargs)
        packed.append((self.out_features, resident_bytes_of(file)))

    monkeypatch.setattr(quantize.PackedLinear, "__init__", packing)
    loaded = GPT2LMHeadModel.from_pretrained(source, quantize=mode)
    assert packed[0][0] == config.vocab_size and len(packed) == len(matrices) + 1  # the head first
    assert max(resident for _, resident in packed[1:]) <= bound, packed
    assert resident_bytes_of(file) <= bound
    monkeypatch.undo()
    ids = torch.tensor([[5, 4000, 17, 2048, 5]])
    assert torch.equal(loaded(ids).logits, model.quantize(mode)(ids).logits)


def test_values_written_into_a_mapped_embedding_stay_when_its_pages_go(tmp_path):
    """Only pages holding the file's unchanged contents are unmapped: a row written after loading
    (a private copy of its page) keeps its values through quantize(), which an unmapped copy would
    lose to the file's."""
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=4096, n_embd=128))).eval()
    model.save_pretrained(tmp_path / "model")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        loaded.transformer.wte.weight[7] = 1.5
        model.transformer.wte.weight[7] = 1.5
    loaded.quantize("int8")
    assert (loaded.transformer.wte.weight[7] == 1.5).all()
    ids = torch.tensor([[7, 9, 7]])
    assert torch.equal(loaded(ids).logits, model.quantize("int8")(ids).logits)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap (Linux)")
def test_only_pages_holding_a_file_s_unchanged_contents_are_unmapped(monkeypatch, tmp_path):
    advised = []
    monkeypatch.setattr(memory, "_libc", lambda: SimpleNamespace(madvise=lambda *args: advised.append(args)))
    in_memory = torch.ones(1 << 20)  # resident pages of no file
    memory.release_file_pages(in_memory)
    assert advised == []
    GPT2LMHeadModel(tiny_config(vocab_size=4096, n_embd=128)).save_pretrained(tmp_path / "model")
    mapped = GPT2LMHeadModel.from_pretrained(tmp_path / "model").transformer.wte.weight  # (4096, 128): 2 MiB
    assert torch.isfinite(mapped).all()  # every page read
    with torch.no_grad():
        mapped[2048] = 1.0  # a private copy of its page(s)
    memory.release_file_pages(mapped)
    page = resource.getpagesize()
    start, end = mapped.data_ptr(), mapped.data_ptr() + mapped.numel() * 4
    whole = set(range(-(-start // page), end // page))
    row = mapped[2048].data_ptr()
    written = set(range(row // page, (row + 128 * 4 - 1) // page + 1))
    unmapped = set()
    for first, length, advice in advised:
        assert first.value % page == 0 and length.value % page == 0 and advice.value == memory.MADV_DONTNEED
        unmapped |= set(range(first.value // page, (first.value + length.value) // page))
    assert len(whole) > 500 and unmapped == whole - written
    first = [tuple(arg.value for arg in args) for args in advised]
    advised.clear()
    memory.release_file_pages(mapped.t())  # the same bytes in another order: the same pages
    assert [tuple(arg.value for arg in args) for args in advised] == first
    advised.clear()
    memory.release_file_pages(mapped[::2])  # every other row: the rows between are not its own
    memory.release_file_pages(mapped[:, :64])  # half of each row
    assert advised == []
    monkeypatch.setattr(memory, "_libc", lambda: None)  # no C library to ask (Windows): nothing done
    memory.release_file_pages(mapped)


def test_free_heap_pages_go_back_to_the_system():
    """malloc keeps freed chunks between live ones resident; release_free_memory (malloc_trim)
    hands their pages back."""
    if not Path("/proc/self/status").exists() or getattr(memory._libc(), "malloc_trim", None) is None:
        pytest.skip("needs /proc/self/status and a C library with malloc_trim (glibc)")

    def resident() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

    chunks = [bytearray(100_000) for _ in range(1000)]  # 100 MB from malloc's heap (below its mmap threshold)
    del chunks[::2]  # 50 MB freed between chunks that stay: the heap cannot shrink from its top
    before = resident()
    memory.release_free_memory()
    assert before - resident() > 30 * 2**20
    assert len(chunks) == 500


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the maps' resident pages from /proc/self/smaps (Linux)")
@pytest.mark.parametrize("name", ["m-f16.gguf", "m-q8_0.gguf", "m-fp32.bin", "m-folder"])
def test_writers_unmap_each_tensor_of_a_mapped_model_once_written(tmp_path, name):
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=1024, n_embd=128, n_layer=3))).eval()
    model.save_pretrained(tmp_path / "model")
    source = tmp_path / "model" / "model.safetensors"
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    ids = torch.tensor([[3, 1000, 77]])
    with torch.no_grad():
        before = loaded(ids).logits  # every weight read: the file's pages resident
    n_tensors = len(loaded.state_dict())
    assert resident_bytes_of(source) > source.stat().st_size / 2
    dtype = None if name == "m-folder" else name.removesuffix(".gguf").removesuffix(".bin").removeprefix("m-")
    save(loaded, tmp_path / name, dtype=dtype)  # m-folder: a Hugging Face folder (safetensors)
    assert resident_bytes_of(source) <= 2 * n_tensors * resource.getpagesize()  # a map's first and last pages
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)  # the pages are mapped back from the file


def exact_state(config: GPT2Config) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict (head tied) of multiples of 1/1024 from integer arithmetic: the
    same bits on every machine and torch version, so a file written from it has one hash."""
    state = {}
    for k, (name, t) in enumerate(GPT2LMHeadModel(config).state_dict().items()):
        values = (torch.arange(t.numel(), dtype=torch.int64) * 7919 + k * 104729) % 251 - 125
        state[name] = (values.float() / 1024).view(t.shape)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


# n_inner 80: ffn_down's rows (80 values) are no multiple of Q8_0's block, so q8_0 writes it F16
GGUF_CONFIG = dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=80)
LLMC_CONFIG = dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)
# sha256 of the files the writers wrote when they converted every tensor before writing any
# (commit ea93f48, gguf package 0.19.0): converting one tensor at a time must not change a byte.
# A GGUF file's header is the gguf package's to write (another release may add a key), so beside the
# whole file's hash, which holds under the release that wrote it, its tensor data (from the reader's
# data_offset on, the part our conversion writes) has a hash of its own that holds under any release.
WRITTEN_BY = "0.19.0"
GGUF_DATA_BEFORE = {
    "m-f32.gguf": "ff5bd6acc9d89e5bd4ae2360cbdd8215ffa7456e0026c2ce69e00db9acb691b1",
    "m-f16.gguf": "0bb012482ae423feb7ef9069669eedda68b8bd10846fa72593e59b6eae2d4176",
    "m-bf16.gguf": "b8c5824ee26d235f5db92125e6e4dc504e87e0186c47b5a5d1ff00acf2c57619",
    "m-q8_0.gguf": "5ad794ac9b385de7499641f84b6b420c7459eea87403a24446bbd1d4e9c34286",
}
WRITTEN_BEFORE = {
    "m-f32.gguf": "33e382391537acc9bca9e052cc50391a2d67d1e11003a06128e23f2aa4b3e986",
    "m-f16.gguf": "ed67f36736392404489b9a7e30fb268b528adaea4752b4819327a3ab73f14b37",
    "m-bf16.gguf": "7d75aa59db0cdaed443b12f8d36026aa7a73b73340b7850e32168cf40a4c80cb",
    "m-q8_0.gguf": "b1dab4c059b5685ac1ef6700bbfb341194a610da5405e5c19b1d947c82c18985",
    "m-fp32.bin": "966b1361f9e0dc0cf2279f29a288dd1026e923a02aacd8bc6b4dde24de154289",
    "m-bf16.bin": "10ea778e93803ea0d68122dc6a69bca30cd595696be59f0a7ff105334cc83d10",
}


def write_exact(path: Path) -> None:
    """The exact model of the file name's format and type (m-KIND.gguf or m-KIND.bin) written at path."""
    fmt, config = (gguf, GGUF_CONFIG) if path.suffix == ".gguf" else (llmc, LLMC_CONFIG)
    config = GPT2Config(**config)
    fmt.write(path, exact_state(config), config, dtype=path.stem.removeprefix("m-"))


@pytest.mark.parametrize("name", WRITTEN_BEFORE)
def test_streaming_writers_write_the_bytes_they_wrote_before(tmp_path, name):
    write_exact(tmp_path / name)
    written = (tmp_path / name).read_bytes()
    if name.endswith(".gguf"):
        import gguf as gguf_package

        start = gguf_package.GGUFReader(tmp_path / name).data_offset
        assert hashlib.sha256(written[start:]).hexdigest() == GGUF_DATA_BEFORE[name]
    if name == "m-q8_0.gguf":
        types = {n: t[0] for n, t in gguf.GGUFFile(tmp_path / name).tensors.items()}
        assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
    if name.endswith(".bin") or importlib.metadata.version("gguf") == WRITTEN_BY:
        assert hashlib.sha256(written).hexdigest() == WRITTEN_BEFORE[name]


@pytest.mark.parametrize("name", ["m-q8_0.gguf", "m-f16.gguf", "m-bf16.bin"])
def test_writers_hold_one_converted_tensor_at_a_time(tmp_path, monkeypatch, name):
    fmt = gguf if name.endswith(".gguf") else llmc
    convert, converted, alive_at_each = fmt.stored_data, [], []

    def tracked(*args):
        alive_at_each.append(sum(ref() is not None for ref in converted))
        out = convert(*args)
        converted.append(weakref.ref(out))
        return out

    monkeypatch.setattr(fmt, "stored_data", tracked)
    write_exact(tmp_path / name)
    assert len(alive_at_each) > 20 and set(alive_at_each) == {0}, alive_at_each


KILLED_WRITER = r"""
import resource, signal, sys
from pathlib import Path
from {module} import write_exact
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python starts with it ignored
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
write_exact(Path(sys.argv[1]))  # SIGXFSZ, whose default action kills, when the file reaches the limit
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="kills the writer by its file size limit (POSIX)")
@pytest.mark.parametrize("name", ["m-q8_0.gguf", "m-bf16.bin"])
def test_a_writer_killed_mid_file_leaves_the_old_file(tmp_path, name):
    path = tmp_path / name
    write_exact(tmp_path / "new" / name)
    new_size = (tmp_path / "new" / name).stat().st_size
    path.write_bytes(b"the old file")
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER.format(module=__name__), str(path), str(new_size // 2)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == -signal.SIGXFSZ, done.stderr
    assert path.read_bytes() == b"the old file"
    (partial,) = [p for p in tmp_path.iterdir() if p.name not in (name, "new")]
    assert partial.name.startswith(f".{name}.") and partial.stat().st_size == new_size // 2
    write_exact(path)  # the next write replaces the file and removes the killed one's leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "new"])
    assert path.read_bytes() == (tmp_path / "new" / name).read_bytes()


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads /proc/self/pagemap (Linux)")
def test_an_openai_checkpoint_s_pages_read_by_its_checksums_are_given_back(monkeypatch):
    """Each tensor's crc32c reads all of its pages; once checked, they are unmapped (the map
    stays, and a page is read again when used), so reading the checkpoint does not hold it."""
    advised = []
    libc = memory._libc()
    monkeypatch.setattr(memory, "_libc", lambda: SimpleNamespace(madvise=lambda *args: advised.append(args)))
    config, state = load_tf_checkpoint(REPO / "tests" / "data" / "openai-tf-tiny")
    page = resource.getpagesize()
    unmapped = set()
    for first, length, advice in advised:
        assert advice.value == memory.MADV_DONTNEED
        unmapped |= set(range(first.value // page, (first.value + length.value) // page))
    read = set().union(*(whole_pages(t) for t in state.values()))
    assert len(read) >= 8 and unmapped == read
    for first, length, advice in advised:  # given back for real, the values are read again from the file
        libc.madvise(first, length, advice)
    model = GPT2LMHeadModel.from_pretrained(REPO / "tests" / "data" / "openai-tf-tiny")
    assert torch.equal(model.transformer.wte.weight, state["transformer.wte.weight"])
