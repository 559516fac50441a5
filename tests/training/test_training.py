"""The model in a user's loop, and the pieces of `gpt2attn train`: config, schedule, data."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn.tokenizer import char_tokenizer
from gpt2attn.training import TokenData, load_config, lr_at, prepare_data, train
from tests.helpers import hf_twin, max_diff, randomize, tiny_config


def _batch(seed=0, B=3, T=16, vocab=97):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# --- the model in a user's loop ----------------------------------------------------------


def test_user_loop_loss_and_grads_match_transformers():
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=1, std=0.1).train()
    hf = hf_twin(model).train()
    ids = _batch()
    loss = model(ids, labels=ids).loss
    hf_loss = hf(ids, labels=ids).loss
    loss.backward()
    hf_loss.backward()
    assert abs(loss.item() - hf_loss.item()) < 1e-5
    hf_grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        assert max_diff(p.grad, hf_grads[name].grad) < 1e-5, name


@torch.no_grad()
def test_attention_dropout_matches_transformers_statistics():
    """attn_pdrop alone (the other dropouts off): in train mode the logits vary from pass to pass
    with the spread and mean of transformers' dropout of the attention weights (inverted dropout:
    kept weights scaled by 1/(1-p))."""
    torch.manual_seed(0)
    model = randomize(GPT2LMHeadModel(tiny_config(n_layer=1, attn_pdrop=0.5)), seed=6)
    hf = hf_twin(model)
    n = 300
    ids = _batch(B=1, T=8).expand(n, 8)  # n copies of one row: n independent dropout draws
    ours = model.train()(ids).logits.double()  # (n, T, V)
    theirs = hf.train()(ids).logits.double()
    assert max_diff(model.eval()(ids).logits, hf.eval()(ids).logits) < 1e-5  # no dropout in eval mode
    assert theirs.var(0).mean() > 0.5  # dropout matters here
    assert 0.85 < ours.var(0).mean() / theirs.var(0).mean() < 1.15
    standard_error = (theirs.var(0) / n).sqrt().mean()
    assert (ours.mean(0) - theirs.mean(0)).abs().mean() < 2 * standard_error


def test_user_loop_with_any_optimizer_learns():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = _batch()
    first = model(ids, labels=ids).loss.item()
    for _ in range(20):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    assert model(ids, labels=ids).loss.item() < first - 1.0


def test_configure_optimizers_decays_only_matrices():
    model = GPT2LMHeadModel(tiny_config())
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=3e-4, betas=(0.9, 0.95))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["lr"] == 3e-4 and decay["betas"] == (0.9, 0.95)
    by_id = {id(p): name for name, p in model.named_parameters()}
    decayed = {by_id[id(p)] for p in decay["params"]}
    kept = {by_id[id(p)] for p in no_decay["params"]}
    assert decayed == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert kept == {n for n, p in model.named_parameters() if p.dim() < 2}
    assert "transformer.wte.weight" in decayed and "transformer.h.0.ln_1.weight" in kept
    assert "transformer.h.0.attn.c_attn.bias" in kept
    # lm_head is tied to wte: the parameter is in the optimizer once.
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_gradient_checkpointing_same_loss_and_grads():
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=2, std=0.1).train()
    ids = _batch(1)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="use_cache"):
        out = model(ids, labels=ids, use_cache=True)
    assert out.past_key_values is None
    out.loss.backward()
    assert max_diff(out.loss, loss) < 1e-6
    for name, p in model.named_parameters():
        assert max_diff(p.grad, grads[name]) < 1e-6, name
    model.gradient_checkpointing_disable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(ids, labels=ids, use_cache=True)


def test_autocast_bf16_on_cpu_trains():
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=3, std=0.1).train()
    ids = _batch(2)
    reference = model(ids, labels=ids).loss.item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32  # the loss is taken in fp32
    assert abs(out.loss.item() - reference) < 0.05 * reference
    out.loss.backward()
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
def test_compiled_forward_matches_eager():
    model = randomize(GPT2LMHeadModel(tiny_config(n_layer=1)), seed=4, std=0.1).eval()
    ids = _batch(3)
    compiled = torch.compile(model)
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        fast = compiled(ids, use_cache=False).logits
    assert max_diff(fast, eager) < 1e-4


# --- config --------------------------------------------------------------------------


def test_load_config_toml_then_overrides(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('n_layer = 6\nlearning_rate = 3e-4\ndata = "a.txt"\ncompile = false\n')
    cfg = load_config(recipe, ["--n_layer=2", "--learning_rate=1e-3", "--compile", "--out_dir=x", "--max_iters=1e3"])
    assert (cfg.n_layer, cfg.learning_rate, cfg.compile, cfg.out_dir, cfg.data) == (2, 1e-3, True, "x", "a.txt")
    assert cfg.max_iters == 1000 and isinstance(cfg.max_iters, int)
    assert load_config(recipe).n_layer == 6


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--n_layers=2"], "unknown setting --n_layers"),
        (["--n_layer=two"], "n_layer must be int"),
        (["--n_layer=2.5"], "n_layer must be int"),
        (["--compile=maybe"], "compile must be bool"),
        (["max_iters=3"], "--key=value"),
        (["--batch_size=0"], "batch_size must be positive"),
        (["--dtype=float8"], "dtype must be"),
    ],
)
def test_load_config_rejects_bad_overrides(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_load_config_rejects_unknown_toml_key_and_missing_file(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("n_layr = 2\n")
    with pytest.raises(ValueError, match="unknown key 'n_layr'"):
        load_config(recipe)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "absent.toml")


def test_shipped_recipe_keeps_nanogpts_cpu_model_batch_and_evaluations():
    """The recipe benchmark compares it with nanoGPT's CPU run: only the schedule may differ."""
    cfg = load_config("configs/train/shakespeare_char_cpu.toml")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.batch_size) == (4, 4, 128, 64, 12)
    assert (cfg.warmup_iters, cfg.eval_interval, cfg.eval_iters) == (100, 250, 20)
    assert (cfg.dropout, cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.grad_clip) == (0.0, 0.1, 0.9, 0.99, 1.0)
    assert cfg.lr_decay_iters == cfg.max_iters and cfg.min_lr == pytest.approx(cfg.learning_rate / 10)
    assert cfg.dtype == "float32" and cfg.tokenizer == "char"


# --- schedule ------------------------------------------------------------------------


def test_lr_warmup_then_cosine():
    cfg = load_config(None, ["--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=100", "--lr_decay_iters=2000"])
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 101)
    assert lr_at(99, cfg) == pytest.approx(1e-3 * 100 / 101)
    assert lr_at(100, cfg) == pytest.approx(1e-3)  # cos(0) = 1
    assert lr_at(1050, cfg) == pytest.approx((1e-3 + 1e-4) / 2)  # half way: cos(pi/2) = 0
    assert lr_at(2000, cfg) == pytest.approx(1e-4)
    assert lr_at(5000, cfg) == pytest.approx(1e-4)
    decay = [lr_at(s, cfg) for s in range(100, 2001)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


# --- data ----------------------------------------------------------------------------


def test_prepare_data_char_split_and_blocks(tmp_path):
    text = "".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(3000))
    src = tmp_path / "t.txt"
    src.write_text(text)
    folder = prepare_data(src, tmp_path / "data", "char", val_fraction=0.1)
    tok = char_tokenizer(text)
    train = np.fromfile(folder / "train.bin", dtype=np.uint16)
    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    assert len(val) == int(len(text) * 0.1) and len(train) + len(val) == len(text)
    assert tok.decode(np.concatenate([train, val]).tolist()) == text
    assert (folder / "tokenizer.json").read_text() == tok.to_str()

    # Stored once: a second call with the same source reuses the files.
    stamp = (folder / "train.bin").stat().st_mtime_ns
    prepare_data(src, tmp_path / "data", "char", val_fraction=0.1)
    assert (folder / "train.bin").stat().st_mtime_ns == stamp

    data = TokenData(folder, block_size=8)
    offsets = data.offsets("train", 5, torch.Generator().manual_seed(0))
    x, y = data.batch("train", offsets)
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64
    for row, start in enumerate(offsets.tolist()):
        assert x[row].tolist() == train[start : start + 8].tolist()
        assert y[row].tolist() == train[start + 1 : start + 9].tolist()


def test_prepare_data_gpt2_bpe(tmp_path):
    from tests.helpers import shared_data

    bpe = shared_data("gpt2-tokenizer")
    src = tmp_path / "t.txt"
    src.write_text("Hello world " * 200)
    folder = prepare_data(src, tmp_path / "data", str(bpe))
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    assert ids[:2].tolist() == [15496, 995]  # "Hello world" in GPT-2's BPE


def test_prepare_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        prepare_data(tmp_path / "absent.txt", tmp_path / "data")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt files"):
        prepare_data(tmp_path / "empty", tmp_path / "data")
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ValueError, match="too few"):
        prepare_data(short, tmp_path / "data")
    src = tmp_path / "t.txt"
    src.write_text("abcdefghij" * 3)
    prepare_data(src, tmp_path / "data2")
    with pytest.raises(ValueError, match="block_size"):
        TokenData(tmp_path / "data2", block_size=64)


def test_prepare_data_folder_joins_txt_files(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.txt").write_text("second part. " * 20)
    (tmp_path / "in" / "a.txt").write_text("first part. " * 20)
    folder = prepare_data(tmp_path / "in", tmp_path / "data")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = np.concatenate([np.fromfile(folder / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert tok.decode(ids.tolist()) == "first part. " * 20 + "second part. " * 20


def test_math_of_cross_entropy_at_init_is_log_vocab():
    # A fresh model predicts nearly uniformly: loss ~ ln(vocab), the loop's first losses.
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config())
    ids = _batch(5)
    assert model(ids, labels=ids).loss.item() == pytest.approx(math.log(97), rel=0.05)


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_trains_in_bf16_only_where_the_cpu_has_it(monkeypatch, native, capsys, tmp_path):
    """The CPU's answer is patched, so the test holds on any CPU: auto is bfloat16 with native bf16
    and float32 without; bfloat16 asked for without it still runs, with a warning naming auto."""
    from gpt2attn.training import loop

    monkeypatch.setattr("gpt2attn.cpu.bf16_report", lambda: (native, "this CPU (patched)"))
    cpu = torch.device("cpu")
    assert loop.autocast_dtype("auto", cpu, say=True) == ("bfloat16" if native else "float32")
    assert "dtype auto" in capsys.readouterr().out
    assert loop.autocast_dtype("float32", cpu, say=True) == "float32"
    if native:
        assert loop.autocast_dtype("bfloat16", cpu, say=True) == "bfloat16"
    else:
        with pytest.warns(UserWarning, match='dtype = "auto" picks float32'):
            assert loop.autocast_dtype("bfloat16", cpu, say=True) == "bfloat16"

    # A run with dtype auto trains under the autocast that was picked (a spy on torch.autocast).
    entered = []
    real_autocast = torch.autocast

    def spy(device_type, dtype=None, enabled=True, **kwargs):
        entered.append((dtype, enabled))
        return real_autocast(device_type, dtype=dtype, enabled=enabled, **kwargs)

    monkeypatch.setattr(torch, "autocast", spy)
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 20)
    cfg = load_config(None, [f"--data={text}", f"--out_dir={tmp_path / 'run'}", "--n_layer=1", "--n_head=2",
                             "--n_embd=16", "--block_size=8", "--batch_size=2", "--eval_iters=1", "--warmup_iters=0",
                             "--max_iters=2", "--eval_interval=2", "--progress=false", "--plot=false",
                             "--device=cpu", "--dtype=auto"])
    result = train(cfg)
    assert result["step"] == 2 and math.isfinite(result["val_loss"])
    assert entered == ([(torch.bfloat16, True)] if native else [(torch.float32, False)])


def test_packaged_recipe_found_by_name_from_any_folder_and_a_path_still_accepted(tmp_path, monkeypatch):
    """`gpt2attn train --config shakespeare_char_cpu` works outside the repository (and from a wheel)."""
    from gpt2attn.training import find_recipe, packaged_recipes

    by_path = load_config("configs/train/shakespeare_char_cpu.toml")
    monkeypatch.chdir(tmp_path)
    assert "shakespeare_char_cpu" in packaged_recipes()
    assert load_config("shakespeare_char_cpu") == by_path
    assert load_config("shakespeare_char_cpu.toml") == by_path
    local = tmp_path / "shakespeare_char_cpu.toml"  # a file of that name in the folder wins over the packaged one
    local.write_text("n_layer = 2\n")
    assert find_recipe("shakespeare_char_cpu.toml").resolve() == local and load_config("shakespeare_char_cpu.toml").n_layer == 2
    with pytest.raises(FileNotFoundError, match="packaged: shakespeare_char_cpu, shakespeare_char_default"):
        load_config("no_such_recipe")
    with pytest.raises(FileNotFoundError, match="no config file at sub/shakespeare_char_cpu.toml"):
        load_config("sub/shakespeare_char_cpu.toml")  # a path is a path: no fallback to the packaged name
