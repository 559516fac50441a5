"""`gpt2attn explore` pages for gpt2-small: size, build time against forward passes, views in Chromium.

    python scripts/bench.py explore [--tokens 256 1024] [--threads 2] [--repeats 3] [--bertviz]

gpt2-small shapes (12 layers x 12 heads, n_embd 768), random weights (seed 0), GPT-2's tokenizer
(../shared/data/gpt2-tokenizer, or $GPT2ATTN_SHARED_DATA/gpt2-tokenizer), a text of exactly N
tokens. For each N prints: the page's size and what each part of its data takes (attention
weights, the neuron view's q and k, the layers view's logit lens, thumbnails, the rest); the
build time (explore(): the forward with attentions, the 144 head ablations, packing) beside one
plain forward pass and the ratio build / (forward x 144 heads ablated); in headless Chromium
(median of --repeats loads): the first view (navigation start to the model view drawn), opening
one head's full view (every line drawn, as nothing is selected), the neuron view of the last
query and the layers view. --bertviz also writes bertviz's head_view and model_view
(html_action="return") for the same model and text and prints their sizes and what they fetch;
--circuitsvis does the same with CircuitsVis' attention_heads, one layer per widget (its HTML as
str() gives it, loading the bundle from a CDN, and as a notebook shows it offline, bundle inlined).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import SHARED_DATA, machine_line, median_seconds

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.explore import explore
from gpt2attn.tokenizer import encode, load_tokenizer

TOKENIZER_FILES = SHARED_DATA / "gpt2-tokenizer"
PARTS = {"attention weights": ["attn"], "neuron view (q, k)": ["q", "k"], "layers view (logit lens)": ["lens"],
         "thumbnails": ["thumbs"]}  # the rest: tokens, top-5s, ablations, settings
PROSE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
         "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
         "it was the season of Darkness, it was the spring of hope, it was the winter of despair.\n")


def main(argv: list[str]) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(prog="bench.py explore")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bertviz", action="store_true")
    parser.add_argument("--circuitsvis", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_line())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config.from_preset("gpt2")).eval()
    tok = load_tokenizer(TOKENIZER_FILES)
    heads = model.config.n_layer * model.config.n_head
    pages, views = [], []  # the result file's tables: one row per token count
    with tempfile.TemporaryDirectory() as tmp:
        browser = chromium(Path(tmp) / "profile")
        try:
            for n in args.tokens:
                ids = encode(tok, PROSE * (n // 40 + 2))[:n]
                text = tok.decode(ids)
                assert len(encode(tok, text)) == n, "the text does not re-encode to the same tokens"
                x = torch.tensor([ids])
                with torch.no_grad():
                    forward = median_seconds(lambda: model(x, use_cache=False), repeats=args.repeats, warmup=1)
                start = time.perf_counter()
                page = explore(model, tok, text, name="gpt2-small (random)")
                build = time.perf_counter() - start
                path = Path(tmp) / f"page{n}.html"
                page.save(path)
                size = path.stat().st_size / 1e6
                print(f"\n{n} tokens: page {size:.2f} MB")
                data = json.loads(re.search(r'id="data">(.*?)</script>', page.html, re.S)[1].replace("<\\/", "</"))
                sizes = {part: sum(len(json.dumps(data[key], separators=(",", ":"))) for key in keys) / 1e6
                         for part, keys in PARTS.items()}
                print("  of which " + "; ".join(f"{part} {mb:.2f} MB" for part, mb in sizes.items())
                      + f"; the rest (page, tokens, top-5s, ablations) {size - sum(sizes.values()):.2f} MB")
                print(f"  build {build:.2f} s; one forward pass {forward * 1000:.0f} ms; "
                      f"build / (forward x {heads} heads) = {build / (forward * heads):.2f}")
                pages.append({"tokens": n, "page MB": round(size, 2),
                              **{f"{part} MB": round(mb, 2) for part, mb in sizes.items()},
                              "the rest MB": round(size - sum(sizes.values()), 2), "build s": round(build, 2),
                              "one forward ms": round(forward * 1000), f"build / (forward x {heads})":
                              round(build / (forward * heads), 2)})
                if browser is None:
                    continue
                times = {"first view (model view)": [], "one head's full view, every line": [],
                         "neuron view, last query": [], "layers view": []}
                for _ in range(args.repeats):
                    browser.get(path.as_uri())
                    for what, script in zip(times, [
                            "window.explore.ready.then(() => arguments[0](window.explore.renderedAt))",
                            "const t0 = performance.now(); window.explore.openHead(11, [3])"
                            ".then(() => arguments[0](performance.now() - t0))",
                            f"const t0 = performance.now(); window.explore.openNeuron(11, 3, {n - 1})"
                            ".then(() => arguments[0](performance.now() - t0))",
                            "const t0 = performance.now(); document.getElementById('tab-lens').click();"
                            "requestAnimationFrame(() => arguments[0](performance.now() - t0))"]):
                        times[what].append(browser.execute_async_script(script) / 1000)
                print(f"  Chromium {browser.capabilities['browserVersion']}, median of {args.repeats}: "
                      + "; ".join(f"{what} {statistics.median(t):.2f} s" for what, t in times.items()))
                views.append({"tokens": n, "Chromium": browser.capabilities["browserVersion"],
                              **{f"{what} s": round(statistics.median(t), 2) for what, t in times.items()}})
                if args.bertviz:
                    bertviz_pages(model, tok, ids, Path(tmp))
                if args.circuitsvis:
                    circuitsvis_pages(model, tok, ids)
        finally:
            if browser is not None:
                browser.quit()
    tables = {f"the page (random gpt2-small, {heads} heads ablated), sizes and build time": pages}
    if views:
        tables[f"headless Chromium, median of {args.repeats} loads"] = views
    return tables


def chromium(profile: Path):
    """Headless Chromium through selenium, or None (with a message) where it is missing."""
    try:
        from selenium import webdriver
    except ImportError:
        print("no selenium: render times skipped")
        return None
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        print("no chromium / chromedriver: render times skipped")
        return None
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService(shutil.which("chromedriver")), options=options)


def bertviz_pages(model: GPT2LMHeadModel, tok, ids: list[int], tmp: Path) -> None:
    from bertviz import head_view, model_view

    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    tokens = [tok.id_to_token(i) for i in ids]
    for name, view in (("head_view", head_view), ("model_view", model_view)):
        start = time.perf_counter()
        html = view(attentions, tokens, html_action="return").data
        took = time.perf_counter() - start
        fetched = sorted(set(re.findall(r"https?://[^\s'\"]+", html)))
        print(f"  bertviz {name}: {len(html.encode()) / 1e6:.2f} MB in {took:.2f} s; fetches {', '.join(fetched) or 'nothing'}")


def circuitsvis_pages(model: GPT2LMHeadModel, tok, ids: list[int]) -> None:
    from circuitsvis.attention import attention_heads

    with torch.no_grad():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    tokens = [tok.id_to_token(i) for i in ids]
    start = time.perf_counter()
    widgets = [attention_heads(a[0], tokens) for a in attentions]  # one layer each
    took = time.perf_counter() - start
    for name, src in (("str() / online", "cdn_src"), ("offline, bundle inlined", "local_src")):
        sizes = [len(getattr(w, src).encode()) / 1e6 for w in widgets]
        fetched = sorted(set(re.findall(r"https?://[^\s'\"]+", getattr(widgets[0], src))))
        print(f"  CircuitsVis attention_heads, {name}: {sizes[0]:.2f} MB a layer, {sum(sizes):.2f} MB for all "
              f"{len(widgets)} layers ({took:.2f} s); fetches {', '.join(fetched) or 'nothing'}")
