"""Weights in 4 bits as llama.cpp's Q4_K blocks: the layout, its dequantization and a quantizer.

A row of K weights (K a multiple of 256) is K/256 super-blocks of 144 bytes each, the bytes of
ggml's `block_q4_K`:

    d      fp16   the step of the eight 6-bit scales
    dmin   fp16   the step of the eight 6-bit mins
    scales 12 B   eight 6-bit scales sc[s] and eight 6-bit mins m[s], one pair per sub-block of 32:
                  bytes 0-3: sc[0..3] in bits 0-5, bits 4-5 of sc[4..7] in bits 6-7
                  bytes 4-7: m[0..3] in bits 0-5, bits 4-5 of m[4..7] in bits 6-7
                  bytes 8-11: bits 0-3 of sc[4..7] in bits 0-3, bits 0-3 of m[4..7] in bits 4-7
    qs     128 B  the 256 values q in 0..15, by chunks of 64: byte l of chunk c holds value 64c + l
                  in its low nibble and value 64c + 32 + l in its high one

and weight i of sub-block s is  (d * sc[s]) * q[i] - (dmin * m[s])  (in fp32, as ggml computes it):
4.5 bits a weight.

The kernels read the same bytes in another order, by groups of GROUP rows (`group_rows`, and back
`ungroup_rows`): super-block j of a group of n rows is 144 n bytes, their d (2 n bytes), their dmin
(2 n), byte p of their scales for p = 0..11 (n bytes each), then quad (c, t) of their qs for
c = 0..3, t = 0..7 (4 n bytes each: bytes 32c + 4t .. 32c + 4t + 3 of each row), so that one 64-byte
load holds the same four values of 16 rows (gpt2attn/kernels/simd.h). The last group holds the rows
left (N mod 16, where N is not a multiple of 16).

`quantize_rows` chooses, for each sub-block of 32, the scale and min whose grid of 16 levels gives
the smallest squared error (a search over candidate scales, each refitted by least squares, then
alternating requantization and refitting), then rounds the eight scales and mins of each
super-block to 6 bits and requantizes the values on the grid they give.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPER = 256  # weights per super-block
SUB = 32  # weights per sub-block (one scale and one min)
BYTES = 144  # bytes per super-block
LEVELS = 15  # q in 0..LEVELS
CANDIDATES = torch.linspace(-2.0, 2.0, 9)  # the scale search: (LEVELS + c) / (max - min) levels per unit
REFITS = 2  # alternating requantize / least-squares rounds after the search
ROWS_PER_CHUNK = 1024  # rows quantized at a time (bounds the search's memory)
GROUP = 16  # rows the kernels' layout interleaves (group_rows)


def keeps_8_bits(name: str, in_features: int, n_layer: int) -> bool:
    """Whether quantize()'s mode 'q4' (and a GGUF written as 'q4') keeps the matrix `name` (HF's:
    transformer.h.{i}.attn.c_attn, ..., lm_head) in 8 bits rather than Q4_K: the head, a row
    length Q4_K cannot hold (not a multiple of 256: gpt2-xl's 1600), and the matrices llama.cpp's
    q4_K_M gives more bits (its 5- and 6-bit types): attn.c_attn everywhere, and mlp.c_proj in the
    first and last eighth of the blocks and every third block between."""
    if name.endswith("lm_head") or in_features % SUPER:
        return True
    if name.endswith("attn.c_attn"):
        return True
    if name.endswith("mlp.c_proj"):
        i = int(name.split(".")[-3])  # transformer.h.{i}.mlp.c_proj
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2
    return False


def check_rows(weight: Tensor) -> None:
    if weight.dim() != 2 or weight.size(1) % SUPER:
        raise ValueError(f"Q4_K takes rows of a multiple of {SUPER} weights, not shape {tuple(weight.shape)}")


def quantize_rows(weight: Tensor) -> Tensor:
    """weight (N, K) fp32, K a multiple of 256 -> its Q4_K super-blocks (N, K/256 * 144) uint8."""
    check_rows(weight)
    weight = weight.detach().float()
    return torch.cat([_quantize_chunk(chunk) for chunk in weight.split(ROWS_PER_CHUNK)])


def _fit(x: Tensor, q: Tensor, sx: Tensor, sxx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Least-squares scale a >= 0 and min b >= 0 of x ~ a q - b over each sub-block (last dim),
    and its squared error, given x's sums sx and sxx (of x and x^2, the same for every q); b = 0
    (and a refitted alone) where the free fit would want a grid starting above zero."""
    n = x.size(-1)
    sq, sqq, sqx = q.sum(-1), (q * q).sum(-1), (q * x).sum(-1)
    det = n * sqq - sq * sq
    a = torch.where(det > 0, (n * sqx - sq * sx) / det.clamp(min=1e-30), 0.0)
    b = (a * sq - sx) / n
    alone = b < 0
    a = torch.where(alone, sqx / sqq.clamp(min=1e-30), a).clamp(min=0.0)
    b = torch.where(alone, 0.0, b)
    # sum (a q - b - x)^2, expanded into the sums above
    error = a * a * sqq + n * b * b + sxx - 2 * a * b * sq - 2 * a * sqx + 2 * b * sx
    return a, b, error


def _grid(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """The levels 0..15 nearest x on the grid a q - b."""
    return torch.round((x + b[..., None]) / torch.where(a > 0, a, 1.0)[..., None]).clamp(0, LEVELS)


def _quantize_chunk(rows: Tensor) -> Tensor:
    N, K = rows.shape
    x = rows.view(N, K // SUB, SUB)  # (N, S, 32)
    lo = x.amin(-1).clamp(max=0.0)  # the grid starts at or below 0: the stored min is -lo >= 0
    span = (x.amax(-1) - lo).clamp(min=1e-30)
    # the search: each candidate number of levels across [lo, max], refitted; the best kept
    a = b = error = None
    above, sx, sxx = x - lo[..., None], x.sum(-1), (x * x).sum(-1)
    for c in CANDIDATES.tolist():
        q = torch.round(above * ((LEVELS + c) / span)[..., None]).clamp_(0, LEVELS)  # (N, S, 32)
        a_c, b_c, e_c = _fit(x, q, sx, sxx)  # (N, S) each
        if error is None:
            a, b, error = a_c, b_c, e_c
        else:
            better = e_c < error
            a, b, error = torch.where(better, a_c, a), torch.where(better, b_c, b), torch.minimum(e_c, error)
    for _ in range(REFITS):
        a, b, _ = _fit(x, _grid(x, a, b), sx, sxx)
    # the eight scales and mins of a super-block in 6 bits: steps d, dmin (fp16), levels 0..63
    a8, b8 = a.view(N, K // SUPER, 8), b.view(N, K // SUPER, 8)
    d = (a8.amax(-1) / 63).half()  # (N, K/256)
    dmin = (b8.amax(-1) / 63).half()
    sc = torch.round(a8 / torch.where(d > 0, d.float(), 1.0)[..., None]).clamp(0, 63)
    m = torch.round(b8 / torch.where(dmin > 0, dmin.float(), 1.0)[..., None]).clamp(0, 63)
    scale = (d.float()[..., None] * sc).view(N, -1)  # (N, S): the grid the file will hold
    offset = (dmin.float()[..., None] * m).view(N, -1)
    qs = _grid(x, scale, offset).to(torch.uint8).view(N, K // SUPER, SUPER)
    return pack(d, dmin, sc.to(torch.uint8), m.to(torch.uint8), qs).view(N, -1)


def pack(d: Tensor, dmin: Tensor, sc: Tensor, m: Tensor, q: Tensor) -> Tensor:
    """d, dmin (..., ) fp16; sc, m (..., 8) uint8 below 64; q (..., 256) uint8 below 16 -> (..., 144) uint8."""
    lead = d.shape
    scales = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                        (sc[..., 4:] & 0xF) | (m[..., 4:] & 0xF) << 4], dim=-1)  # (..., 12)
    chunks = q.reshape(*lead, 4, 2, 32)  # (..., chunk, low/high half, 32)
    qs = (chunks[..., 0, :] | chunks[..., 1, :] << 4).reshape(*lead, 128)
    halves = torch.stack([d, dmin], dim=-1).contiguous().view(torch.uint8)  # (..., 4)
    return torch.cat([halves, scales, qs], dim=-1)


def fields(blocks: Tensor, K: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (N, K/256 * 144) uint8 -> q (N, K) uint8 in 0..15; d and dmin (N, K/256)
    fp32; the 6-bit sc and m (N, K/256, 8) uint8."""
    N = blocks.size(0)
    b = blocks.reshape(N, K // SUPER, BYTES)
    halves = b[..., :4].contiguous().view(torch.float16).float()  # (N, K/256, 2): d, dmin
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | (s[..., 0:4] >> 6) << 4], dim=-1)  # (N, K/256, 8)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], dim=-1)
    qs = b[..., 16:].reshape(N, K // SUPER, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(N, K)
    return q, halves[..., 0], halves[..., 1], sc, m


def unpack(blocks: Tensor, K: int) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (N, K/256 * 144) uint8 -> q (N, K) uint8 in 0..15, and each sub-block's
    scale d * sc and min dmin * m (N, K/32) fp32: weight = scale * q - min."""
    q, d, dmin, sc, m = fields(blocks, K)
    N = q.size(0)
    return q, (d[..., None] * sc.float()).reshape(N, -1), (dmin[..., None] * m.float()).reshape(N, -1)


def dequantize_rows(blocks: Tensor, K: int) -> Tensor:
    """Q4_K super-blocks (N, K/256 * 144) uint8 -> the weights (N, K) fp32 they hold."""
    q, scale, offset = unpack(blocks, K)
    N = q.size(0)
    return (scale[..., None] * q.view(N, -1, SUB).float() - offset[..., None]).view(N, K)


def _group_order(n: int, supers: int) -> Tensor:
    """For a group of n rows of `supers` super-blocks: index i of the grouped bytes (n * supers * 144)
    -> the index in the rows' own bytes it comes from."""
    rows = torch.arange(n * supers * BYTES).view(n, supers, BYTES)
    d, dmin = rows[..., 0:2].transpose(0, 1), rows[..., 2:4].transpose(0, 1)  # (supers, n, 2)
    scales = rows[..., 4:16].permute(1, 2, 0)  # (supers, 12, n)
    quads = rows[..., 16:].reshape(n, supers, 32, 4).permute(1, 2, 0, 3)  # (supers, quad, n, 4)
    return torch.cat([part.reshape(supers, -1) for part in (d, dmin, scales, quads)], dim=1).reshape(-1)


def _regroup(blocks: Tensor, inverse: bool) -> Tensor:
    N, width = blocks.shape
    out = torch.empty_like(blocks)
    whole = N // GROUP * GROUP
    for start, end in ((0, whole), (whole, N)):  # the whole groups, then the rows left
        if end > start:
            n = min(GROUP, end - start)
            order = _group_order(n, width // BYTES)
            if inverse:
                order = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
            out[start:end] = blocks[start:end].reshape(-1, n * width)[:, order].view(-1, width)
    return out


def group_rows(blocks: Tensor) -> Tensor:
    """Q4_K super-blocks (N, K/256 * 144) uint8, each row's own -> the same bytes by groups of GROUP
    rows (the module docstring), in a tensor of the same shape."""
    return _regroup(blocks, inverse=False)


def ungroup_rows(grouped: Tensor) -> Tensor:
    """group_rows undone: each row's own Q4_K super-blocks (N, K/256 * 144) uint8."""
    return _regroup(grouped, inverse=True)
