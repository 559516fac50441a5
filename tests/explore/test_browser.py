"""gpt2attn explore pages in headless Chromium (Debian's chromium + chromium-driver, via selenium).

Checked from the DOM after clicks, against the model's own numbers: the text and the grid (the
thumbnails grey exactly where every covered cell is masked), the head view (per checked head the
weights printed, a token highlighted when any checked head is above the threshold, the lines of a
selected query or key, every line when nothing is selected), the neuron view (q, k, q×k, q·k,
q·k/√d, the mask, the weights, for the layer, head and query clicked), the layers view (the logit
lens against inspect.capture + ln_f + lm_head), the ablation table, the decoding steps (each new
row and the next token, against generate); and that the page makes no request and logs nothing.
The sentence-pair filter: per option, the lines, the heatmap and the thumbnails show exactly the
allowed (query, key) pairs. A screenshot of each view goes to $GPT2ATTN_SCREENSHOTS (default: a pytest temporary folder).
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, inspect
from gpt2attn.cli import main
from gpt2attn.shipped import DEFAULT_MODEL_DIR
from gpt2attn.tokenizer import encode, load_tokenizer, token_labels
from tests.helpers import EXPLORE_TEXT, ablation_effects, char_model_folder, hf_gpt2_folder

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

    # model view: the text, in the page's labels; the model named in the title, the shipped one by name
    chips = browser.execute_script("return [...document.querySelectorAll('#text .chip')].map(e => e.textContent)")
    assert chips == token_labels(tok, ids)
    assert browser.find_element("id", "text").is_displayed()
    if folder == DEFAULT_MODEL_DIR:
        assert browser.title == "gpt2attn explore · gpt2attn default model (char-level Shakespeare)"
    else:
        assert browser.title == f"gpt2attn explore · {folder}"
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
    labels = token_labels(tok, full.tolist())
    for step in range(n - 1):  # the last step's query row needs the token after it in `full`
        if step:
            browser.find_element("id", "next").click()
        WebDriverWait(browser, 5).until(lambda b: len(b.find_elements("css selector", "#drow .dk")) == T + step + 1)
        # the step's query is generated token `step`; what it then predicts is greedy generation's next token
        title = browser.find_element("id", "steptitle").text
        assert f"query {labels[T + step]} (position {T + step})" in title
        assert title.endswith(f"then predicts {labels[T + step + 1]} ·"), (title, labels[T + step + 1])
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
    browser.find_element("id", "prev").click()  # back one step: the previous step's row again
    WebDriverWait(browser, 5).until(lambda b: len(b.find_elements("css selector", "#drow .dk")) == T + n - 2)

    # nothing left the page, nothing was logged
    assert browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)") == []
    requests = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    sent = [m["params"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    assert {r["request"]["url"] for r in sent if r.get("documentURL") == page.as_uri()} == {page.as_uri()}
    assert [r["request"]["url"] for r in sent if r["request"]["url"].startswith(("http", "ws", "ftp"))] == []  # any tab
    # Chromium's one "rendering" note is about this test's own getImageData readbacks; nothing else may appear
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE" or e["source"] != "rendering"] == []


# ---- every control, clicked, against the model: one char model, its pages built once ----

class Opened:
    """A page written by explore() and the model's own numbers for its text."""

    def __init__(self, folder: Path, text: str, out: Path, generate: int = 0, sentence_b_start: int | None = None):
        from gpt2attn.explore import explore

        self.model, self.tok = GPT2LMHeadModel.from_pretrained(folder).eval(), load_tokenizer(folder)
        self.ids = encode(self.tok, text)
        self.labels = token_labels(self.tok, self.ids)
        self.T, self.L, self.H = len(self.ids), self.model.config.n_layer, self.model.config.n_head
        with torch.no_grad(), inspect.capture(self.model, names=["resid_pre", "q", "k", "weights", "resid_post"]) as acts:
            self.logits = self.model(torch.tensor([self.ids])).logits[0]  # (T, V)
        self.acts = acts
        self.weights = [acts[f"h.{l}.attn.weights"][0].double() for l in range(self.L)]  # L x (nh, T, T)
        self.path = out
        explore(self.model, self.tok, text, generate=generate, sentence_b_start=sentence_b_start).save(out)

    def open(self, browser):
        browser.get_log("browser"), browser.get_log("performance")  # empty both logs
        browser.get(self.path.as_uri())
        browser.execute_async_script("window.explore.ready.then(() => arguments[0]())")
        return self


@pytest.fixture(scope="module")
def char_pages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("char-pages")
    folder = char_model_folder(tmp / "char", n_layer=3)
    return {"short": Opened(folder, EXPLORE_TEXT, tmp / "short.html", generate=3),  # 42 tokens: thumbnails 1:1
            "long": Opened(folder, EXPLORE_TEXT + " " + EXPLORE_TEXT[:17], tmp / "long.html")}  # 60: pooled to 48


def after_updates(browser):
    """Let the page finish the redraws a click started."""
    browser.execute_async_script("window.explore.idle().then(() => arguments[0]())")


def assert_nothing_left(browser, page: Path):
    assert browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)") == []
    requests = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    assert set(urls) <= {page.as_uri()}
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE" or e["source"] != "rendering"] == []


def lines_drawn(browser) -> list[tuple[int, int, str, float]]:
    """The head view's lines as (query, key, colour, opacity): x1 is the query column, x2 the keys'."""
    raw = browser.execute_script(
        "return [...document.querySelectorAll('#lines line')].map(e => ['x1', 'y1', 'x2', 'y2', 'stroke', 'stroke-opacity']"
        ".map(a => e.getAttribute(a)))")
    assert all(float(x1) < float(x2) for x1, _, x2, *_ in raw)  # every line runs from the query side to the key side
    return [(int((float(y1) - 9) // 18), int((float(y2) - 9) // 18), stroke, float(op)) for _, y1, _, y2, stroke, op in raw]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["short", "long"])
def test_model_view_shows_the_text_and_greys_exactly_the_masked_cells(name, browser, char_pages):
    page = char_pages[name].open(browser)
    T = page.T
    assert browser.execute_script("return [...document.querySelectorAll('#text .chip')].map(e => e.textContent)") == page.labels
    size, thumbs = browser.execute_script(
        "return [document.querySelector('#grid canvas').width, [...document.querySelectorAll('#grid .cell')].map(c => "
        "[+c.dataset.layer, +c.dataset.head, Array.from(c.querySelector('canvas').getContext('2d').getImageData(0, 0, "
        "c.querySelector('canvas').width, c.querySelector('canvas').height).data)])]")
    assert size == min(T, 48)
    # adaptive max pooling's cell (a, b) covers queries start(a)..end(a)-1 and keys start(b)..end(b)-1;
    # it is grey exactly when every one of them is masked (its first key lies after its last query)
    start, end = (lambda a: a * T // size), (lambda a: -(-(a + 1) * T // size))
    pooled = [torch.nn.functional.adaptive_max_pool2d(w[None], size)[0] for w in page.weights]  # L x (nh, S, S)
    assert len(thumbs) == page.L * page.H
    for l, h, pixels in thumbs:
        for a in range(size):
            for b in range(size):
                rgb = tuple(pixels[(a * size + b) * 4: (a * size + b) * 4 + 3])
                masked = start(b) > end(a) - 1
                assert (rgb == MASK) == masked, (l, h, a, b)
                if not masked:  # the page's white-to-blue colour of the cell's largest weight
                    v = round(float(pooled[l][h, a, b]) * 255) / 255
                    assert abs(rgb[0] - (255 - 215 * v)) <= 1 and abs(rgb[1] - (255 - 175 * v)) <= 1
    assert_nothing_left(browser, page.path)


@pytest.mark.slow
def test_head_view_controls_heads_threshold_and_selection_side(browser, char_pages):
    page = char_pages["short"].open(browser)
    T, layer = page.T, 1
    browser.find_elements("css selector", "#grid .cell")[layer * page.H + 0].click()  # opens layer 1, head 0
    assert browser.find_element("id", "view-head").is_displayed()
    browser.find_element("css selector", ".headbox[data-head='2']").click()  # now heads 0 and 2
    after_updates(browser)
    heads = [0, 2]
    w = page.weights[layer]  # (nh, T, T)

    def check_highlights(side, index, threshold):
        others = browser.execute_script(
            "return [...document.querySelectorAll(arguments[0] + ' .tok')].map(e => [e.classList.contains('hl'), "
            "e.querySelector('.w').textContent])", "#keys" if side == "q" else "#queries")
        seen = range(0, index + 1) if side == "q" else range(index, T)
        some = False
        for o, (hl, printed) in enumerate(others):
            if o not in seen:
                assert (hl, printed) == (False, "")
                continue
            values = [float(w[h, index, o] if side == "q" else w[h, o, index]) for h in heads]
            assert [float(x) for x in printed.split(" / ")] == pytest.approx(values, abs=HALF_DIGIT)
            if all(abs(v - threshold) > HALF_DIGIT for v in values):  # away from the rounding edge
                assert hl == any(v > threshold for v in values), (side, index, o, values)
                some |= hl and not all(v > threshold for v in values)  # lit by one head only
        return some

    # a query, clicked: its keys lit when ANY checked head is above the threshold
    query = browser.find_element("css selector", f"#queries .tok[data-i='{T - 1}']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", query)
    query.click()
    after_updates(browser)
    one_head_only = check_highlights("q", T - 1, 0.1)
    box = browser.find_element("id", "threshold")
    box.clear()
    box.send_keys("0.03")
    after_updates(browser)
    one_head_only |= check_highlights("q", T - 1, 0.03)
    assert one_head_only  # the case that tells "any" from "all" occurred
    lines = lines_drawn(browser)
    assert {(q, k) for q, k, _, _ in lines} == {(T - 1, j) for j in range(T) for h in heads if round(float(w[h, T - 1, j]) * 1000)}

    # a key, clicked: the lines start at the queries that attend to it (left column) and end at the key
    key = 5
    browser.find_element("css selector", f"#keys .tok[data-i='{key}']").click()
    after_updates(browser)
    check_highlights("k", key, 0.03)
    lines = lines_drawn(browser)
    colours = browser.execute_script("return HEAD_COLORS")
    expected = {(i, key, colours[h], round(float(w[h, i, key]) * 1000) / 1000) for h in heads for i in range(key, T)
                if round(float(w[h, i, key]) * 1000)}
    assert {(q, k, c, round(op, 3)) for q, k, c, op in lines} == expected
    assert {q for q, *_ in lines} != {key}

    # unchecking a head: only the other one's numbers and lines
    browser.find_element("css selector", ".headbox[data-head='0']").click()
    after_updates(browser)
    heads = [2]
    check_highlights("k", key, 0.03)
    assert {c for _, _, c, _ in lines_drawn(browser)} == {colours[2]}
    assert_nothing_left(browser, page.path)


@pytest.mark.slow
def test_head_view_draws_every_line_when_nothing_is_selected(browser, char_pages):
    page = char_pages["short"].open(browser)
    T, layer = page.T, 2
    browser.execute_async_script("window.explore.openHead(2, [1, 3]).then(() => arguments[0]())")
    w = page.weights[layer]
    colours = browser.execute_script("return HEAD_COLORS")
    every = {(i, j, colours[h], round(float(w[h, i, j]) * 1000) / 1000) for h in (1, 3) for i in range(T) for j in range(i + 1)
             if round(float(w[h, i, j]) * 1000)}
    drawn = lines_drawn(browser)
    assert len(drawn) == len(every) > 2 * T
    assert {(q, k, c, round(op, 3)) for q, k, c, op in drawn} == every  # weight as opacity, queries left
    token = browser.find_element("css selector", "#queries .tok[data-i='3']")
    token.click()  # a selection: only its lines
    after_updates(browser)
    assert {q for q, *_ in lines_drawn(browser)} == {3}
    token.click()  # the same token again: unselected, every line again
    after_updates(browser)
    assert len(lines_drawn(browser)) == len(every)
    ActionChains(browser).move_to_element(browser.find_element("css selector", "#keys .tok[data-i='2']")).perform()
    after_updates(browser)
    assert {k for _, k, *_ in lines_drawn(browser)} == {2}  # hovering a key: its lines only
    ActionChains(browser).move_to_element(browser.find_element("id", "threshold")).perform()
    after_updates(browser)
    assert len(lines_drawn(browser)) == len(every)  # the pointer gone: every line
    assert_nothing_left(browser, page.path)


@pytest.mark.slow
def test_neuron_view_prints_the_models_q_k_scores_mask_and_weights(browser, char_pages, screenshots):
    page = char_pages["short"].open(browser)
    T, hs = page.T, page.model.config.n_embd // page.model.config.n_head
    browser.find_element("id", "tab-neuron").click()
    assert browser.find_element("id", "view-neuron").is_displayed()
    for layer, head, query in [(1, 2, 20), (1, 3, 20), (2, 3, 7)]:  # change the head, then the layer and the query
        Select(browser.find_element("id", "nlayer")).select_by_value(str(layer))
        Select(browser.find_element("id", "nhead")).select_by_value(str(head))
        browser.find_element("css selector", f"#nquery .chip[data-i='{query}']").click()
        after_updates(browser)
        q = page.acts[f"h.{layer}.attn.q"][0, head].double()  # (T, hs)
        k = page.acts[f"h.{layer}.attn.k"][0, head].double()
        dots = k @ q[query]  # (T,): q.k for every key, the masked ones too
        # the page multiplies q and k as it stores them (each within 0.0005): this is what that can move q.k
        slack = (q[query].abs() + k.abs()).sum(-1) * 0.0005 + hs * 0.0005**2  # (T,)
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#neuron tbody tr')].map(r => [r.classList.contains('masked'), "
            "...['t', 'dot', 'score', 'mask', 'weight'].map(c => r.querySelector('td.' + c).textContent)])")
        assert len(rows) == T
        for j, (masked, label, dot, score, mask, weight) in enumerate(rows):
            assert label == f"{j} {page.labels[j]}"
            assert abs(float(dot) - dots[j]) <= HALF_DIGIT + slack[j], (layer, head, query, j)
            assert abs(float(score) - dots[j] / hs**0.5) <= HALF_DIGIT + slack[j] / hs**0.5
            assert masked == (j > query) and mask == ("−∞ masked" if j > query else "0")
            if j > query:
                assert weight == "0 (masked)"
            else:
                assert abs(float(weight) - page.weights[layer][head, query, j]) <= HALF_DIGIT
        # hover: exact q, k and q×k of one dimension
        for kind, j, d in [("q", query, 0), ("q", query, hs - 1), ("k", 3, 5), ("qk", query, 2)]:
            selector = "#qvec canvas" if kind == "q" else f"#neuron tr[data-j='{j}'] td.{kind} canvas"
            canvas = browser.find_element("css selector", selector)
            browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
            cw = int(canvas.get_attribute("data-cw"))
            ActionChains(browser).move_to_element_with_offset(canvas, d * cw + cw // 2 - canvas.size["width"] // 2 + 1, 0).perform()
            WebDriverWait(browser, 5).until(lambda b: f"dim {d}:" in b.find_element("id", "ninfo").text)
            info = browser.find_element("id", "ninfo").text
            numbers = dict(part.split(" = ") for part in info.split(": ", 1)[1].split(", "))
            assert abs(float(numbers["q"]) - q[query, d]) <= HALF_DIGIT
            if kind != "q":
                assert info.startswith(f"key {j} {page.labels[j]}, dim {d}:")
                assert abs(float(numbers["k"]) - k[j, d]) <= HALF_DIGIT
                assert abs(float(numbers["q×k"]) - q[query, d] * k[j, d]) <= HALF_DIGIT + 0.0005 * (abs(q[query, d]) + abs(k[j, d])) + 1e-6
        if (layer, head) == (1, 2):
            browser.save_screenshot(str(screenshots / "neuron-view.png"))
    assert browser.find_element("css selector", "#nquery .chip.sel").get_attribute("data-i") == "7"
    assert_nothing_left(browser, page.path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["short", "default"])
def test_layers_view_is_each_layers_residual_through_ln_f_and_lm_head(name, browser, char_pages, tmp_path, screenshots):
    if name == "default":
        page = Opened(DEFAULT_MODEL_DIR, "To be, or not to be, that is", tmp_path / "default.html").open(browser)
    else:
        page = char_pages[name].open(browser)
    model, T, L = page.model, page.T, page.L
    with torch.no_grad():  # the logit lens the way a user computes it: inspect.capture + ln_f + lm_head
        streams = [page.acts["h.0.resid_pre"]] + [page.acts[f"h.{l}.resid_post"] for l in range(L)]
        probs = torch.stack([model.lm_head(model.transformer.ln_f(x))[0] for x in streams]).softmax(-1)  # (L+1, T, V)
    assert torch.allclose(probs[-1], page.logits.softmax(-1), atol=1e-6)  # the last row is the model's prediction
    top = probs.topk(5)
    browser.find_element("id", "tab-lens").click()
    assert browser.find_element("id", "view-lens").is_displayed()
    cells = browser.execute_script(
        "return [...document.querySelectorAll('#lens td')].map(td => [+td.dataset.row, +td.dataset.i, "
        "td.firstChild.textContent, td.querySelector('.p').textContent])")
    assert len(cells) == (L + 1) * T
    row_names = browser.execute_script("return [...document.querySelectorAll('#lens tr th:first-child')].map(e => e.textContent)")
    assert row_names == ["", "embeddings", *[f"layer {l}" for l in range(L)]]
    for row, i, label, p in cells:
        p1, p2 = top.values[row, i, :2].tolist()
        assert abs(float(p) - p1) <= HALF_DIGIT
        if p1 - p2 > 1e-5:  # no tie for the top: the label is the model's
            assert label == token_labels(page.tok, [int(top.indices[row, i, 0])])[0], (row, i)
    for row, i in [(0, 0), (L, T - 1), (1, T // 2)]:  # click a cell: its top-5
        browser.find_element("css selector", f"#lens td[data-row='{row}'][data-i='{i}']").click()
        shown = [r.text.rsplit(" ", 1) for r in browser.find_elements("css selector", "#lens5 tbody tr")]
        assert [float(p) for _, p in shown] == pytest.approx(top.values[row, i].tolist(), abs=HALF_DIGIT)
        gaps = top.values[row, i, :-1] - top.values[row, i, 1:]
        expected = token_labels(page.tok, top.indices[row, i].tolist())
        assert [lab for (lab, _), e, g in zip(shown, expected, [*gaps.tolist(), 1]) if g > 1e-5] == \
            [e for e, g in zip(expected, [*gaps.tolist(), 1]) if g > 1e-5]
        where = "after the embeddings" if row == 0 else f"after layer {row - 1}"
        assert browser.find_element("id", "lensinfo").text.startswith(f"{where}, position {i} ")
    browser.save_screenshot(str(screenshots / f"{name}-layers-view.png"))
    assert_nothing_left(browser, page.path)


@pytest.mark.slow
def test_sentence_pair_filter_shows_exactly_the_chosen_query_and_key_segments(browser, tmp_path):
    split = EXPLORE_TEXT.index("\n") + 1  # sentence B: the second line
    folder = char_model_folder(tmp_path / "char", n_layer=3)
    page = Opened(folder, EXPLORE_TEXT, tmp_path / "pair.html", sentence_b_start=split).open(browser)
    T, layer, heads = page.T, 1, [0, 2]
    w = page.weights[layer]  # (nh, T, T)
    segment = lambda i: "a" if i < split else "b"  # noqa: E731
    colours, left_out = browser.execute_script("return [HEAD_COLORS, LEFT_OUT]")
    thumbs_size = browser.execute_script("return document.querySelector('#grid canvas').width")
    assert thumbs_size == T  # one thumbnail pixel per (query, key): the filter is exact there too
    assert [o.get_attribute("value") for o in Select(browser.find_element("id", "mfilter")).options] == \
        ["all", "aa", "bb", "ab", "ba"]
    browser.execute_async_script("window.explore.openHead(1, [0, 2]).then(() => arguments[0]())")

    def pixel_kind(rgb, i, j, weight):  # what the page must draw at query i, key j
        if j > i:
            return rgb == MASK
        if not allowed(i, j):
            return rgb == tuple(left_out)
        return rgb[2] == 255 and abs(rgb[0] - (255 - 215 * weight)) <= 1.5

    for n, choice in enumerate(["aa", "bb", "ab", "ba", "all"]):
        allowed = lambda i, j: choice == "all" or segment(i) + segment(j) == choice  # noqa: E731
        where = "filter" if n % 2 == 0 else "mfilter"  # either view's drop-down sets both
        browser.find_element("id", "tab-head" if where == "filter" else "tab-model").click()
        Select(browser.find_element("id", where)).select_by_value(choice)
        after_updates(browser)
        browser.find_element("id", "tab-head").click()
        assert Select(browser.find_element("id", "filter")).first_selected_option.get_attribute("value") == choice

        # nothing selected: every allowed line of both heads, and only those
        expected = {(i, j, colours[h], round(float(w[h, i, j]) * 1000) / 1000) for h in heads for i in range(T)
                    for j in range(i + 1) if allowed(i, j) and round(float(w[h, i, j]) * 1000)}
        drawn = lines_drawn(browser)
        assert len(drawn) == len(expected) and {(q, k, c, round(op, 3)) for q, k, c, op in drawn} == expected, choice
        assert (expected == set()) == (choice == "ab")  # causal: no query of A sees a key of B

        # a query of sentence B, clicked: numbers and lines for its allowed keys only
        query = browser.find_element("css selector", f"#queries .tok[data-i='{T - 1}']")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", query)
        query.click()
        after_updates(browser)
        printed = browser.execute_script("return [...document.querySelectorAll('#keys .tok .w')].map(e => e.textContent)")
        assert [j for j, text in enumerate(printed) if text] == [j for j in range(T) if allowed(T - 1, j)]
        assert {(q, k) for q, k, *_ in lines_drawn(browser)} == \
            {(T - 1, j) for j in range(T) for h in heads if allowed(T - 1, j) and round(float(w[h, T - 1, j]) * 1000)}
        query.click()  # unselected again
        after_updates(browser)

        # the first head's heatmap: masked, left out, or the weight's colour, cell by cell
        cell, pixels = browser.execute_script(
            "const c = document.getElementById('heatmap'); const n = +c.dataset.cell;"
            "return [n, Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)]")
        for i in range(T):
            for j in range(T):
                at = ((i * cell + cell // 2) * T * cell + j * cell + cell // 2) * 4
                assert pixel_kind(tuple(pixels[at: at + 3]), i, j, float(w[0, i, j])), (choice, i, j)

        # the model view: every thumbnail the same way (one pixel per pair, the weight to 1/255)
        browser.find_element("id", "tab-model").click()
        assert Select(browser.find_element("id", "mfilter")).first_selected_option.get_attribute("value") == choice
        thumbs = browser.execute_script(
            "return [...document.querySelectorAll('#grid .cell')].map(c => [+c.dataset.layer, +c.dataset.head, "
            "Array.from(c.querySelector('canvas').getContext('2d').getImageData(0, 0, arguments[0], arguments[0]).data)])", T)
        for l, h, px in thumbs:
            for i in range(T):
                for j in range(T):
                    weight = round(float(page.weights[l][h, i, j]) * 255) / 255
                    assert pixel_kind(tuple(px[(i * T + j) * 4: (i * T + j) * 4 + 3]), i, j, weight), (choice, l, h, i, j)
    assert_nothing_left(browser, page.path)


@pytest.mark.slow
def test_no_sentence_pair_filter_without_a_split(browser, char_pages):
    char_pages["short"].open(browser)
    assert not browser.find_element("id", "mfilter").is_displayed()
    browser.find_element("id", "tab-head").click()
    assert not browser.find_element("id", "filter").is_displayed()
