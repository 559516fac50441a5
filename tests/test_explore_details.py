"""Details of the explorer's Python side that a full mutation run (docs/mutation.md) found
untested: the page's title, explore()'s default of no decoding steps, the logit lens on prompts
shorter than its top-k, and pack()'s limits for signed values (each value decoded back here)."""

from __future__ import annotations

import base64
import json
import re
import zlib

import numpy as np
import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn.explore import SCALE, TOP_K, explore, pack, page_data
from gpt2attn.tokenizer import encode, load_tokenizer
from tests.helpers import EXPLORE_TEXT, char_model_folder
from tests.test_explore_data import embedded_data


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    folder = char_model_folder(tmp_path_factory.mktemp("char"), n_layer=2)
    return GPT2LMHeadModel.from_pretrained(folder).eval(), load_tokenizer(folder)


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


def unpack_signed(blob: str, n: int) -> np.ndarray:
    """pack(signed=True) undone: base64, zlib, byte planes (low bytes first), zigzag."""
    planes = np.frombuffer(zlib.decompress(base64.b64decode(blob)), dtype=np.uint8).reshape(4, n)
    z = planes.T.copy().view("<u4").ravel().astype(np.int64)
    return (z >> 1) ^ -(z & 1)


def test_pack_signed_values_up_to_its_limit_and_refuses_beyond():
    largest = (2**31 - 1) / SCALE
    values = torch.tensor([0.0, -0.001, 0.001, largest, -largest, 12.345], dtype=torch.float64)
    got = unpack_signed(pack(values, signed=True), len(values))
    assert got.tolist() == [round(v * SCALE) for v in values.tolist()]
    for too_large in (2**31 / SCALE, -(2**31) / SCALE, 1.5 * 2**31 / SCALE, 2**32 / SCALE):
        with pytest.raises(ValueError, match="too large to store at 1/1000"):
            pack(torch.tensor([1.0, too_large], dtype=torch.float64), signed=True)
    assert unpack_signed(pack(torch.zeros(0), signed=True), 0).size == 0  # nothing to pack is no error
