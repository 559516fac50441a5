"""CPU decoding and prefill, ours vs llama.cpp on the same weights, against the machine's read rate.

    python scripts/bench.py decode --llama-cpp PATH/TO/llama-bench [--llama-quantize PATH/TO/llama-quantize]
                                   [--rounds 5] [--threads 2] [--prompt 32] [--new 64] [--prefill 128,512]
                                   [--only plain,fp32,fp16,bf16,int8,q4]

gpt2-small shapes, random weights (seed 0), eval. The plain model as loaded (`plain`: no
quantize() call) and each precision of ours (`model.quantize(mode)`) is paired with a GGUF file of
the same weights written by gpt2attn.formats.gguf (with a synthetic byte-level BPE vocabulary of
50257 tokens, which llama.cpp needs to load a file): plain ~ f32, fp32 ~ f32, fp16 ~ f16, bf16 ~
bf16, int8 ~ q8_0, and q4 ~ llama.cpp's q4_K_M, which llama-quantize (--llama-quantize; default: the
one beside llama-bench) makes from the f32 file. In every round, for every precision in turn: llama.cpp's llama-bench (once a
round per file: plain and fp32 share the f32 figures) (a process of its own, `-p PREFILL -n NEW -t THREADS -r 2`, which exits
before ours runs, so its spinning threads never meet torch's), then ours: greedy generate of NEW
tokens after a PROMPT-token prompt at batch 1, less the time of generating 1 token (so the NEW - 1
steps between are timed, not the prompt's forward: llama-bench's tg has no prompt) and generate's
prompt pass for each PREFILL length (gpt2attn.generation.decoder.Decoder, as generate makes it: a
fresh KV cache, the forward into it and the last position's logits). Each llama-bench and each of
our decode timings has the read rate measured just before and just after it beside it (the faster
of the two, each as below): a round's "of limit" is its decode tok/s against that rate, so memory
that changes speed between rounds (these VMs' does, from one minute to the next) moves both
together; the table gives the median over rounds [min-max]. Beside each also a sustained read:
NEW - 1 passes over the buffer in a row (eight streams a thread), timed as one just as the decode's
NEW - 1 steps are ("of sustained read"), since the best of short passes can catch memory at its
fastest moments, which a decode of hundreds of milliseconds averages over (2026-11-29, the Zen 5
VM: 90-100% of the best short passes around it with memory slow, median about 95%; in that day's
bench runs 91-106%, median 98-99.7%). At the end of each round the read
rate: one pass over a buffer of the fp32 weights' size, on 2 MiB pages where the system gives them
as quantize() keeps its weights (bench_common.read_buffer; before the run of 2026-11-28 05:56 UTC on
4 kB pages, which read up to 30% slower on the Zen 4 VM), by bench_common.read_sum (each thread
reading its share as 8 streams) and by torch's sum (the fastest counts; the rate of one stream a
thread is printed beside it, the limit these benchmarks used before 2026-11-26), and the blocks' 48 matrix products of each PREFILL length alone through
torch.mm in fp32 (MKL): the most any prefill built on torch's matrix products can reach. Prints per precision the medians over rounds (min-max in brackets),
ours/llama.cpp ratios, and tok/s as a fraction of the limit read rate / bytes read per token
(the weight matrices in that precision, embedding rows left out; for q4 and q4_K_M, which mix
types, the bytes of the matrices as held: our layers' tensors, the GGUF file's tensor table), and
beside it with the KV cache each timed step reads added (kv_bytes_per_token).
The raw rows also come out as one JSON line (`RESULTS [...]`); `run()` returns them and the table's rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_common import machine_line, read_buffer, read_sum, weight_bytes

from gpt2attn import GPT2Config, GPT2LMHeadModel, kernels
from gpt2attn.formats import gguf
from gpt2attn.generation.decoder import Decoder

# plain: the fp32 model as loaded, no quantize() call (generate's default path)
PAIRS = {"plain": "f32", "fp32": "f32", "fp16": "f16", "bf16": "bf16", "int8": "q8_0", "q4": "q4_K_M"}
# (bytes per weight, bytes per matrix row) read by each: q8_0 holds 32 int8 and one fp16 scale per
# block, our int8 one fp32 scale per row
BYTES = {"plain": (4.0, 0.0), "fp32": (4.0, 0.0), "fp16": (2.0, 0.0), "bf16": (2.0, 0.0), "int8": (1.0, 4.0),
         "f32": (4.0, 0.0), "f16": (2.0, 0.0), "q8_0": (34 / 32, 0.0)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py decode")
    parser.add_argument("--llama-cpp", required=True, help="path of llama.cpp's llama-bench binary")
    parser.add_argument("--llama-quantize", help="path of llama.cpp's llama-quantize, which makes q4_K_M for q4 "
                        "(default: the one beside llama-bench)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prefill", default="128,512", help="comma-separated prompt lengths for prefill")
    parser.add_argument("--only", default=",".join(PAIRS), help="comma-separated precisions: " + ", ".join(PAIRS))
    args = parser.parse_args(argv)
    if args.llama_quantize is None and Path(args.llama_cpp).with_name("llama-quantize").is_file():
        args.llama_quantize = str(Path(args.llama_cpp).with_name("llama-quantize"))
    if "q4" in args.only.split(",") and args.llama_quantize is None:
        parser.error("q4 is compared with llama.cpp's q4_K_M, which needs --llama-quantize PATH (llama.cpp's "
                     "llama-quantize; build it with `cmake --build build --target llama-quantize`)")
    rows, shown = run(args)
    print("RESULTS " + json.dumps(rows))
    return shown  # bench.py writes these, with the machine and date, to docs/benchmarks/results/decode.json


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE of vocab_size tokens: the 256 byte characters, then pairs of them, then
    <|endoftext|> (llama.cpp loads no GPT-2 file without a vocabulary; the benchmark feeds ids)."""
    from gpt2attn.tokenizer import _byte_level_alphabet, byte_level_bpe

    alphabet = sorted(_byte_level_alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) == vocab_size - 1:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return byte_level_bpe(vocab, merges)


def llama_bench(binary: str, path: Path, args) -> dict[str, float]:
    """tok/s of one llama-bench call: {'decode': tg NEW, 'prefill T': pp T for each T}."""
    cmd = [binary, "-m", str(path), "-p", args.prefill, "-n", str(args.new), "-t", str(args.threads),
           "-r", "2", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    out = {}
    for test in json.loads(done.stdout):
        key = "decode" if test["n_gen"] else f"prefill {test['n_prompt']}"
        out[key] = test["avg_ts"]
    return out


def matrix_bytes(model: GPT2LMHeadModel, per_weight: float, per_row: float = 0.0) -> float:
    """Bytes of every matrix a decoding step reads (the blocks' four and the head)."""
    cfg = model.config
    shapes = [(cfg.n_embd, 3 * cfg.n_embd), (cfg.n_embd, cfg.n_embd), (cfg.n_embd, cfg.inner_dim),
              (cfg.inner_dim, cfg.n_embd)]
    total = sum(i * o * per_weight + o * per_row for i, o in shapes) * cfg.n_layer
    return total + cfg.vocab_size * cfg.n_embd * per_weight + cfg.vocab_size * per_row


def gguf_matrix_bytes(path: Path) -> float:
    """Bytes of the weight matrices a decoding step of the GGUF file at path reads (the blocks' four
    and output.weight), from its tensor table."""
    file = gguf.GGUFFile(path)
    return float(sum(length for name, (_, _, _, length) in file.tensors.items()
                     if name.endswith(gguf.LINEARS) or name == "output.weight"))


def llama_quantize(binary: str, source: Path, target: Path, kind: str) -> None:
    done = subprocess.run([binary, str(source), str(target), kind.upper()], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{binary} {source} {target} {kind.upper()} failed:\n{done.stderr[-2000:]}")


def kv_bytes_per_token(cfg: GPT2Config, side: str, prompt: int, new: int) -> float:
    """The cached keys and values a timed decoding step reads, on average over the timed steps: ours
    are generate's NEW - 1 steps after the first token, the i-th attending to PROMPT + i entries of
    an fp32 cache; llama-bench's tg runs NEW steps with no prompt, the j-th attending to j entries of
    its f16 cache (the least it can read: its kernels may read a padded view)."""
    entries, size = (prompt + new / 2, 4) if side == "ours" else ((new + 1) / 2, 2)
    return entries * cfg.n_layer * 2 * cfg.n_embd * size


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(args) -> tuple[list[dict], list[dict]]:
    torch.set_num_threads(args.threads)
    modes = args.only.split(",")
    lengths = [int(t) for t in args.prefill.split(",")]
    torch.manual_seed(0)
    cfg = GPT2Config.from_preset("gpt2")
    fp32 = GPT2LMHeadModel(cfg).eval()
    state = fp32.state_dict()
    print(machine_line() + f"; {datetime.datetime.now().isoformat(timespec='minutes')}")
    print(f"kernels: {kernels.instruction_set()}")
    ours, files = {}, {}
    tmp = tempfile.TemporaryDirectory()
    tokenizer = synthetic_tokenizer(cfg.vocab_size)
    for mode in modes:
        model = GPT2LMHeadModel(cfg).eval()
        model.load_state_dict(state)
        ours[mode] = model if mode == "plain" else model.quantize(mode)
        files[mode] = Path(tmp.name) / f"gpt2-{PAIRS[mode]}.gguf"
        if PAIRS[mode] == "q4_K_M":  # llama.cpp's own 4-bit mix, made by llama-quantize from the f32 file
            f32 = Path(tmp.name) / "gpt2-f32-for-quantize.gguf"
            gguf.write(f32, state, cfg, dtype="f32", tokenizer=tokenizer)
            llama_quantize(args.llama_quantize, f32, files[mode], PAIRS[mode])
            f32.unlink()
        else:
            gguf.write(files[mode], state, cfg, dtype=PAIRS[mode], tokenizer=tokenizer)
    # q4 and q4_K_M mix types: the bytes as held (our layers' tensors, the file's table)
    held = {"q4": weight_bytes(ours["q4"]), PAIRS["q4"]: gguf_matrix_bytes(files["q4"])} if "q4" in modes else {}
    buffer = read_buffer(int(matrix_bytes(fp32, 4.0)) // 4)

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=g)
    long = {t: torch.randint(0, cfg.vocab_size, (1, t), generator=g) for t in lengths}
    keys = ["decode"] + [f"prefill {t}" for t in lengths]
    results = {(mode, side, key): [] for mode in modes for side in ("ours", "llama.cpp") for key in keys}
    beside = {(mode, side): [] for mode in modes for side in ("ours", "llama.cpp")}  # each decode's read rate
    held_beside = {(mode, side): [] for mode in modes for side in ("ours", "llama.cpp")}  # and its sustained read
    read_rates, one_stream_rates = [], []

    def read_rate_now() -> float:
        """The read rate at this moment: the faster of a pass as eight streams a thread and as one."""
        seconds = min(best_of(lambda: read_sum(buffer), 2), best_of(lambda: read_sum(buffer, streams=1), 2))
        return buffer.numel() * 4 / seconds

    def sustained_rate_now() -> float:
        """The read rate held as long as a timed decode reads: NEW - 1 passes in a row (eight streams a
        thread), timed as one."""
        passes = max(1, args.new - 1)
        start = time.perf_counter()
        for _ in range(passes):
            read_sum(buffer)
        return passes * buffer.numel() * 4 / (time.perf_counter() - start)

    def rates_around(measure):
        """measure()'s result, and the read rate and the sustained read beside it: each the faster of
        just before and just after."""
        peak, held = read_rate_now(), sustained_rate_now()
        result = measure()
        return result, max(peak, read_rate_now()), max(held, sustained_rate_now())
    gemm_floor = {t: [] for t in lengths}  # tok/s of the blocks' 48 products alone, through torch (MKL), fp32

    def blocks_products(x: torch.Tensor) -> None:
        for block in fp32.transformer.h:
            torch.mm(x, block.attn.c_attn.weight), torch.mm(x, block.attn.c_proj.weight)
            torch.mm(torch.mm(x, block.mlp.c_fc.weight), block.mlp.c_proj.weight)

    with torch.inference_mode():
        same = {mode: torch.equal(ours[mode].generate(prompt, max_new_tokens=args.new, eos_token_id=None),
                                  fp32.generate(prompt, max_new_tokens=args.new, eos_token_id=None))
                for mode in modes}
        for r in range(args.rounds):
            llama = {}  # this round's llama-bench figures by format (plain and fp32 share f32's)
            for mode in modes:
                if PAIRS[mode] not in llama:
                    llama[PAIRS[mode]] = rates_around(lambda: llama_bench(args.llama_cpp, files[mode], args))
                figures, rate, held_rate = llama[PAIRS[mode]]
                for key, value in figures.items():
                    results[(mode, "llama.cpp", key)].append(value)
                beside[(mode, "llama.cpp")].append(rate)
                held_beside[(mode, "llama.cpp")].append(held_rate)
                model = ours[mode]
                model.generate(prompt, max_new_tokens=4, eos_token_id=None)  # warm
                # decoding alone, as llama-bench's tg: generate's time for NEW tokens less its time for 1
                # (the prompt's forward and the first token), over the NEW - 1 steps between them
                def decode_tok_s(model=model) -> float:
                    t_all = best_of(lambda: model.generate(prompt, max_new_tokens=args.new, eos_token_id=None), 2)
                    t_one = best_of(lambda: model.generate(prompt, max_new_tokens=1, eos_token_id=None), 2)
                    return (args.new - 1) / (t_all - t_one)

                tok_s, rate, held_rate = rates_around(decode_tok_s)
                results[(mode, "ours", "decode")].append(tok_s)
                beside[(mode, "ours")].append(rate)
                held_beside[(mode, "ours")].append(held_rate)
                for length, ids in long.items():
                    t = best_of(lambda: Decoder(model, 1, ids.size(1) + 1, "cpu").forward(ids), 2)
                    results[(mode, "ours", f"prefill {length}")].append(length / t)
            for length in lengths:
                x = torch.randn(length, cfg.n_embd)
                gemm_floor[length].append(length / best_of(lambda: blocks_products(x), 2))
            t_ours = best_of(lambda: read_sum(buffer), 5)
            t_torch = best_of(lambda: buffer.sum(), 5)
            t_one = best_of(lambda: read_sum(buffer, streams=1), 5)
            read_rates.append(buffer.numel() * 4 / min(t_ours, t_torch, t_one))
            one_stream_rates.append(buffer.numel() * 4 / t_one)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    tmp.cleanup()

    rate = statistics.median(read_rates)
    print(f"read rate: {rate / 1e9:.1f} GB/s (median of {len(read_rates)}, "
          f"{min(read_rates) / 1e9:.1f}-{max(read_rates) / 1e9:.1f}), {args.threads} threads; one stream a thread: "
          f"{statistics.median(one_stream_rates) / 1e9:.1f} GB/s")
    print(f"gpt2-small, batch 1, prompt {args.prompt}, {args.new} new tokens; prefill is generate's prompt pass "
          f"(a fresh cache, the last position's logits); medians of {args.rounds} rounds [min-max]")
    rows, shown = [], []
    for mode in modes:
        for side, kind in (("ours", mode), ("llama.cpp", PAIRS[mode])):
            nbytes = held[kind] if kind in held else matrix_bytes(fp32, *BYTES[kind])
            row = {"precision": mode, "engine": side, "format": kind, "bytes_per_token": nbytes,
                   "read_rate_gb_s": rate / 1e9, "one_stream_read_rate_gb_s": statistics.median(one_stream_rates) / 1e9,
                   "threads": args.threads}
            for key in keys:
                values = results[(mode, side, key)]
                row[key.replace(" ", "_") + "_tok_s"] = statistics.median(values)
                row[key.replace(" ", "_") + "_range"] = [min(values), max(values)]
            # each round's decode against the read rate measured beside it (the faster of just before
            # and just after), the median over rounds: memory that changes speed between rounds
            # then moves the figure and its limit together
            decodes = results[(mode, side, "decode")]
            # each round's, beside read_rate_beside_gb_s's
            row["fraction_of_limit_rounds"] = _fractions(row, "fraction_of_limit", decodes, nbytes, beside[(mode, side)])
            # the KV cache each timed step also reads, on average over them (see kv_bytes_per_token)
            row["kv_bytes_per_token"] = kv = kv_bytes_per_token(cfg, side, args.prompt, args.new)
            _fractions(row, "fraction_of_limit_with_kv", decodes, nbytes + kv, beside[(mode, side)])
            row["read_rate_beside_gb_s"] = [near / 1e9 for near in beside[(mode, side)]]
            # against the sustained read beside it instead (NEW - 1 passes timed as one, as the decode is)
            row["fraction_of_sustained_read_rounds"] = _fractions(row, "fraction_of_sustained_read", decodes, nbytes,
                                                                  held_beside[(mode, side)])
            row["sustained_read_rate_beside_gb_s"] = [near / 1e9 for near in held_beside[(mode, side)]]
            rows.append(row)
        o, l = rows[-2], rows[-1]
        for r, name in ((o, f"ours {mode}"), (l, f"llama.cpp {l['format']}")):
            cells = {"precision": name, "decode tok/s": _cell(r, "decode"),
                     "decode vs llama.cpp": f"{o['decode_tok_s'] / l['decode_tok_s']:.2f}x" if r is o else "",
                     "of limit": _percent_cell(r, "fraction_of_limit"),
                     "of limit, weights + KV": _percent_cell(r, "fraction_of_limit_with_kv"),
                     # the read rates "of limit" divides by: memory's speed can change from minute to minute
                     "read rate GB/s": _rates_cell(r["read_rate_beside_gb_s"]),
                     "of sustained read": _percent_cell(r, "fraction_of_sustained_read"),
                     "sustained read GB/s": _rates_cell(r["sustained_read_rate_beside_gb_s"])}
            for t in lengths:
                cells[f"prefill {t} tok/s"] = _cell(r, f"prefill {t}")
                cells[f"prefill {t} vs llama.cpp"] = (f"{o[f'prefill_{t}_tok_s'] / l[f'prefill_{t}_tok_s']:.2f}x"
                                                      if r is o else "")
            cells["tokens = fp32"] = str(same[mode]) if r is o else ""
            shown.append(cells)
    floors = {t: statistics.median(v) for t, v in gemm_floor.items()}
    ceiling = {key: "" for key in shown[0]}
    ceiling["precision"] = "torch's fp32 products alone"  # the most a prefill built on torch.mm can reach
    ceiling.update({f"prefill {t} tok/s": f"{v:.1f}" for t, v in floors.items()})
    shown.append(ceiling)
    print("| " + " | ".join(shown[0]) + " |")
    print("|" + "---|" * len(shown[0]))
    for cells in shown:
        print("| " + " | ".join(cells.values()) + " |")
    print(f"read rate {rate / 1e9:.1f} GB/s (end of each round); 'of limit': each round's decode tok/s x bytes per "
          "token / the read rate measured just before and after it (the faster), median over rounds [min-max]; "
          "bytes per token: the weight matrices, and in 'weights + KV' also the cached keys and values each timed "
          "step reads (ours: fp32, the prompt's and the new tokens', "
          f"{kv_bytes_per_token(cfg, 'ours', args.prompt, args.new) / 1e6:.2f} MB a token on average; llama-bench's "
          f"tg: f16, no prompt, {kv_bytes_per_token(cfg, 'llama.cpp', args.prompt, args.new) / 1e6:.2f} MB); "
          f"'of sustained read': the same decode against {max(1, args.new - 1)} passes over the buffer in a row, "
          "timed as one as the decode's steps are, just before and after it (the faster)")
    print("prefill's ceiling through torch's matrix products: the blocks' 48 fp32 products of a T-token prompt "
          "alone (torch.mm, MKL; no attention, LayerNorm or head), tok/s (the table's last row): "
          + ", ".join(f"T={t}: {v:.0f}" for t, v in floors.items()))
    for row in rows:
        if row["engine"] == "ours":
            row.update({f"prefill_{t}_torch_matmul_ceiling_tok_s": v for t, v in floors.items()})
    return rows, shown


def _fractions(row: dict, name: str, decodes: list[float], nbytes: float, rates: list[float]) -> list[float]:
    """Each round's decode tok/s x nbytes against the read rate beside it; their median and [min, max]
    go into row[name] and row[name + "_range"]. Returns the rounds' fractions."""
    fractions = [tok_s * nbytes / near for tok_s, near in zip(decodes, rates)]
    row[name] = statistics.median(fractions)
    row[name + "_range"] = [min(fractions), max(fractions)]
    return fractions


def _percent_cell(row: dict, name: str) -> str:
    lo, hi = row[name + "_range"]
    return f"{row[name]:.0%} [{lo:.0%}-{hi:.0%}]"


def _rates_cell(rates_gb_s: list[float]) -> str:
    return f"{statistics.median(rates_gb_s):.1f} [{min(rates_gb_s):.0f}-{max(rates_gb_s):.0f}]"


def _cell(row: dict, key: str) -> str:
    key = key.replace(" ", "_")
    lo, hi = row[key + "_range"]
    return f"{row[key + '_tok_s']:.1f} [{lo:.0f}-{hi:.0f}]"

