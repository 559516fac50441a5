"""A one-layer GPT-2 whose weights are written by hand to continue "aabaabaab...".

Every weight is chosen, none trained. The 8 slots of the residual stream:

    slots 0-4  one-hot position (wpe)          slot 5  token a (wte)
    slot 7     a scratch slot for attention    slot 6  token b (wte)

The next token follows from the last two: "aa" -> b, "ab" -> a, "ba" -> a. So each position
attends equally to itself and the one before, reads +1 for every a and -1 for every b into
slot 7 (the average: +1 after "aa", 0 otherwise), and c_proj turns slot 7 into a vote for b
(slot 7 = 1) or for a (slot 7 = 0). The head is tied to wte, so slots 5/6 are the logits.

    python scripts/handmade_aab.py
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gpt2attn import GPT2Config, GPT2LMHeadModel, inspect

VOCAB = "ab"
CONTEXT = 5
BIG = 1024.0  # large enough that softmax and the logits are as good as exact


class NoMLP(nn.Module):
    """Stands in for the MLP: adds nothing to the residual stream."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)


@torch.no_grad()
def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=2, n_positions=CONTEXT, n_embd=8, n_layer=1, n_head=1,
                        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config).eval()
    gpt, block = model.transformer, model.transformer.h[0]
    block.ln_1, block.ln_2, gpt.ln_f = nn.Identity(), nn.Identity(), nn.Identity()
    block.mlp = NoMLP()

    gpt.wte.weight.copy_(torch.eye(8)[[5, 6]])  # a -> slot 5, b -> slot 6 (the head shares it)
    gpt.wpe.weight.copy_(torch.eye(8)[:CONTEXT])  # position p -> slot p

    # c_attn maps the stream (rows) to [q | k | v] (columns 0-7 | 8-15 | 16-23).
    w = torch.zeros(8, 24)
    for p in range(CONTEXT):
        w[p, p] = BIG  # q: position p looks for key p ...
        if p > 0:
            w[p, p - 1] = BIG  # ... and key p - 1, equally
        w[p, 8 + p] = 1.0  # k: the one-hot position
    w[5, 16 + 7] = 1.0  # v: a -> +1 in slot 7
    w[6, 16 + 7] = -1.0  # v: b -> -1 in slot 7
    block.attn.c_attn.weight.copy_(w)
    block.attn.c_attn.bias.zero_()

    # c_proj: logit a = 1024 - 1024 * slot 7, logit b = 1024 * slot 7.
    block.attn.c_proj.weight.zero_()
    block.attn.c_proj.weight[7, 5] = -BIG
    block.attn.c_proj.weight[7, 6] = BIG
    block.attn.c_proj.bias.zero_()
    block.attn.c_proj.bias[5] = BIG
    return model


def encode(text: str) -> Tensor:
    return torch.tensor([VOCAB.index(c) for c in text])


def windows(text: str) -> tuple[Tensor, Tensor]:
    """Every context window of the text and its next-token targets, each (N, CONTEXT)."""
    ids = encode(text)
    starts = range(len(ids) - CONTEXT)
    inputs = torch.stack([ids[s : s + CONTEXT] for s in starts])
    targets = torch.stack([ids[s + 1 : s + CONTEXT + 1] for s in starts])
    return inputs, targets


@torch.no_grad()
def accuracy(model: GPT2LMHeadModel, text: str = "aab" * 10) -> float:
    """Next-token accuracy over all windows, at positions 1..CONTEXT-1.

    Position 0 of a window has seen a single token, and one token does not fix the next one
    ("a" is followed by a or b), so no model can be scored there; from position 1 on, the last
    two tokens decide it.
    """
    inputs, targets = windows(text)
    predictions = model(inputs).logits.argmax(-1)  # (N, CONTEXT)
    return (predictions[:, 1:] == targets[:, 1:]).float().mean().item()


def main() -> None:
    model = build_model()
    text = "aab" * 10
    print(f"next-token accuracy on {text!r}, windows of {CONTEXT}: {accuracy(model, text):.0%}")

    last = encode(text[-CONTEXT:]).unsqueeze(0)
    with torch.no_grad(), inspect.capture(model, names=["weights"]) as acts:
        logits = model(last).logits[0, -1]
    weights = acts["h.0.attn.weights"][0, 0]  # (T, T)
    print(f"last window {text[-CONTEXT:]!r} -> predicts {VOCAB[logits.argmax()]!r}")
    print("attention weights (query rows, key columns):")
    print("     " + "".join(f"{c + '@' + str(j):>6}" for j, c in enumerate(text[-CONTEXT:])))
    for i, row in enumerate(weights):
        print(f"{text[-CONTEXT + i]}@{i}  " + "".join(f"{w:6.2f}" for w in row.tolist()))


if __name__ == "__main__":
    main()
