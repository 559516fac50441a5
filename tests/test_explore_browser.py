"""gpt2attn explore pages in headless Chromium (Debian's chromium + chromium-driver, via selenium).

Checked from the DOM and the page's own data against the model: the grid, the keys a head view
highlights, the numbers printed, the causal mask in the pictures, the ablation table, the decoding
steps; and that the page makes no request and logs nothing. A screenshot of each view goes to
$GPT2ATTN_SCREENSHOTS (default: a pytest temporary folder).
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cli import main
from gpt2attn.generation import DEFAULT_MODEL_DIR
from gpt2attn.tokenizer import encode, load_tokenizer, token_labels
from helpers import EXPLORE_TEXT, ablation_effects, char_model_folder, hf_gpt2_folder

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium (pip install selenium)")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

HALF_DIGIT = 0.0005 + 1e-6  # a number printed to 3 digits is within this of the true one
MASK = (200, 200, 200)  # the page's colour for masked (causal) cells
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic", "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium / chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="gpt2attn-chromium-")
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    chrome = webdriver.Chrome(service=webdriver.ChromeService(driver), options=options)
    yield chrome
    chrome.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    folder = Path(os.environ.get("GPT2ATTN_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


PAGES = {  # name: (model folder maker, text, --generate)
    "char": (lambda tmp: char_model_folder(tmp / "char", n_layer=3), EXPLORE_TEXT, 5),
    "default": (lambda tmp: DEFAULT_MODEL_DIR, "To be, or not to be, that is", 4),
    "gpt2-folder": (lambda tmp: hf_gpt2_folder(tmp / "hf"), "Hello world,\nhello attention", 3),
}


@pytest.mark.slow  # a browser: seconds per page
@pytest.mark.parametrize("name", PAGES)
def test_page_in_chromium(name, browser, screenshots, tmp_path):
    make_folder, text, n = PAGES[name]
    folder = make_folder(tmp_path)
    page = tmp_path / "page.html"
    assert main(["explore", text, "--model", str(folder), "--generate", str(n), "--out", str(page)]) == 0
    model, tok = GPT2LMHeadModel.from_pretrained(folder).eval(), load_tokenizer(folder)
    ids = encode(tok, text)
    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions  # L x (1, nh, T, T)
    L, H, T = model.config.n_layer, model.config.n_head, len(ids)

    browser.get_log("browser"), browser.get_log("performance")  # empty both logs
    browser.get(page.as_uri())
    browser.execute_async_script("window.explore.ready.then(() => arguments[0]())")

    # model view: n_layer x n_head thumbnails
    cells = browser.find_elements("css selector", "#grid .cell")
    assert len(cells) == L * H
    assert {(int(c.get_attribute("data-layer")), int(c.get_attribute("data-head"))) for c in cells} == \
        {(l, h) for l in range(L) for h in range(H)}
    browser.save_screenshot(str(screenshots / f"{name}-model-view.png"))

    # head view: clicking a thumbnail opens that head; hover / click tokens
    layer, head = L - 1, 1
    cells[layer * H + head].click()
    threshold = float(browser.find_element("id", "threshold").get_attribute("value"))
    w = attentions[layer][0, head].double()  # (T, T)
    highlighted_some = False
    for side, index, act in [("q", T - 1, "hover"), ("k", 0, "hover"), ("q", T // 2, "click"), ("k", 1, "click")]:
        token = browser.find_element("css selector", f"#{'queries' if side == 'q' else 'keys'} .tok[data-i='{index}']")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", token)
        if act == "hover":
            ActionChains(browser).move_to_element(token).perform()
        else:
            token.click()
        WebDriverWait(browser, 5).until(lambda b: "sel" in token.get_attribute("class"), f"{side} {index} {act}")
        others = browser.execute_script(
            "return [...document.querySelectorAll(arguments[0] + ' .tok')].map("
            "e => [e.classList.contains('hl'), e.querySelector('.w').textContent])",
            "#keys" if side == "q" else "#queries")
        expected = w[index] if side == "q" else w[:, index]  # what the query attends to / what attends to the key
        seen = range(0, index + 1) if side == "q" else range(index, T)  # causal: only these may be non-empty
        for o, (hl, printed) in enumerate(others):
            if o not in seen:
                assert printed == "" and not hl
                continue
            assert abs(float(printed) - expected[o]) <= HALF_DIGIT
            if abs(expected[o] - threshold) > HALF_DIGIT:  # away from the rounding edge: the model decides
                assert hl == bool(expected[o] > threshold), (side, index, o)
            highlighted_some |= hl
        if index == T // 2:
            browser.save_screenshot(str(screenshots / f"{name}-head-view.png"))
    assert highlighted_some
    # a new threshold re-highlights the clicked key's queries (key 1, clicked last)
    box = browser.find_element("id", "threshold")
    box.clear()
    box.send_keys("0.05")
    browser.execute_async_script("setTimeout(arguments[0], 0)")  # after the page's update (promises already resolved)
    hl = browser.execute_script("return [...document.querySelectorAll('#queries .tok.hl')].map(e => +e.dataset.i)")
    edge = {i for i in range(T) if abs(w[i, 1] - 0.05) <= HALF_DIGIT}
    assert set(hl) - edge == {i for i in range(1, T) if w[i, 1] > 0.05} - edge != set()

    # the large pattern: every masked cell is above the diagonal, and nothing else is masked
    cell, pixels = browser.execute_script(
        "const c = document.getElementById('heatmap'); const n = +c.dataset.cell;"
        "return [n, Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)]")
    width = T * cell
    for i in range(T):
        for j in range(T):
            at = ((i * cell + cell // 2) * width + j * cell + cell // 2) * 4
            assert (tuple(pixels[at: at + 3]) == MASK) == (j > i), (i, j)

    # prediction view: top-5 and the ablation table against one inspect.edit forward per head
    browser.find_element("id", "tab-pred").click()
    probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    p, top = probs.topk(5)
    rows = [r.text.split() for r in browser.find_elements("css selector", "#top5 tbody tr")]
    assert [r[0] for r in rows] == token_labels(tok, top.tolist())
    assert all(abs(float(r[1]) - q) <= HALF_DIGIT for r, q in zip(rows, p.tolist()))
    effects = ablation_effects(model, ids, T - 1)
    for td in browser.find_elements("css selector", "#effects td"):
        l, h = int(td.get_attribute("data-layer")), int(td.get_attribute("data-head"))
        assert abs(float(td.text) - effects[l, h]) <= HALF_DIGIT + 1e-4
    browser.save_screenshot(str(screenshots / f"{name}-prediction-view.png"))

    # decoding view: each step's new query row over the cache, and the lower-right mask
    browser.find_element("id", "tab-decode").click()
    Select(browser.find_element("id", "dlayer")).select_by_value(str(layer))
    Select(browser.find_element("id", "dhead")).select_by_value(str(head))
    full = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0]
    with torch.no_grad():
        full_attn = model(full[None, :-1], output_attentions=True).attentions[layer][0, head].double()
    for step in range(n - 1):  # the last step's query row needs the token after it in `full`
        if step:
            browser.find_element("id", "next").click()
        WebDriverWait(browser, 5).until(lambda b: len(b.find_elements("css selector", "#drow .dk")) == T + step + 1)
        printed = [float(e.text.split()[-1]) for e in browser.find_elements("css selector", "#drow .dk .w")]
        assert max(abs(a - b) for a, b in zip(printed, full_attn[T + step, : T + step + 1].tolist())) <= HALF_DIGIT
        rows_, cols, cell, pixels = browser.execute_script(
            "const c = document.getElementById('dcanvas'); const d = c.dataset;"
            "return [+d.rows, +d.cols, +d.cell, Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)]")
        assert (rows_, cols) == (step + 1, T + step + 1)
        for r in range(rows_):
            for j in range(cols):
                at = ((r * cell + cell // 2) * cols * cell + j * cell + cell // 2) * 4
                assert (tuple(pixels[at: at + 3]) == MASK) == (j > T + r), (step, r, j)  # from the lower-right
    browser.save_screenshot(str(screenshots / f"{name}-decoding-view.png"))

    # nothing left the page, nothing was logged
    assert browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)") == []
    requests = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    sent = [m["params"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    assert {r["request"]["url"] for r in sent if r.get("documentURL") == page.as_uri()} == {page.as_uri()}
    assert [r["request"]["url"] for r in sent if r["request"]["url"].startswith(("http", "ws", "ftp"))] == []  # any tab
    # Chromium's one "rendering" note is about this test's own getImageData readbacks; nothing else may appear
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE" or e["source"] != "rendering"] == []
