"""PyTorch pickle files in detail: nanoGPT's ckpt.pt and bare state dicts in .pt files
(formats/nanogpt.py), and the rules they share with the other formats (formats/state_dict.py):
weights-only loading, memory mapping, the config read from a bare state dict's shapes, and the
errors, which name the file and the field at fault.

Every expected value comes from the inputs the test builds (the config it chose, the shapes it
wrote), not from the reader's output.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.serialization

from gpt2attn import CheckpointError, GPT2Config, GPT2LMHeadModel
from gpt2attn.formats.state_dict import check_state_dict, read_bin, refused
from gpt2attn.training.loop import read_training_state
from tests.helpers import randomize, tiny_config

LINEARS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GetPid:
    """A pickle that calls os.getpid when unpickled: harmless, but code all the same."""

    def __reduce__(self):
        return (os.getpid, ())


GETPID_GLOBAL = f"GLOBAL {os.getpid.__module__}.getpid"  # how torch names it (posix.getpid on Linux)


def load(path):
    return GPT2LMHeadModel.from_pretrained(path)


def load_error(path) -> str:
    """from_pretrained(path)'s error: a CheckpointError whose message starts with the file."""
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert type(err.value) is CheckpointError, repr(err.value)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    return message


def save_as_from_gpu(obj, path: Path, legacy: bool = False) -> None:
    """torch.save as a CUDA run writes it: every storage tagged with the location 'cuda:0' (the tag
    is all a file records of the device; the bytes are the same), so no GPU is needed."""
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    finally:
        torch.serialization.location_tag = original


# --- a bare state dict in a .pt file: the config comes from its shapes -----------------------------

# gpt2-medium's width: n_head 16 and n_embd 1024 both differ from GPT2Config's defaults (12, 768).
# One block with a narrow MLP (n_inner 8, not 4 * 1024) keeps the file at a few MB.
MEDIUM_WIDTH = dict(vocab_size=11, n_positions=5, n_embd=1024, n_layer=1, n_head=16, n_inner=8)


def bare_state_dict_file(tmp_path, legacy=False, from_gpu=False) -> tuple[Path, GPT2LMHeadModel]:
    model = GPT2LMHeadModel(GPT2Config(**MEDIUM_WIDTH))
    path = tmp_path / "weights.pt"
    if from_gpu:
        save_as_from_gpu(model.state_dict(), path, legacy=legacy)
    else:
        torch.save(model.state_dict(), path, _use_new_zipfile_serialization=not legacy)
    return path, model


def assert_same_weights(loaded, model):
    expected = model.state_dict()
    got = loaded.state_dict()
    assert list(got) == list(expected)
    for name, t in expected.items():
        assert got[name].device.type == "cpu", name
        assert torch.equal(got[name], t), name


def is_mapped(tensor, path: Path) -> bool:
    """Whether the tensor's memory is a map of `path` (Linux's /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        ranges = [line.split()[0].split("-") for line in maps if line.rstrip().endswith(str(path.resolve()))]
    return any(int(start, 16) <= tensor.data_ptr() < int(end, 16) for start, end in ranges)


@torch.no_grad()
def test_bare_state_dict_pt_file_loads_with_the_config_its_shapes_give(tmp_path):
    path, model = bare_state_dict_file(tmp_path)
    loaded = load(path)
    for field, value in MEDIUM_WIDTH.items():
        assert getattr(loaded.config, field) == value, field
    assert_same_weights(loaded, model)
    # A zip-format .pt file is memory-mapped: the weights are views of the file, not copies.
    assert is_mapped(loaded.transformer.wte.weight, path)
    assert is_mapped(loaded.transformer.h[0].attn.c_attn.weight, path)


@torch.no_grad()
def test_state_dict_saved_on_a_gpu_loads_onto_the_cpu_memory_mapped(tmp_path):
    """nanoGPT and most training scripts save from CUDA: the file's storages say 'cuda:0'. They are
    read onto the CPU (a machine without a GPU can read them), still mapped from the file."""
    path, model = bare_state_dict_file(tmp_path, from_gpu=True)
    loaded = load(path)
    assert_same_weights(loaded, model)
    assert is_mapped(loaded.transformer.wte.weight, path)


@torch.no_grad()
def test_legacy_format_state_dict_saved_on_a_gpu_loads_onto_the_cpu(tmp_path):
    """The pre-zip format (torch.save(..., _use_new_zipfile_serialization=False)) cannot be mapped:
    it is read into memory, and onto the CPU."""
    path, model = bare_state_dict_file(tmp_path, legacy=True, from_gpu=True)
    loaded = load(path)
    assert_same_weights(loaded, model)
    assert not is_mapped(loaded.transformer.wte.weight, path)


def test_bare_state_dict_of_a_width_without_a_known_n_head_is_refused(tmp_path):
    """n_head cannot be read from shapes; only OpenAI's widths (768, 1024, 1280, 1600) have a known
    one. The error names the file (or 'state dict' for a dict passed in) and the width."""
    model = GPT2LMHeadModel(tiny_config())  # n_embd 32
    path = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), path)
    assert "cannot tell n_head for width 32" in load_error(path)
    with pytest.raises(CheckpointError) as err:
        GPT2LMHeadModel.from_pretrained(model.state_dict())
    assert str(err.value).startswith("state dict: cannot tell n_head for width 32"), str(err.value)


def medium_tensors(**replace):
    """A bare state dict's body at width 768, as GPT2Model keys, with some tensors replaced (None drops one)."""
    state = {"wte.weight": torch.zeros(8, 768), "wpe.weight": torch.zeros(4, 768),
             "h.0.mlp.c_fc.weight": torch.zeros(768, 16), "ln_f.weight": torch.ones(768)}
    state.update(replace)
    return {name: t for name, t in state.items() if t is not None}


@pytest.mark.parametrize("state, message", [
    (medium_tensors(**{"wte.weight": torch.zeros(8)}), "wte.weight has shape (8,), not (rows, columns)"),
    (medium_tensors(**{"wpe.weight": torch.zeros(4)}), "wpe.weight has shape (4,), not (rows, columns)"),
    (medium_tensors(**{"h.0.mlp.c_fc.weight": torch.zeros(768)}),
     "h.0.mlp.c_fc.weight has shape (768,), not (rows, columns)"),
    (medium_tensors(**{"wpe.weight": None}), "state dict has no wte.weight / wpe.weight: is it a GPT-2 state dict?"),
    (medium_tensors(**{"wte.weight": None}), "state dict has no wte.weight / wpe.weight: is it a GPT-2 state dict?"),
    (medium_tensors(**{"h.0.mlp.c_fc.weight": None}),
     "the config its shapes give: GPT2Config.n_layer must be a positive integer, got 0"),
], ids=["wte-1d", "wpe-1d", "c_fc-1d", "no-wpe", "no-wte", "no-blocks"])
def test_bare_state_dict_whose_shapes_give_no_config_is_refused(tmp_path, state, message):
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    assert load_error(path) == f"{path}: {message}"


def test_bare_state_dict_file_with_a_key_that_is_not_a_name(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({**medium_tensors(), 7: torch.zeros(2)}, path)
    assert "a state dict's keys are tensor names, found the key 7" in load_error(path)


def test_pytorch_model_bin_with_a_value_that_is_not_a_tensor(tmp_path):
    folder = tmp_path / "model"
    GPT2LMHeadModel(tiny_config()).save_pretrained(folder, safe_serialization=False)
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "step": 3}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as err:
        load(folder)
    assert str(err.value) == f"{folder / 'pytorch_model.bin'}: step holds a int, not a tensor"


def test_check_state_dict_refuses_what_is_not_a_dict():
    with pytest.raises(CheckpointError) as err:
        check_state_dict([torch.zeros(2)], "weights.bin")
    assert str(err.value) == "weights.bin: holds a list, not a state dict"
    assert err.value.file == "weights.bin"


# --- weights-only loading ---------------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_pickle_that_runs_code_is_refused(tmp_path, legacy):
    path = tmp_path / "weights.pt"
    torch.save({"wte.weight": GetPid()}, path, _use_new_zipfile_serialization=not legacy)
    message = load_error(path)
    assert message == f"{path}: refused: holds objects that weights-only loading does not allow ({GETPID_GLOBAL})"


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_refused_even_when_the_environment_turns_weights_only_off(tmp_path, monkeypatch, legacy):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes torch.load run pickled code wherever the caller did
    not ask for weights_only=True itself: gpt2attn asks, so a file still cannot run code."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "weights.pt"
    torch.save({"wte.weight": GetPid()}, path, _use_new_zipfile_serialization=not legacy)
    message = load_error(path)
    assert "refused: holds objects that weights-only loading does not allow" in message
    assert GETPID_GLOBAL in message


def test_refusal_without_a_global_named_and_other_unpickling_errors():
    """refused() turns torch's UnpicklingError into the message a user reads: the GLOBAL it names,
    if any; an UnpicklingError that is not a weights-only refusal reads as a corrupt file."""
    path = Path("some/weights.pt")
    error = refused(path, pickle.UnpicklingError("Weights only load failed. WeightsUnpickler error: Unsupported operand 130"))
    assert type(error) is CheckpointError and error.file == str(path)
    assert str(error) == f"{path}: refused: holds objects that weights-only loading does not allow"
    error = refused(path, pickle.UnpicklingError("invalid load key, 'x'."))
    assert type(error) is CheckpointError and error.file == str(path)
    assert str(error) == f"{path}: cannot read this PyTorch checkpoint (truncated or corrupt?): invalid load key, 'x'."


@pytest.mark.parametrize("content", [b"<html><body>404 Not Found</body></html>\n", b"", b"version https://git-lfs"])
def test_a_file_that_is_neither_zip_nor_pickle_is_not_called_a_refusal(tmp_path, content):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        read_bin(path)
    assert str(err.value) == (f"{path}: not a PyTorch checkpoint: starts with {content[:4]!r}, "
                              "neither a zip archive nor a pickle (a failed download?)")


def test_a_missing_pickle_file_is_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        read_training_state(tmp_path)  # resuming from a checkpoint folder without training_state.pt
    assert str(err.value) == f"{tmp_path / 'training_state.pt'}: no such file"


# --- nanoGPT's ckpt.pt ------------------------------------------------------------------------------


def nanogpt_checkpoint(bias=True, drop=(), **args):
    """A nanoGPT out/ckpt.pt dict for tiny_config's sizes: torch.compile'd keys, (out, in) linear
    weights, no biases when bias=False, model_args as nanoGPT writes them (with `args` replacing
    fields and `drop` removing them)."""
    model = randomize(GPT2LMHeadModel(tiny_config(activation_function="gelu")))
    state = {
        "_orig_mod." + name: t.t().contiguous() if name.endswith(LINEARS) else t
        for name, t in model.state_dict().items()
        if (bias or not name.endswith(".bias")) and name != "lm_head.weight"
    }
    model_args = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=bias, vocab_size=97, dropout=0.0)
    model_args.update(args)
    for key in drop:
        del model_args[key]
    return {"model": state, "model_args": model_args, "iter_num": 3, "best_val_loss": 2.5}


def save(tmp_path, checkpoint) -> Path:
    path = tmp_path / "ckpt.pt"
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("dropout", [0.25, None], ids=["dropout-0.25", "no-dropout-field"])
def test_nanogpt_dropout_sets_every_dropout(tmp_path, dropout):
    """nanoGPT has one dropout for the embeddings, the attention and the residuals; a checkpoint
    without the field (older nanoGPT) trained without dropout."""
    if dropout is None:
        checkpoint, expected = nanogpt_checkpoint(drop=["dropout"]), 0.0
    else:
        checkpoint, expected = nanogpt_checkpoint(dropout=dropout), dropout
    config = load(save(tmp_path, checkpoint)).config
    assert (config.embd_pdrop, config.attn_pdrop, config.resid_pdrop) == (expected, expected, expected)


@torch.no_grad()
def test_nanogpt_without_a_bias_field_keeps_its_biases(tmp_path):
    """model_args without `bias` is nanoGPT's default, bias=True: the biases are the checkpoint's,
    and a checkpoint that lacks them does not fit (they are not made up as zeros)."""
    checkpoint = nanogpt_checkpoint(drop=["bias"])
    loaded = load(save(tmp_path, checkpoint))
    stored = checkpoint["model"]["_orig_mod.transformer.h.1.mlp.c_fc.bias"]
    assert torch.equal(loaded.transformer.h[1].mlp.c_fc.bias, stored)
    without_biases = nanogpt_checkpoint(bias=False, drop=["bias"])
    path = save(tmp_path, without_biases)
    message = load_error(path)
    assert "missing keys: transformer.h.0.ln_1.bias" in message


@torch.no_grad()
def test_nanogpt_without_biases_gets_zero_biases(tmp_path):
    loaded = load(save(tmp_path, nanogpt_checkpoint(bias=False)))
    assert torch.equal(loaded.transformer.h[1].attn.c_attn.bias, torch.zeros(3 * 32))
    assert torch.equal(loaded.transformer.h[0].mlp.c_fc.bias, torch.zeros(4 * 32))
    assert torch.equal(loaded.transformer.ln_f.bias, torch.zeros(32))


@pytest.mark.parametrize("edit, fragment", [
    (lambda c: c["model_args"].update(n_layer=3),
     "model_args (n_layer 3, n_embd 32, vocab_size 97) do not fit the weights in 'model' (2 blocks, wte (97, 32))"),
    (lambda c: c["model_args"].update(vocab_size=50),
     "model_args (n_layer 2, n_embd 32, vocab_size 50) do not fit the weights in 'model' (2 blocks, wte (97, 32))"),
    (lambda c: c["model"].pop("_orig_mod.transformer.wte.weight"),
     "model_args (n_layer 2, n_embd 32, vocab_size 97) do not fit the weights in 'model' (2 blocks, wte missing)"),
], ids=["more-layers", "other-vocab", "no-wte"])
def test_nanogpt_without_biases_whose_model_args_do_not_fit_its_weights(tmp_path, edit, fragment):
    """With bias=False, zero biases are made for n_layer blocks of width n_embd: model_args must fit
    the weights first, and the error gives both."""
    checkpoint = nanogpt_checkpoint(bias=False)
    edit(checkpoint)
    assert fragment in load_error(save(tmp_path, checkpoint))


@torch.no_grad()
def test_nanogpt_checkpoint_with_causal_mask_buffers_loads(tmp_path):
    """nanoGPT without flash attention (PyTorch < 2.0) registers each block's causal mask as the
    buffer attn.bias, saved among the weights (before attn.c_attn in state_dict order). The masks
    are not weights: they are skipped, and every weight after them is still read."""
    checkpoint = nanogpt_checkpoint()
    reference = load(save(tmp_path, checkpoint)).state_dict()
    mask = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    with_masks = {}
    for name, t in checkpoint["model"].items():
        if name.endswith(".attn.c_attn.weight"):
            with_masks[name.removesuffix("c_attn.weight") + "bias"] = mask
        with_masks[name] = t
    assert len(with_masks) == len(checkpoint["model"]) + 2
    path = tmp_path / "masks" / "ckpt.pt"
    path.parent.mkdir()
    torch.save({**checkpoint, "model": with_masks}, path)
    loaded = load(path).state_dict()
    assert list(loaded) == list(reference)
    for name, t in reference.items():
        assert torch.equal(loaded[name], t), name


def test_nanogpt_linear_weight_that_is_not_a_matrix(tmp_path):
    checkpoint = nanogpt_checkpoint()
    name = "_orig_mod.transformer.h.0.attn.c_attn.weight"
    checkpoint["model"][name] = checkpoint["model"][name].flatten()  # (3 * 32) * 32 values
    message = load_error(save(tmp_path, checkpoint))
    assert "'model' transformer.h.0.attn.c_attn.weight has shape (3072,), not (out, in)" in message


def test_nanogpt_model_with_a_key_that_is_not_a_name(tmp_path):
    checkpoint = nanogpt_checkpoint()
    checkpoint["model"][5] = torch.zeros(2)
    assert "a state dict's keys are tensor names, found the key 5" in load_error(save(tmp_path, checkpoint))


def test_neither_state_dict_nor_nanogpt_checkpoint(tmp_path):
    path = save(tmp_path, {"iter_num": 3, "config": {"n_layer": 2}})
    assert load_error(path) == (f"{path}: not a state dict (not every value is a tensor), and not a nanoGPT "
                                f"checkpoint: no 'model' or 'model_args' field")


def test_nanogpt_model_that_is_not_a_state_dict(tmp_path):
    checkpoint = nanogpt_checkpoint()
    checkpoint["model"] = [torch.zeros(2)]
    path = save(tmp_path, checkpoint)
    assert load_error(path) == f"{path}: the nanoGPT checkpoint's 'model' is not a state dict of tensors"


# --- dtype= of from_pretrained -----------------------------------------------------------------------


def tiny_state(dtype=torch.float32):
    return {name: t.to(dtype) for name, t in randomize(GPT2LMHeadModel(tiny_config())).state_dict().items()}


def loaded_dtypes(state, config, dtype):
    model = GPT2LMHeadModel.from_pretrained(state, config=config, dtype=dtype)
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("extra, stored, expected", [
    ({"torch_dtype": "bfloat16"}, torch.float32, torch.bfloat16),
    ({"dtype": "float16"}, torch.float32, torch.float16),  # the key newer transformers write
    ({"torch_dtype": "float32"}, torch.float16, torch.float32),
    ({}, torch.float16, torch.float16),  # no dtype in the config: as stored
    ({"torch_dtype": "float64"}, torch.float16, torch.float16),  # a name gpt2attn does not cast to: as stored
], ids=["torch_dtype-bf16", "dtype-fp16", "torch_dtype-fp32", "none", "unknown-name"])
def test_dtype_auto_is_the_configs_dtype(extra, stored, expected):
    config = tiny_config(**extra)
    assert loaded_dtypes(tiny_state(stored), config, "auto") == {expected}


@pytest.mark.parametrize("dtype, expected", [
    ("torch.float16", torch.float16),  # str(torch.float16), as a config or a command line gives it
    ("half", torch.float16),
    ("bf16", torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float64, torch.float64),  # any torch dtype, not only the named ones
    (None, torch.float32),  # as stored
])
def test_dtype_names_and_torch_dtypes(dtype, expected):
    assert loaded_dtypes(tiny_state(), tiny_config(), dtype) == {expected}


def test_unknown_dtype_name_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_pretrained(tiny_state(), config=tiny_config(), dtype="float8")
    names = ["float32", "fp32", "float", "float16", "fp16", "half", "bfloat16", "bf16"]
    assert str(err.value) == f"unknown dtype 'float8'; use one of {', '.join(names)} or 'auto'"
