"""gpt2attn explore without a browser (gpt2attn/explore): the page's data against the model, labels,
bad input; then (sections below) what the page is given, checked in Python against the model, and
the page's title, decoding steps, logit lens and pack()'s limits. (tests/explore/test_browser.py
opens the pages in Chromium.)"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from gpt2attn import GPT2LMHeadModel, inspect
from gpt2attn.cli import main
from gpt2attn.explore import SCALE, TEMPLATE, TOP_K, explore, pack, page_data
from gpt2attn.tokenizer import encode, load_tokenizer, token_labels
from tests.helpers import (EXPLORE_TEXT, ablation_effects, char_model_folder, hf_gpt2_folder, lower_triangle_rows,
                           shared_data, unpack_weights)

HALF_DIGIT = 0.0005 + 1e-6  # a weight printed to 3 digits is within this of the true one


@pytest.fixture(scope="module")
def char_folder(tmp_path_factory):
    return char_model_folder(tmp_path_factory.mktemp("char"), n_layer=3)


@pytest.fixture(scope="module")
def char_model(char_folder):
    return GPT2LMHeadModel.from_pretrained(char_folder).eval(), load_tokenizer(char_folder)


def test_weights_on_the_page_are_the_models_to_3_digits(char_model):
    model, tok = char_model
    data = page_data(model, tok, EXPLORE_TEXT)
    ids = encode(tok, EXPLORE_TEXT)
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    T = len(ids)
    for layer, heads in enumerate(data["attn"]):
        for head, blob in enumerate(heads):
            rows = lower_triangle_rows(unpack_weights(blob, data["scale"]), T)
            expected = attentions[layer][0, head].double()  # (T, T)
            for i, row in enumerate(rows):
                assert (row - expected[i, : i + 1]).abs().max() <= HALF_DIGIT
                assert expected[i, i + 1:].abs().sum() == 0  # the causal part is all there is


def test_ablation_table_equals_zeroing_each_head_with_inspect_edit(char_model):
    model, tok = char_model
    ids = encode(tok, EXPLORE_TEXT)
    for position in (-1, 7):
        data = page_data(model, tok, EXPLORE_TEXT, position=position)
        expected = ablation_effects(model, ids, position)
        assert data["position"] == position % len(ids)
        assert torch.tensor(data["effects"]).sub(expected).abs().max() < 1e-4
        assert expected.abs().max() > 1e-2  # the heads matter in this model: the comparison has teeth


def test_ablating_chosen_layers_leaves_the_others_empty_and_reports_each_layers_cost(char_model):
    model, tok = char_model
    ids = encode(tok, EXPLORE_TEXT)
    L = model.config.n_layer
    done = []
    data = page_data(model, tok, EXPLORE_TEXT, ablate=[2, 1, 2], progress=done.append)
    expected = ablation_effects(model, ids, len(ids) - 1)
    assert data["effects"][0] is None
    assert torch.tensor(data["effects"][1:]).sub(expected[1:]).abs().max() < 1e-4
    assert done == [0, L - 1, L - 2]  # started; a layer's ablations run its block and every later one
    assert page_data(model, tok, EXPLORE_TEXT, ablate=[])["effects"] == [None] * L
    with pytest.raises(ValueError, match=rf"ablate: this model's layers are 0 to {L - 1}, got \[0, {L}\]"):
        page_data(model, tok, EXPLORE_TEXT, ablate=[0, L])


def test_the_command_prints_the_ablations_cost_and_takes_layer_ranges(char_folder, tmp_path, capsys):
    from gpt2attn.commands.explore import layer_list

    assert layer_list("all") is None and layer_list("none") == []
    assert layer_list("0-2,5, 7") == [0, 1, 2, 5, 7]
    out = tmp_path / "page.html"
    assert main(["explore", EXPLORE_TEXT, "--model", str(char_folder), "--out", str(out), "--ablate", "1-2"]) == 0
    L, nh = 3, 4  # char_folder's model
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"head ablations: 2 of {L} layers x {nh} heads, {(L - 1) + (L - 2)} block passes "
                      f"(a forward pass is {L}); --ablate LAYERS or none for fewer")
    assert [row is None for row in page_json(out)["effects"]] == [True, False, False]
    for bad, message in (("1-x", "--ablate 1-x: give all, none, or layers and ranges such as 0-5,10"),
                         ("0,3", f"--ablate 0,3: this model's layers are 0 to {L - 1}")):
        assert main(["explore", "To be", "--model", str(char_folder), "--out", str(out), "--ablate", bad]) == 2
        assert capsys.readouterr().err == f"gpt2attn explore: error: {message}\n"


def test_top5_is_the_models_next_token_distribution(char_model):
    model, tok = char_model
    data = page_data(model, tok, EXPLORE_TEXT)
    ids = encode(tok, EXPLORE_TEXT)
    probs = model(torch.tensor([ids])).logits[0].softmax(-1)
    for i, top in enumerate(data["top"]):
        p, idx = probs[i].topk(5)
        assert [label for label, _ in top] == token_labels(tok, idx.tolist())
        assert torch.tensor([q for _, q in top]).sub(p).abs().max() < 1e-4


def test_decoding_steps_are_greedy_generation_and_its_attention_rows(char_model):
    model, tok = char_model
    ids = encode(tok, EXPLORE_TEXT[:20])
    n = 6
    steps = page_data(model, tok, EXPLORE_TEXT[:20], generate=n)["steps"]
    full = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0]
    assert steps["tokens"] == token_labels(tok, full[len(ids):].tolist())
    with torch.no_grad():  # one forward over prompt + generated: its last n rows are the steps' query rows
        attentions = model(full[None, :-1], output_attentions=True).attentions
    P0 = len(ids)
    for layer in range(model.config.n_layer):
        for head in range(model.config.n_head):
            packed = unpack_weights(steps["attn"][layer][head], 1000)
            lengths = [P0 + s + 1 for s in range(n - 1)]  # the last step's row needs the token after it
            rows = torch.split(packed[: sum(lengths)], lengths)
            for s, row in enumerate(rows):
                expected = attentions[layer][0, head, P0 + s].double()
                assert (row - expected[: P0 + s + 1]).abs().max() <= HALF_DIGIT


def test_labels_show_gpt2_spaces_and_newlines():
    tok = load_tokenizer(shared_data("gpt2-tokenizer"))
    labels = token_labels(tok, encode(tok, "Hello world\n\tok"))
    assert tok.id_to_token(encode(tok, " world")[0]) == "Ġworld"
    assert labels == ["Hello", "␣world", "↵", "⇥", "ok"]
    llama = encode(tok, " 🦙")  # 4 bytes in 3 tokens: pieces of a character show as their bytes
    assert "".join(token_labels(tok, llama)) == "␣" + "".join(f"\\x{b:02x}" for b in "🦙".encode())


def test_labels_of_a_char_model(char_model):
    _, tok = char_model
    assert token_labels(tok, encode(tok, "to be\n")) == ["t", "o", "␣", "b", "e", "↵"]


def test_inspect_explore_gives_the_page_and_a_notebook_view(char_model):
    model, tok = char_model
    page = inspect.explore(model, tok, "To be")
    html = str(page)
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', html, re.S)[1])
    assert data["tokens"] == ["T", "o", "␣", "b", "e"]
    assert page._repr_html_().startswith("<iframe srcdoc=")
    assert not re.search(r"""(src|href)\s*=|https?://|@import|url\(""", html.replace("http://www.w3.org/2000/svg", ""))


def test_import_gpt2attn_inspect_needs_no_transformers():
    code = "import sys, gpt2attn.inspect; print(sorted(m for m in sys.modules if m.startswith(('transformers', 'peft'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_writes_the_page_for_a_transformers_gpt2_folder(tmp_path):
    import transformers

    folder = hf_gpt2_folder(tmp_path / "hf")
    out = tmp_path / "page.html"
    assert main(["explore", "Hello world, hello", "--model", str(folder), "--out", str(out), "--generate", "2"]) == 0
    html = out.read_text()
    data = json.loads(re.search(r'id="data">(.*?)</script>', html, re.S)[1].replace("<\\/", "</"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = data["ids"]
    with torch.no_grad():
        attentions = hf(torch.tensor([ids]), output_attentions=True).attentions
    assert data["tokens"][:2] == ["Hello", "␣world"]
    for layer in range(2):
        for head in range(4):
            rows = lower_triangle_rows(unpack_weights(data["attn"][layer][head], 1000), len(ids))
            for i, row in enumerate(rows):
                assert (row - attentions[layer][0, head, i, : i + 1].double()).abs().max() <= HALF_DIGIT


@pytest.mark.parametrize("case, message", [
    ("empty", "the text is empty"),
    ("too long", "this model's context is 64"),
    ("unknown characters", "does not hold: 'Z'"),
    ("no tokenizer", "no tokenizer in"),
    ("bad position", "position 99 is out of range"),
])
def test_bad_input_is_one_line_and_no_page(char_folder, tmp_path, capsys, case, message):
    folder, text, extra = char_folder, EXPLORE_TEXT, []
    if case == "empty":
        text = ""
    elif case == "too long":
        text = EXPLORE_TEXT * 3
    elif case == "unknown characters":
        text = "To Zee"
    elif case == "no tokenizer":
        folder = tmp_path / "bare"
        GPT2LMHeadModel.from_pretrained(char_folder).save_pretrained(folder)
    else:
        extra = ["--position", "99"]
    out = tmp_path / "page.html"
    out.write_text("the old page")
    assert main(["explore", text, "--model", str(folder), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpt2attn explore: error: ") and message in err
    assert out.read_text() == "the old page"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["page.html"]


def unpack_signed(blob: str, scale: int) -> torch.Tensor:
    """The page's q and k back as floats: byte planes of zigzag-coded uint32 (0, -1, 1, ... -> 0, 1, 2, ...)."""
    import base64
    import zlib

    raw = torch.frombuffer(bytearray(zlib.decompress(base64.b64decode(blob))), dtype=torch.uint8).long()
    planes = raw.view(4, -1)
    u = planes[0] + (planes[1] << 8) + (planes[2] << 16) + (planes[3] << 24)
    return torch.where(u % 2 == 1, -(u + 1) // 2, u // 2).double() / scale


def test_q_and_k_on_the_page_are_inspect_captures_to_3_digits(char_model):
    model, tok = char_model
    data = page_data(model, tok, EXPLORE_TEXT)
    ids = encode(tok, EXPLORE_TEXT)
    with torch.no_grad(), inspect.capture(model, names=["q", "k"]) as acts:  # the page's forward: eager attention
        model(torch.tensor([ids]), output_attentions=True)
    hs = data["head_size"]
    assert hs == model.config.n_embd // model.config.n_head
    assert data["score_scale"] == [hs**-0.5] * model.config.n_layer
    for name in ("q", "k"):
        for layer in range(model.config.n_layer):
            for head in range(model.config.n_head):
                stored = unpack_signed(data[name][layer][head], data["scale"]).view(len(ids), hs)
                expected = acts[f"h.{layer}.attn.{name}"][0, head].double()
                assert (stored - expected).abs().max() <= HALF_DIGIT
                assert (expected < -0.01).any() and (expected > 0.01).any()  # both signs round-trip


def test_logit_lens_is_each_layers_residual_through_ln_f_and_lm_head(char_model):
    model, tok = char_model
    lens = page_data(model, tok, EXPLORE_TEXT)["lens"]
    ids = encode(tok, EXPLORE_TEXT)
    L, T, K = model.config.n_layer, len(ids), lens["k"]
    with torch.no_grad(), inspect.capture(model, names=["resid_pre", "resid_post"]) as acts:
        model(torch.tensor([ids]))
        streams = [acts["h.0.resid_pre"]] + [acts[f"h.{l}.resid_post"] for l in range(L)]
        probs = torch.stack([model.lm_head(model.transformer.ln_f(x))[0] for x in streams]).softmax(-1)  # (L+1, T, V)
    top = probs.topk(K)
    stored_p = torch.tensor(lens["p"]).view(L + 1, T, K).double() / 1000
    assert (stored_p - top.values).abs().max() <= HALF_DIGIT
    stored_ids = torch.tensor(lens["ids"]).view(L + 1, T, K)
    clear = top.values[..., :-1] - top.values[..., 1:] > 1e-5  # no tie between rank r and r+1
    assert (stored_ids[..., :-1] == top.indices[..., :-1])[clear].all()
    assert {int(i): label for i, label in lens["labels"].items()} == dict(
        zip(sorted(set(lens["ids"])), token_labels(tok, sorted(set(lens["ids"])))))


def test_the_page_title_names_the_model(char_folder, tmp_path):
    from gpt2attn.commands.explore import page_name
    from gpt2attn.shipped import DEFAULT_MODEL_DIR

    assert page_name(str(DEFAULT_MODEL_DIR)) == "gpt2attn default model (char-level Shakespeare)"
    assert page_name(str(char_folder)) == str(char_folder)
    out = tmp_path / "page.html"
    assert main(["explore", "To be", "--model", str(DEFAULT_MODEL_DIR), "--out", str(out)]) == 0
    title = re.search(r"<title>(.*?)</title>", out.read_text())[1]
    assert title == "gpt2attn explore · gpt2attn default model (char-level Shakespeare)"


def page_json(path) -> dict:
    return json.loads(re.search(r'id="data">(.*?)</script>', path.read_text(), re.S)[1].replace("<\\/", "</"))


def test_sentence_b_start_is_stored_and_bad_values_name_it(char_model):
    model, tok = char_model
    T = len(encode(tok, EXPLORE_TEXT))
    assert page_data(model, tok, EXPLORE_TEXT)["sentence_b_start"] is None
    assert page_data(model, tok, EXPLORE_TEXT, sentence_b_start=T - 1)["sentence_b_start"] == T - 1
    for bad in (0, T, -1, 2.0, True, "3"):  # both segments need a token; a token index, not a float or a bool
        with pytest.raises(ValueError, match=f"sentence_b_start must be a token index from 1 to {T - 1}.*got {bad!r}"):
            page_data(model, tok, EXPLORE_TEXT, sentence_b_start=bad)


def test_cli_text_b_appends_a_segment_and_sets_the_split(char_folder, tmp_path, capsys):
    tok = load_tokenizer(char_folder)
    first, second = "To be, or not to be:", "\nthat is the question."
    out = tmp_path / "page.html"
    assert main(["explore", first, "--text-b", second, "--model", str(char_folder), "--out", str(out)]) == 0
    data = page_json(out)
    assert data["ids"] == encode(tok, first + second) and data["sentence_b_start"] == len(encode(tok, first))
    assert main(["explore", EXPLORE_TEXT, "--sentence-b-start", "5", "--model", str(char_folder), "--out", str(out)]) == 0
    assert page_json(out)["sentence_b_start"] == 5
    capsys.readouterr()
    for extra, message in [(["--sentence-b-start", "42"], "sentence_b_start must be a token index from 1 to 41"),
                           (["--text-b", ""], "--text-b is empty")]:
        assert main(["explore", EXPLORE_TEXT, "--model", str(char_folder), "--out", str(tmp_path / "no.html"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gpt2attn explore: error: ") and message in err
    assert not (tmp_path / "no.html").exists()


def test_cli_text_b_must_not_merge_with_the_texts_last_token():
    from gpt2attn.commands.explore import sentence_pair

    tok = load_tokenizer(shared_data("gpt2-tokenizer"))
    assert sentence_pair(tok, "The cat sat.", " The dog ran.") == ("The cat sat. The dog ran.", 4)
    assert encode(tok, "Helloworld")[:1] != encode(tok, "Hello")  # GPT-2's BPE joins these two
    with pytest.raises(ValueError, match="--text-b 'world': its first token merges"):
        sentence_pair(tok, "Hello", "world")


# ==================================================================================================
# What the page is given
#
# What the explorer page is given, checked in Python against the model: the thumbnails are each
# head's attention max-pooled and scaled to 0..255; explore() embeds exactly page_data's values (plus
# the model's name), escapes "</" so the data cannot close its <script>, and takes a transformers
# fast tokenizer as it takes a tokenizers.Tokenizer. (The page's drawing is tests/explore/test_browser.py.)
# ==================================================================================================


def attentions(model, ids) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    return torch.stack(out.attentions)[:, 0].double().numpy()  # (L, nh, T, T)


def max_pool(w: np.ndarray, size: int) -> np.ndarray:
    """Adaptive max pooling written out: cell i covers rows floor(i*T/S) .. ceil((i+1)*T/S) - 1."""
    T = w.shape[-1]
    edges = [(math.floor(i * T / size), math.ceil((i + 1) * T / size)) for i in range(size)]
    return np.array([[w[..., a:b, c:d].max(axis=(-1, -2)) for c, d in edges] for a, b in edges]).transpose(2, 3, 0, 1)


@pytest.mark.parametrize("text", [EXPLORE_TEXT, (EXPLORE_TEXT * 2)[:60]], ids=["T<48", "T=60>48"])
def test_thumbnails_are_each_heads_attention_max_pooled_to_0_255(char_model, text):
    model, tok = char_model
    ids = encode(tok, text)
    thumbs = page_data(model, tok, text)["thumbs"]
    size = min(len(ids), 48)
    assert thumbs["size"] == size
    cells = np.frombuffer(zlib.decompress(base64.b64decode(thumbs["data"])), dtype=np.uint8)
    L, nh = model.config.n_layer, model.config.n_head
    cells = cells.reshape(L, nh, size, size).astype(np.int64)
    expected = np.round(max_pool(attentions(model, ids), size) * 255)
    assert np.abs(cells - expected).max() <= 1  # float32 vs float64 rounding at .5
    assert cells.max() == 255  # the first query's weight on itself is 1
    if size == len(ids):  # cell per weight: the masked upper triangle is 0
        assert (cells[..., np.triu_indices(size, 1)[0], np.triu_indices(size, 1)[1]] == 0).all()


def embedded_data(page_html: str) -> str:
    """The JSON the page carries: the page is the template with its title named and /*DATA*/ filled."""
    before, after = TEMPLATE.read_text(encoding="utf-8").split("/*DATA*/")
    page_html = re.sub(r"<title>[^<]*</title>", "<title>gpt2attn explore</title>", page_html, count=1)
    assert page_html.startswith(before) and page_html.endswith(after)
    return page_html[len(before) : len(page_html) - len(after)]


def test_explore_embeds_page_data_the_name_and_escapes_script_ends(char_model):
    model, tok = char_model
    name = "tiny </script><b>model"
    page = explore(model, tok, EXPLORE_TEXT, position=5, generate=3, name=name)
    blob = embedded_data(str(page))
    assert "</" not in blob
    data = json.loads(blob)
    expected = json.loads(json.dumps(page_data(model, tok, EXPLORE_TEXT, position=5, generate=3)))
    assert data.pop("model") == name
    assert data == expected
    assert len(data["steps"]["tokens"]) == 3  # generate=3 reaches page_data
    assert json.loads(embedded_data(explore(model, tok, EXPLORE_TEXT).html))["model"] == ""


def test_explore_takes_a_transformers_fast_tokenizer(char_model):
    transformers = pytest.importorskip("transformers")
    model, tok = char_model
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    assert str(explore(model, fast, EXPLORE_TEXT, generate=2)) == str(explore(model, tok, EXPLORE_TEXT, generate=2))


def test_page_saves_shows_in_a_notebook_and_says_its_size(char_model, tmp_path):
    model, tok = char_model
    page = explore(model, tok, EXPLORE_TEXT)
    page.save(tmp_path / "page.html")
    assert (tmp_path / "page.html").read_text(encoding="utf-8") == page.html
    frame = page._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and html.unescape(frame.split('"')[1]) == page.html
    assert repr(page) == f"<gpt2attn explore page, {len(page.html) / 1e6:.1f} MB of HTML>"


# ==================================================================================================
# The page's title, the decoding steps, the logit lens, pack()'s limits
#
# Details of the explorer's Python side that a full mutation run (docs/mutation.md) found
# untested: the page's title, explore()'s default of no decoding steps, the logit lens on prompts
# shorter than its top-k, and pack()'s limits for signed values (each value decoded back here).
# ==================================================================================================


def title(page) -> str:
    return re.search(r"<title>([^<]*)</title>", page.html).group(1)


def test_the_title_names_the_model_only_when_given(char_model):
    model, tok = char_model
    assert title(explore(model, tok, EXPLORE_TEXT)) == "gpt2attn explore"
    assert title(explore(model, tok, EXPLORE_TEXT, name="tiny <b>")) == "gpt2attn explore · tiny &lt;b&gt;"


def test_explore_decodes_nothing_unless_asked(char_model):
    model, tok = char_model
    assert json.loads(embedded_data(explore(model, tok, EXPLORE_TEXT).html))["steps"] is None


def test_the_logit_lens_keeps_top_k_even_for_a_prompt_shorter_than_k(char_model):
    model, tok = char_model
    text = "To"  # 2 positions < TOP_K = 5 < the vocabulary
    T = len(encode(tok, text))
    assert T < TOP_K
    lens = page_data(model, tok, text)["lens"]
    L = model.config.n_layer
    assert lens["k"] == TOP_K and len(lens["ids"]) == (L + 1) * T * TOP_K
    with torch.no_grad():
        final = model(torch.tensor([encode(tok, text)])).logits[0].softmax(-1)  # (T, V)
    expected = final.topk(TOP_K).indices.flatten().tolist()  # the last row: the model's own top 5
    assert lens["ids"][-T * TOP_K :] == expected


def unpack_signed_ints(blob: str, n: int) -> np.ndarray:
    """pack(signed=True) undone: base64, zlib, byte planes (low bytes first), zigzag."""
    planes = np.frombuffer(zlib.decompress(base64.b64decode(blob)), dtype=np.uint8).reshape(4, n)
    z = planes.T.copy().view("<u4").ravel().astype(np.int64)
    return (z >> 1) ^ -(z & 1)


def test_pack_signed_values_up_to_its_limit_and_refuses_beyond():
    largest = (2**31 - 1) / SCALE
    values = torch.tensor([0.0, -0.001, 0.001, largest, -largest, 12.345], dtype=torch.float64)
    got = unpack_signed_ints(pack(values, signed=True), len(values))
    assert got.tolist() == [round(v * SCALE) for v in values.tolist()]
    for too_large in (2**31 / SCALE, -(2**31) / SCALE, 1.5 * 2**31 / SCALE, 2**32 / SCALE):
        with pytest.raises(ValueError, match="too large to store at 1/1000"):
            pack(torch.tensor([1.0, too_large], dtype=torch.float64), signed=True)
    assert unpack_signed_ints(pack(torch.zeros(0), signed=True), 0).size == 0  # nothing to pack is no error
