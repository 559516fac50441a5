"""gpt2attn.inspect: captured activations, edits, clean-up; the textbook attention formula."""

import math

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, causal_mask, inspect, scaled_dot_product_attention
from gpt2attn.layers import no_tap
from gpt2attn.tokenizer import char_tokenizer
from tests.helpers import max_diff, randomize, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize(GPT2LMHeadModel(tiny_config(n_layer=3)), seed=1).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))


def test_textbook_formula_matches_hand_computation():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, weights = scaled_dot_product_attention(q, k, v, causal_mask(5, 5))
    scores = q @ k.transpose(-2, -1) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), -math.inf)
    expected_w = scores.exp() / scores.exp().sum(-1, keepdim=True)
    assert max_diff(weights, expected_w) < 1e-12
    assert max_diff(out, expected_w @ v) < 1e-12
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert max_diff(out, fused) < 1e-12


def test_captured_weights_equal_output_attentions(model, ids):
    with torch.no_grad(), inspect.capture(model, layers=[0, 2], names=["weights"]) as acts:
        out = model(ids, output_attentions=True)
    assert sorted(acts) == ["h.0.attn.weights", "h.2.attn.weights"]
    for layer in (0, 2):
        assert acts[f"h.{layer}.attn.weights"].shape == (2, 4, 9, 9)
        assert torch.equal(acts[f"h.{layer}.attn.weights"], out.attentions[layer])


def test_only_chosen_layers_leave_the_fast_path(model, ids, monkeypatch):
    import gpt2attn.layers

    calls = []
    fused, textbook = torch.nn.functional.scaled_dot_product_attention, gpt2attn.layers.scaled_dot_product_attention

    def counting_fused(*args, **kwargs):
        calls.append("fused")
        return fused(*args, **kwargs)

    def counting_textbook(*args):
        calls.append("textbook")
        return textbook(*args)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_fused)
    monkeypatch.setattr(gpt2attn.layers, "scaled_dot_product_attention", counting_textbook)
    originals = [block.attn.textbook for block in model.transformer.h]
    with inspect.capture(model, layers=[1], names=["weights", "q"]):
        seen = [block.attn.textbook for block in model.transformer.h]
        with torch.no_grad():
            model(ids)
    assert seen == [False, True, False]
    assert calls == ["fused", "textbook", "fused"]
    with inspect.capture(model, layers=[0], names=["q"]):
        assert not model.transformer.h[0].attn.textbook  # q alone does not need the weights
    assert [block.attn.textbook for block in model.transformer.h] == originals


def test_captured_qkv_equal_recompute_from_c_attn(model, ids):
    with torch.no_grad(), inspect.capture(model, layers=[1], names=["ln_1", "q", "k", "v", "resid_pre"]) as acts:
        model(ids)
    attn = model.transformer.h[1].attn
    x = acts["h.1.resid_pre"]
    ln = model.transformer.h[1].ln_1
    ln_1 = torch.nn.functional.layer_norm(x, (32,), ln.weight, ln.bias)
    assert max_diff(acts["h.1.ln_1"], ln_1) < 1e-5
    qkv = ln_1 @ attn.c_attn.weight + attn.c_attn.bias  # (B, T, 3C)
    for i, name in enumerate("qkv"):
        expected = qkv[..., 32 * i : 32 * (i + 1)].reshape(2, 9, 4, 8).permute(0, 2, 1, 3)  # (B, nh, T, hs)
        assert max_diff(acts[f"h.1.attn.{name}"], expected) < 1e-5


def test_residual_stream_adds_up(model, ids):
    with torch.no_grad(), inspect.capture(model, layers=[0, 1]) as acts:
        out = model(ids, output_hidden_states=True)
    assert len(acts) == 2 * len(inspect.NAMES)
    block = model.transformer.h[0]
    assert max_diff(acts["h.0.resid_mid"], acts["h.0.resid_pre"] + acts["h.0.attn.out"]) < 1e-6
    assert max_diff(acts["h.0.resid_post"], acts["h.0.resid_mid"] + acts["h.0.mlp.out"]) < 1e-6
    heads = acts["h.0.attn.weights"] @ acts["h.0.attn.v"]
    assert max_diff(acts["h.0.attn.heads"], heads) < 1e-5
    merged = heads.transpose(1, 2).reshape(2, 9, 32)
    assert max_diff(acts["h.0.attn.out"], merged @ block.attn.c_proj.weight + block.attn.c_proj.bias) < 1e-5
    pre_activation = acts["h.0.ln_2"] @ block.mlp.c_fc.weight + block.mlp.c_fc.bias
    hidden = torch.nn.functional.gelu(pre_activation, approximate="tanh")
    assert max_diff(acts["h.0.mlp.hidden"], hidden) < 1e-5
    assert torch.equal(acts["h.0.resid_pre"], out.hidden_states[0])
    assert torch.equal(acts["h.1.resid_post"], out.hidden_states[2])


@pytest.mark.parametrize("name", ["attn.weights", "attn.heads"])
def test_zeroed_head_equals_head_mask(model, ids, name):
    layer, head = 1, 2
    head_mask = torch.ones(3, 4)
    head_mask[layer, head] = 0
    with torch.no_grad():
        clean = model(ids, output_hidden_states=True)
        masked = model(ids, head_mask=head_mask, output_hidden_states=True)
        with inspect.edit(model, f"h.{layer}.{name}", inspect.zero_head(head)):
            ablated = model(ids, output_hidden_states=True)
    assert max_diff(ablated.logits, masked.logits) < 1e-5
    assert max_diff(ablated.logits, clean.logits) > 1e-2
    for i in range(layer + 1):  # embeddings and every block before the edited one: untouched
        assert torch.equal(ablated.hidden_states[i], clean.hidden_states[i])


def test_patching_a_middle_layer_at_some_positions(model, ids):
    """Activation patching as it is used: the corrupted run (other) gets the clean run's layer-1
    residual at positions 3-4 only. (Patching every position would give the clean logits at any
    layer by construction, and patching the last block changes nothing downstream but ln_f.)"""
    other = ids.flip(1)
    with torch.no_grad():
        _, clean = inspect.run_with_cache(model, ids, layers=[1], names=["resid_post"])
        _, corrupted = inspect.run_with_cache(model, other, layers=[1], names=["resid_post"])
        corrupted_logits = model(other).logits

        def restore(x):  # (B, T, C)
            x[:, 3:5] = clean["h.1.resid_post"][:, 3:5]
            return x

        with inspect.edit(model, "h.1.resid_post", restore):
            patched = model(other).logits
        # By hand: the corrupted residual with the clean positions, through block 2, ln_f and lm_head.
        resid = corrupted["h.1.resid_post"].clone()
        resid[:, 3:5] = clean["h.1.resid_post"][:, 3:5]
        by_hand = model.lm_head(model.transformer.ln_f(model.transformer.h[2](resid)[0]))
    assert max_diff(patched, by_hand) < 1e-5
    assert torch.equal(patched[:, :3], corrupted_logits[:, :3])  # causal: earlier positions untouched
    assert (patched[:, 3:] - corrupted_logits[:, 3:]).abs().amax(-1).min() > 1e-2  # every later one moved


def test_edits_and_captures_nest_and_are_removed(model, ids):
    with torch.no_grad():
        with inspect.edit(model, {"h.0.attn.weights": inspect.zero_head(0)}):
            with inspect.capture(model, layers=[0], names=["weights"]) as acts:
                model(ids)
        assert torch.all(acts["h.0.attn.weights"][:, 0] == 0)
        assert torch.all(acts["h.0.attn.weights"][:, 1:].sum(-1).sub(1).abs() < 1e-5)
    for block in model.transformer.h:
        assert block.tap is no_tap and block.attn.tap is no_tap and block.mlp.tap is no_tap
        assert not block.attn.textbook


def test_hooks_removed_after_an_exception(model, ids):
    with pytest.raises(ValueError, match="must return a tensor of shape"):
        with inspect.edit(model, "h.0.attn.q", lambda x: x[:, :1]):
            model(ids)
    assert all(block.attn.tap is no_tap for block in model.transformer.h)


def test_capture_keeps_graph_when_asked(model, ids):
    with inspect.capture(model, layers=[0], names=["resid_mid"], detach=False) as acts:
        loss = model(ids, labels=ids).loss
    (grad,) = torch.autograd.grad(loss, acts["h.0.resid_mid"])
    assert grad.shape == (2, 9, 32) and grad.abs().sum() > 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: inspect.capture(m, layers=[3]), "layer 3 is out of range"),
        (lambda m: inspect.capture(m, names=["out"]), "ambiguous"),
        (lambda m: inspect.capture(m, names=["keys"]), "unknown"),
        (lambda m: inspect.edit(m, "attn.q", lambda x: x), "h.<layer>.<name>"),
        (lambda m: inspect.edit(m, "h.0.q"), "needs fn"),
        (lambda m: inspect.capture(torch.nn.Linear(2, 2)), "not a gpt2attn"),
    ],
)
def test_bad_arguments_are_named(model, call, message):
    with pytest.raises(ValueError, match=message):
        call(model)


# gpt2attn attention (the command)

TEXT = "hello there, general kenobi"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny random model saved with a character-level tokenizer.json."""
    folder = tmp_path_factory.mktemp("attn_model")
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=len(set(TEXT)), n_positions=64)), seed=5)
    model.save_pretrained(folder)
    char_tokenizer(TEXT).save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def cli():
    from gpt2attn.cli import main

    return main


@pytest.mark.parametrize("head_args", [[], ["--head", "1"]])
def test_attention_png_is_written(cli, model_folder, tmp_path, head_args):
    out = tmp_path / "attn.png"
    assert cli(["attention", "--model", str(model_folder), TEXT, "--layer", "1", *head_args, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["attn.png"]  # no temp file left behind


def test_heatmap_rows_are_queries(cli, model_folder, tmp_path, monkeypatch):
    """The picture: row i is query token i (what it attends to, keys along the x axis), so
    nothing is drawn above the diagonal (a token sees no later token)."""
    import matplotlib.axes

    drawn = []
    real_imshow = matplotlib.axes.Axes.imshow

    def spy(ax, data, *args, **kwargs):
        drawn.append((torch.from_numpy(data.copy()), ax))
        return real_imshow(ax, data, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", spy)
    assert cli(["attention", "--model", str(model_folder), TEXT, "--layer", "1", "--out", str(tmp_path / "a.png")]) == 0
    ids = torch.tensor([[sorted(set(TEXT)).index(c) for c in TEXT]])
    model = GPT2LMHeadModel.from_pretrained(model_folder).eval()
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions[1][0]  # (nh, query, key)
    assert len(drawn) == 4
    for head, (image, ax) in enumerate(drawn):
        assert max_diff(image, expected[head]) < 1e-5
        assert image.triu(1).abs().max() == 0
        assert (ax.get_ylabel(), ax.get_xlabel()) == ("query", "key")
        assert [t.get_text() for t in ax.get_yticklabels()][:5] == ["h", "e", "l", "l", "o"]


def test_attention_json_has_tokens_and_weights(cli, model_folder, tmp_path):
    import json

    out = tmp_path / "attn.json"
    args = ["attention", "--model", str(model_folder), TEXT, "--layer", "-1", "--format", "json", "--out", str(out)]
    assert cli(args) == 0
    doc = json.loads(out.read_text())
    T = len(TEXT)
    assert doc["layer"] == 1 and doc["heads"] == [0, 1, 2, 3] and doc["tokens"] == list(TEXT)
    ids = torch.tensor([[sorted(set(TEXT)).index(c) for c in TEXT]])
    assert doc["ids"] == ids[0].tolist()
    weights = torch.tensor(doc["weights"])
    assert weights.shape == (4, T, T)
    model = GPT2LMHeadModel.from_pretrained(model_folder).eval()
    with torch.no_grad():
        expected = model(ids, output_attentions=True).attentions[1][0]
    assert max_diff(weights, expected) < 1e-5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--head", "4", "--out", "x.png"], "--head 4 is out of range"),
        (["--layer", "2", "--out", "x.png"], "--layer 2 is out of range"),
        ([], "--out FILE is needed"),
    ],
)
def test_attention_bad_arguments(cli, model_folder, capsys, args, message):
    assert cli(["attention", "--model", str(model_folder), TEXT, *args]) == 2
    assert message in capsys.readouterr().err


def test_patch_of_the_wrong_shape_is_named(model, ids):
    with pytest.raises(ValueError, match="does not fit"):
        with inspect.edit(model, "h.0.resid_pre", inspect.patch(torch.zeros(1, 9, 32))):
            model(ids)
