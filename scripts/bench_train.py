"""Training-step time, ours vs transformers.GPT2LMHeadModel, in one process.

    python scripts/bench.py train                       # shakespeare_char_cpu shapes, fp32, CPU
    python scripts/bench.py train --compile             # and torch.compile(ours), with its compile time
    python scripts/bench.py train --preset gpt2 --batch-size 8 --block-size 1024 --device cuda --dtype bfloat16

A step is what `gpt2attn train` does: forward, fp32 cross-entropy, backward, clip at 1.0, fused
AdamW, zero_grad(set_to_none). Both models get the same weights, batch and optimizer settings.
The models take turns, each turn one untimed step and then STEPS_PER_TURN (5) timed ones in a
row, as a training loop runs them. On CUDA the model FLOP utilisation (MFU) is printed too.
Two floors are timed in the same turns: the step's matmuls alone, and every kernel a step needs
alone (make_kernels); transformers' time over the second is the most any eager step could gain.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from bench_common import interleaved_medians, machine_line, matmul_gflops
from gpt2attn import GPT2Config, GPT2LMHeadModel

STEPS_PER_TURN = 5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def train_flops_per_token(config: GPT2Config, T: int) -> float:
    """PaLM's estimate: 6 per parameter (without position embeddings) + attention's 12·L·C·T."""
    n_params = 12 * config.n_layer * config.n_embd**2 + config.vocab_size * config.n_embd
    return 6 * n_params + 12 * config.n_layer * config.n_embd * T


def make_step(model, batch, dtype, device):
    x, y = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            logits = model(x, use_cache=False).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def make_matmuls(config: GPT2Config, n_tokens: int, dtype, device):
    """The step's matrix products alone (each Conv1D's forward and two backward GEMMs, and the
    tied head's three), on random data: the part of a step both libraries share, so the rest is
    what either can make faster."""
    C, inner, V = config.n_embd, config.inner_dim, config.vocab_size

    def operands(n_in: int, n_out: int) -> tuple[Tensor, ...]:
        x, w = torch.randn(n_tokens, n_in, device=device, dtype=dtype), torch.randn(n_in, n_out, device=device, dtype=dtype)
        return x, w, torch.zeros(n_out, device=device, dtype=dtype), torch.randn(n_tokens, n_out, device=device, dtype=dtype)

    convs = [operands(C, 3 * C), operands(C, C), operands(C, inner), operands(inner, C)]
    head = operands(C, V)

    def matmuls():
        for _ in range(config.n_layer):
            for x, w, b, grad in convs:
                torch.addmm(b, x, w)  # forward
                torch.mm(grad, w.t())  # input gradient
                torch.mm(x.t(), grad)  # weight gradient
        x, w, _, grad = head
        torch.mm(x, w)
        torch.mm(grad, w.t())
        torch.mm(x.t(), grad)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return matmuls


def make_kernels(config: GPT2Config, n_params: int, batch_size: int, block_size: int, dtype, device):
    """Every kernel a GPT-2 step cannot do without, each forward and backward through autograd
    on random leaves, with nothing between them: the matmuls above, PyTorch's fused attention
    (is_causal), the tanh GELU, the LayerNorms, embedding lookups, the loss, and the shared
    clip + fused AdamW over n_params values (the model's count). No eager step can be faster: its
    time over a transformers step is the most speed-up any eager rewrite could show."""
    B, T, C, nh, V = batch_size, block_size, config.n_embd, config.n_head, config.vocab_size
    L, inner = config.n_layer, config.inner_dim
    matmuls = make_matmuls(config, B * T, dtype, device)

    def leaf(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v = (leaf(B, nh, T, C // nh) for _ in range(3))  # (B, nh, T, hs)
    hidden, x = leaf(B * T, inner), leaf(B * T, C)
    ln = torch.nn.LayerNorm(C).to(device, dtype)
    wte, wpe = torch.nn.Embedding(V, C).to(device, dtype), torch.nn.Embedding(T, C).to(device, dtype)
    ids, targets = (torch.randint(0, V, (B, T), device=device) for _ in range(2))
    logits = leaf(B * T, V)
    params = [torch.nn.Parameter(torch.randn(n, device=device) * 0.02) for n in (n_params - 2 * C, 2 * C)]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, fused=True)

    def kernels():
        matmuls()
        for _ in range(L):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(y)
            y = F.gelu(hidden, approximate="tanh")
            y.backward(y)
        for _ in range(2 * L + 1):
            y = ln(x)
            y.backward(y)
        (wte(ids) + wpe(torch.arange(T, device=device))).sum().backward()
        F.cross_entropy(logits.float(), targets.view(-1)).backward()
        for p in params:
            p.grad = torch.ones_like(p)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for t in (q, k, v, hidden, x, logits):
            t.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()

    return kernels


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(prog="bench.py train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", help="gpt2, gpt2-medium, ... (default: the 4x128 char model, vocab 65)")
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--repeats", type=int, default=12, help=f"turns per model, each 1 untimed + {STEPS_PER_TURN} timed steps")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device peak for MFU (H100 bf16 dense: 989)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(ours), and its compile seconds")
    args = parser.parse_args(argv)

    import transformers

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.preset:
        config = GPT2Config.from_preset(args.preset)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    else:
        config = GPT2Config(vocab_size=65, n_positions=args.block_size, n_embd=128, n_layer=4, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    ours = GPT2LMHeadModel(config).to(device).train()
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(config.to_dict()))
    theirs.load_state_dict(ours.state_dict())
    theirs = theirs.to(device).train()
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.block_size + 1), device=device)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

    print(machine_line())
    if device.type == "cpu":
        print(f"fp32 matmul roofline: {matmul_gflops():.0f} GFLOP/s")
    print(f"model: {config.n_layer} layers, n_embd {config.n_embd}, vocab {config.vocab_size}; "
          f"batch {args.batch_size} x {args.block_size} tokens, {args.dtype}, transformers "
          f"{transformers.__version__} ({theirs.config._attn_implementation} attention)")
    steps = {"gpt2attn": make_step(ours, batch, dtype, device), "transformers": make_step(theirs, batch, dtype, device)}
    if args.compile:
        compiled = GPT2LMHeadModel(config).to(device).train()
        compiled.load_state_dict(ours.state_dict())
        steps["compiled"] = make_step(torch.compile(compiled), batch, dtype, device)
        started = time.perf_counter()
        steps["compiled"]()
        print(f"torch.compile: first step (compiling forward and backward) {time.perf_counter() - started:.1f} s")
    tokens = args.batch_size * args.block_size
    steps["matmuls alone"] = make_matmuls(config, tokens, dtype, device)
    steps["kernels alone"] = make_kernels(config, ours.num_parameters(), args.batch_size, args.block_size, dtype, device)
    times = interleaved_medians(steps, repeats=args.repeats, warmup=3, per_turn=STEPS_PER_TURN)
    floor = times.pop("matmuls alone")
    kernels = times.pop("kernels alone")
    flops = train_flops_per_token(config, args.block_size) * tokens
    rows = []
    for name, seconds in times.items():
        line = f"{name:>12}: {seconds * 1e3:8.2f} ms/step  {tokens / seconds:10.0f} tokens/s  {flops / seconds / 1e9:7.1f} GFLOP/s"
        row = {"step": name, "ms/step": f"{seconds * 1e3:.2f}", "tokens/s": f"{tokens / seconds:.0f}",
               "GFLOP/s": f"{flops / seconds / 1e9:.1f}", "transformers / this": f"{times['transformers'] / seconds:.2f}x"}
        if device.type == "cuda":
            line += f"  MFU {flops / seconds / (args.peak_tflops * 1e12):.1%}"
            row["MFU"] = f"{flops / seconds / (args.peak_tflops * 1e12):.1%}"
        print(line)
        rows.append(row)
    for name, seconds in (("the step's matrix products alone", floor), ("every kernel a step needs, alone", kernels)):
        rows.append({key: "" for key in rows[0]} | {"step": name, "ms/step": f"{seconds * 1e3:.2f}",
                                                    "transformers / this": f"{times['transformers'] / seconds:.2f}x"})
    print(f"the step's matmuls alone: {floor * 1e3:.2f} ms; the rest takes gpt2attn "
          f"{(times['gpt2attn'] - floor) * 1e3:.2f} ms, transformers {(times['transformers'] - floor) * 1e3:.2f} ms")
    print(f"every kernel a step needs (matmuls, fused attention, GELU, LayerNorm, embeddings, loss, clip + "
          f"AdamW), alone: {kernels * 1e3:.2f} ms; gpt2attn spends {(times['gpt2attn'] - kernels) * 1e3:.2f} ms "
          f"beyond them; no eager step can beat transformers by more than {times['transformers'] / kernels:.2f}x")
    print(f"speed-up (transformers time / ours): {times['transformers'] / times['gpt2attn']:.2f}x")
    return rows  # bench.py writes these, with the machine and date, to docs/benchmarks/results/train.json
