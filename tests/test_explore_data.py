"""What the explorer page is given, checked in Python against the model: the thumbnails are each
head's attention max-pooled and scaled to 0..255; explore() embeds exactly page_data's values (plus
the model's name), escapes "</" so the data cannot close its <script>, and takes a transformers
fast tokenizer as it takes a tokenizers.Tokenizer. (The page's drawing is tests/test_explore_browser.py.)"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import zlib

import numpy as np
import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn.explore import TEMPLATE, explore, page_data
from gpt2attn.tokenizer import encode, load_tokenizer
from tests.helpers import EXPLORE_TEXT, char_model_folder


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    folder = char_model_folder(tmp_path_factory.mktemp("char"), n_layer=2)
    return GPT2LMHeadModel.from_pretrained(folder).eval(), load_tokenizer(folder)


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
