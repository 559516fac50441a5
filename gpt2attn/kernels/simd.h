// The vector pieces of decode.cpp: widening 8 weights to fp32, a horizontal sum, the
// quantization of activations in blocks of 32 (llama.cpp's q8_0 layout) or, for Q4_K rows, of 256
// (its Q8_K), and the inner loop of every (N, K) rows product: four rows' dot products with one
// input row (dot4) or a tile of input rows (dot4_q8, dot_q4k).
//
// AVX2, FMA and F16C always; where the build has AVX-512 (F, BW, VL, DQ and VNNI: the kernels are
// built with those flags on a CPU that has them), dot4 and dot4_q8 take 16 floats or 64 int8 a
// step, and the int8 products one VNNI instruction (vpdpbusd) per 64 bytes instead of three.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace gpt2attn {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// 8 weights widened to fp32: fp16 with F16C, bf16 by a 16-bit shift
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p, bool bf16) {
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
template <typename T> inline __m256 load(const T* p, bool bf16);
template <> inline __m256 load<float>(const float* p, bool) { return load8(p); }
template <> inline __m256 load<uint16_t>(const uint16_t* p, bool bf16) { return load8(p, bf16); }
inline float widen(float v, bool) { return v; }
inline float widen(uint16_t v, bool bf16) {
    if (!bf16) return _cvtsh_ss(v);
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 weights widened to fp32 (AVX-512)
inline __m512 load16(const float* p, bool) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p, bool bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i*)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#endif

// The largest |x| of n floats (n a multiple of 8)
inline float abs_max(const float* p, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

// 32 floats p -> q = round-half-even(p / scale) (0s for a zero scale: the block is all zeros);
// returns the sum of the 32 q
inline int32_t round32(const float* p, float scale, int8_t* q) {
    const __m256 d = _mm256_set1_ps(scale == 0.0f ? 1.0f : scale);
    __m256i lanes[4];
    for (int i = 0; i < 4; i++)
        lanes[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(p + 8 * i), d),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i v = _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]), _mm256_packs_epi32(lanes[2], lanes[3]));
    v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // packs interleave lanes
    _mm256_storeu_si256((__m256i*)q, v);
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(lanes[0]), _mm256_extracti128_si256(lanes[0], 1));
    for (int i = 1; i < 4; i++)
        sum = _mm_add_epi32(sum, _mm_add_epi32(_mm256_castsi256_si128(lanes[i]), _mm256_extracti128_si256(lanes[i], 1)));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1))));
}

// n_blocks blocks of 32 floats x -> q (32 int8 each) and scales (one each): scale = max|x| / 127,
// q = round-half-even(x / scale) (0 where the block is all zeros), as the torch reference does.
inline void quantize_q8(const float* x, int64_t n_blocks, int8_t* q, float* scales) {
    for (int64_t j = 0; j < n_blocks; j++) {
        scales[j] = abs_max(x + 32 * j, 32) / 127.0f;
        round32(x + 32 * j, scales[j], q + 32 * j);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define GPT2ATTN_AVX512 1
#endif

// A rows product reads its four rows as four streams; each step asks for the bytes PREFETCH_AHEAD
// ahead in each (the hardware prefetcher alone keeps fewer reads in flight). Measured on Zen 4 in
// A/B runs of one-call steps (2026-11-27): 256 bytes beat 2048 by 2-7% when memory read at
// 32 GB/s and by 6-14% when it read at 50 GB/s; 128 and 384 were within 1-3% of 256.
constexpr int64_t PREFETCH_AHEAD = 256;
inline void prefetch4(const void* w0, const void* w1, const void* w2, const void* w3, int64_t offset) {
    for (const void* w : {w0, w1, w2, w3}) _mm_prefetch((const char*)w + offset + PREFETCH_AHEAD, _MM_HINT_T0);
}

// out[i] = the sum of accumulator i's lanes (and, add4, plus those of a 16-lane accumulator)
inline void sum4(float* out, __m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
}
#ifdef GPT2ATTN_AVX512
inline void add4(float* out, __m512 b0, __m512 b1, __m512 b2, __m512 b3) {
    out[0] += _mm512_reduce_add_ps(b0), out[1] += _mm512_reduce_add_ps(b1);
    out[2] += _mm512_reduce_add_ps(b2), out[3] += _mm512_reduce_add_ps(b3);
}
#endif

// out[i] = x (K) . w[i] (K) for the four rows w[i] = w0 + i * stride; K a multiple of 8.
// `prefetch`: ask for each row's bytes ahead (once per weight row, not for every input row).
template <typename T, bool bf16>
inline void dot4(const float* x, const T* w0, int64_t stride, int64_t K, bool prefetch, float* out) {
    const T *w1 = w0 + stride, *w2 = w1 + stride, *w3 = w2 + stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
#ifdef GPT2ATTN_AVX512
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
    for (; k + 16 <= K; k += 16) {
        if (prefetch) prefetch4(w0, w1, w2, w3, k * (int64_t)sizeof(T));
        const __m512 xv = _mm512_loadu_ps(x + k);
        b0 = _mm512_fmadd_ps(xv, load16(w0 + k, bf16), b0);
        b1 = _mm512_fmadd_ps(xv, load16(w1 + k, bf16), b1);
        b2 = _mm512_fmadd_ps(xv, load16(w2 + k, bf16), b2);
        b3 = _mm512_fmadd_ps(xv, load16(w3 + k, bf16), b3);
    }
#endif
    for (; k < K; k += 8) {
        if (prefetch) prefetch4(w0, w1, w2, w3, k * (int64_t)sizeof(T));
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, load<T>(w0 + k, bf16), a0);
        a1 = _mm256_fmadd_ps(xv, load<T>(w1 + k, bf16), a1);
        a2 = _mm256_fmadd_ps(xv, load<T>(w2 + k, bf16), a2);
        a3 = _mm256_fmadd_ps(xv, load<T>(w3 + k, bf16), a3);
    }
    sum4(out, a0, a1, a2, a3);
#ifdef GPT2ATTN_AVX512
    add4(out, b0, b1, b2, b3);
#endif
}

// The int8 products, one step at a time: Q8_STEP blocks of 32 of an input row (q8_row), of each
// weight row (q8_weights), then q8_madd: acc += the blocks' scales * (each block's 32 products,
// summed exactly in int32). The u8 x s8 instructions take one side unsigned:
//   AVX-512: two blocks a step (lanes 0-7 sum the first, 8-15 the second; a last step of an odd
//            count loads one), one VNNI vpdpbusd per 64 bytes of (w + 128) as u8 times x, started
//            from -128 x (so exactly w x), summed per 4 bytes;
//   AVX2:    one block a step, |x| as u8 times w carrying x's sign (maddubs: pairs in int16, which
//            127 x 127 x 2 cannot overflow), then madd.
#ifdef GPT2ATTN_AVX512
using Q8Acc = __m512;
using Q8Bytes = __m512i;
constexpr int64_t Q8_STEP = 2;
constexpr int Q8_ROWS = 4;  // input rows a dot4_q8 tile takes at once (16 accumulators of 32 registers)
struct Q8Row {
    __m512i xv, start;  // x, and -128 x summed per 4 bytes
    __m512 s;           // the blocks' scales, 8 lanes each
};
// Q8_STEP blocks of an int8 row from p (one, where `blocks`, those left, is 1)
inline __m512i q8_load(const int8_t* p, int64_t blocks) {
    return _mm512_maskz_loadu_epi8(blocks >= 2 ? ~0ULL : 0xFFFFFFFFULL, p);
}
inline Q8Bytes q8_weights(const int8_t* w, int64_t blocks) {
    return _mm512_xor_si512(q8_load(w, blocks), _mm512_set1_epi8((char)0x80));  // w + 128, as u8
}
inline Q8Row q8_row(const int8_t* xq, const float* xs, int64_t blocks) {
    const __m512i xv = q8_load(xq, blocks), zero = _mm512_setzero_si512();
    const __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)0x80), xv));
    return {xv, start, _mm512_insertf32x8(_mm512_set1_ps(xs[0]), _mm256_set1_ps(blocks >= 2 ? xs[1] : 0.0f), 1)};
}
inline Q8Acc q8_madd(const Q8Row& x, Q8Bytes w, Q8Acc acc) {
    return _mm512_fmadd_ps(x.s, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(x.start, w, x.xv)), acc);
}
inline float q8_sum(Q8Acc acc) { return _mm512_reduce_add_ps(acc); }
#else
using Q8Acc = __m256;
using Q8Bytes = __m256i;
constexpr int64_t Q8_STEP = 1;
constexpr int Q8_ROWS = 2;  // input rows a dot4_q8 tile takes at once (8 accumulators of 16 registers)
struct Q8Row {
    __m256i xv, ax;  // x, |x|
    __m256 s;        // the block's scale
};
inline Q8Bytes q8_weights(const int8_t* w, int64_t) { return _mm256_loadu_si256((const __m256i*)w); }
inline Q8Row q8_row(const int8_t* xq, const float* xs, int64_t) {
    const __m256i xv = _mm256_loadu_si256((const __m256i*)xq);
    return {xv, _mm256_sign_epi8(xv, xv), _mm256_set1_ps(xs[0])};
}
inline Q8Acc q8_madd(const Q8Row& x, Q8Bytes w, Q8Acc acc) {
    const __m256i pairs = _mm256_maddubs_epi16(x.ax, _mm256_sign_epi8(w, x.xv));
    return _mm256_fmadd_ps(x.s, _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1))), acc);
}
inline float q8_sum(Q8Acc acc) { return hsum(acc); }
#endif

// out[m * 4 + i] = sum over blocks j of xs[m][j] * (xq[m] . w[i]) over block j's 32 values, for
// MT input rows m (xq, xs: rows K and K / 32 apart) and the four int8 rows w[i] = w0 + i * stride;
// K a multiple of 32. Each step loads the four rows' bytes once for all MT input rows (decoding
// takes a tile of its few rows, a prompt Q8_ROWS at a time).
template <int MT>
inline void dot4_q8(const int8_t* xq, const float* xs, const int8_t* w0, int64_t stride, int64_t K, bool prefetch,
                    float* out) {
    const int8_t* w[4] = {w0, w0 + stride, w0 + 2 * stride, w0 + 3 * stride};
    const int64_t nb = K / 32;
    Q8Acc acc[MT][4] = {};
    for (int64_t j = 0; j < nb; j += Q8_STEP) {
        if (prefetch)
            for (int64_t b = 0; b < Q8_STEP; b++) prefetch4(w[0], w[1], w[2], w[3], (j + b) * 32);
        Q8Bytes wv[4];
        for (int i = 0; i < 4; i++) wv[i] = q8_weights(w[i] + 32 * j, nb - j);
        for (int m = 0; m < MT; m++) {
            const Q8Row x = q8_row(xq + m * K + 32 * j, xs + m * nb + j, nb - j);
            for (int i = 0; i < 4; i++) acc[m][i] = q8_madd(x, wv[i], acc[m][i]);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int i = 0; i < 4; i++) out[m * 4 + i] = q8_sum(acc[m][i]);
}

// Q4_K rows (llama.cpp's block_q4_K, gpt2attn/q4_k.py): each row K/256 super-blocks of 144
// bytes: d and dmin (fp16), twelve bytes of 6-bit scales sc and mins m (eight each, one pair per
// sub-block of 32), 128 bytes of nibbles q (byte l of chunk c: value 64c + l low, 64c + 32 + l
// high). Weight i of sub-block s is (d sc[s]) q[i] - (dmin m[s]).
constexpr int64_t Q4K_BYTES = 144;

// The order in which the kernel reads the eight sub-blocks of x (and their sums): on AVX-512, 64
// bytes of levels at a time, whose low nibbles are sub-blocks 0 and 2 (4 and 6), high 1 and 3 (5
// and 7), so x's blocks are laid out in that order (quantize_q8k); on AVX2, as they are.
#ifdef GPT2ATTN_AVX512
constexpr int Q4K_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};
#else
constexpr int Q4K_ORDER[8] = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

// x for Q4_K rows as llama.cpp's Q8_K: n_super super-blocks of 256 floats -> q (256 int8 each,
// its blocks of 32 in Q4K_ORDER), d (one scale each: max|x| / 127, q = round-half-even(x / d))
// and bsums (each block's sum of q, in that order too: what the mins take from x)
inline void quantize_q8k(const float* x, int64_t n_super, int8_t* q, float* d, int16_t* bsums) {
    for (int64_t j = 0; j < n_super; j++) {
        d[j] = abs_max(x + 256 * j, 256) / 127.0f;
        for (int s = 0; s < 8; s++)
            bsums[8 * j + s] = (int16_t)round32(x + 256 * j + 32 * Q4K_ORDER[s], d[j], q + 256 * j + 32 * s);
    }
}

// The 6-bit sc and m of a super-block as 16 bytes: sc in bytes 0-7 and m in 8-15, each in
// Q4K_ORDER. They are unpacked in one vector from the twelve bytes u0, u1, u2 (as 32-bit words)
// after d and dmin: sc 0-3 are u0's low 6 bits, sc 4-7 u2's low nibbles with u0's top 2 bits
// above them; the mins the same from u1 and u2's high nibbles.
inline __m128i q4k_scale_bytes(const uint8_t* block) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)block);                  // d and dmin, u0, u1, u2
    const __m128i own = _mm_shuffle_epi32(raw, _MM_SHUFFLE(2, 2, 1, 1));         // u0 u0 u1 u1
    const __m128i nibbles = _mm_shuffle_epi32(raw, _MM_SHUFFLE(3, 3, 3, 3));     // u2 u2 u2 u2
    const __m128i bytes = _mm_or_si128(  // sc 0-3, sc 4-7, m 0-3, m 4-7
        _mm_and_si128(_mm_srlv_epi32(own, _mm_setr_epi32(0, 2, 0, 2)),
                      _mm_setr_epi32(0x3f3f3f3f, 0x30303030, 0x3f3f3f3f, 0x30303030)),
        _mm_and_si128(_mm_srlv_epi32(nibbles, _mm_setr_epi32(0, 0, 0, 4)), _mm_setr_epi32(0, 0x0f0f0f0f, 0, 0x0f0f0f0f)));
#ifdef GPT2ATTN_AVX512
    return _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));  // Q4K_ORDER
#else
    return bytes;
#endif
}

// What a super-block's products with x need from it, unpacked once for every row of x: its levels
// as bytes, its scales sc as int16 lanes beside the levels they scale, its mins m as eight int16,
// d and dmin. With x's 256 values there as int8 xq (Q4K_ORDER), d_x and bsums, the product is
//     d_x (d sum_s sc[s] (xq . q over sub-block s) - dmin sum_s m[s] bsums[s])
// with both sums exact in int32 and one float multiply-add for each; q4k_accumulate adds the
// first to acc and subtracts the second from it. The levels are u8 and x s8 (maddubs: pairs in
// int16, which 15 x 127 x 2 cannot overflow); then the scales multiply the pairs and sum them into
// int32 lanes: on AVX-512 one VNNI vpdpwssd per 64 bytes, each's lanes 0-7 in one sub-block and
// 8-15 in another; on AVX2 madd and add per 32.
struct Q4KBlock {
#ifdef GPT2ATTN_AVX512
    __m512i levels[4];  // the low nibbles of bytes 0-63, their high nibbles, the same of bytes 64-127
    __m512i scales[4];  // for each: sc of its first sub-block in int16 lanes 0-15, its second in 16-31
#else
    __m256i levels[8];  // sub-block s: the low nibbles of chunk s / 2's 32 bytes (s even), or their high
    __m256i scales;     // sc 0-7 as int16, in both halves
#endif
    __m128i mins;       // m 0-7 as int16
    float d, dmin;
};

// int16 lane i of each 128 bits of v (eight int16) into every int16 lane of those 128 bits: the
// bytes 2i, 2i + 1 picked over and over
constexpr int32_t pick16(int i) { return (2 * i) | (2 * i + 1) << 8 | (2 * i) << 16 | (2 * i + 1) << 24; }

inline Q4KBlock q4k_block(const uint8_t* block) {
    Q4KBlock u;
    const __m128i bytes = q4k_scale_bytes(block);
    const __m128i sc = _mm_cvtepu8_epi16(bytes);
    u.mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(bytes, bytes));
    const __m128 d_dmin = _mm_cvtph_ps(_mm_loadu_si128((const __m128i*)block));
    u.d = _mm_cvtss_f32(d_dmin), u.dmin = _mm_cvtss_f32(_mm_movehdup_ps(d_dmin));
#ifdef GPT2ATTN_AVX512
    const __m512i low4 = _mm512_set1_epi8(0x0F), wide = _mm512_broadcast_i32x4(sc);
    for (int h = 0; h < 2; h++) {
        const __m512i raw = _mm512_loadu_si512(block + 16 + 64 * h);
        u.levels[2 * h] = _mm512_and_si512(raw, low4), u.levels[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    for (int k = 0; k < 4; k++) {  // levels[k] holds the sub-blocks at 2k and 2k + 1 of Q4K_ORDER
        const __m512i first = _mm512_castsi256_si512(_mm256_set1_epi32(pick16(2 * k)));  // int16 lanes 0-15
        u.scales[k] = _mm512_shuffle_epi8(wide, _mm512_inserti64x4(first, _mm256_set1_epi32(pick16(2 * k + 1)), 1));
    }
#else
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(block + 16 + 32 * c));
        u.levels[2 * c] = _mm256_and_si256(raw, low4), u.levels[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    }
    u.scales = _mm256_broadcastsi128_si256(sc);
#endif
    return u;
}

// acc += the super-block's product with x's (xq, its 256 values; d_x; bsums, its 8 sums), spread
// over acc's lanes
#ifdef GPT2ATTN_AVX512
using Q4KAcc = __m512;
inline void q4k_accumulate(const Q4KBlock& u, const int8_t* xq, float d_x, const int16_t* bsums, Q4KAcc& acc) {
    __m512i dots = _mm512_setzero_si512();  // sum_s sc[s] (xq . q over s), spread over the lanes
    for (int k = 0; k < 4; k++)
        dots = _mm512_dpwssd_epi32(dots, _mm512_maddubs_epi16(u.levels[k], _mm512_loadu_si512(xq + 64 * k)), u.scales[k]);
    const __m128i mins = _mm_madd_epi16(u.mins, _mm_loadu_si128((const __m128i*)bsums));  // sum_s m[s] bsums[s], 4 lanes
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(u.d * d_x), acc);
    acc = _mm512_fnmadd_ps(_mm512_zextps128_ps512(_mm_cvtepi32_ps(mins)), _mm512_set1_ps(u.dmin * d_x), acc);
}
inline float q4k_sum(__m512 acc) { return _mm512_reduce_add_ps(acc); }
#else
using Q4KAcc = __m256;
inline void q4k_accumulate(const Q4KBlock& u, const int8_t* xq, float d_x, const int16_t* bsums, Q4KAcc& acc) {
    __m256i dots = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        const __m256i pairs = _mm256_maddubs_epi16(u.levels[s], _mm256_loadu_si256((const __m256i*)(xq + 32 * s)));
        dots = _mm256_add_epi32(dots, _mm256_madd_epi16(pairs, _mm256_shuffle_epi8(u.scales, _mm256_set1_epi32(pick16(s)))));
    }
    const __m128i mins = _mm_madd_epi16(u.mins, _mm_loadu_si128((const __m128i*)bsums));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(u.d * d_x), acc);
    acc = _mm256_fnmadd_ps(_mm256_zextps128_ps256(_mm_cvtepi32_ps(mins)), _mm256_set1_ps(u.dmin * d_x), acc);
}
inline float q4k_sum(__m256 acc) { return hsum(acc); }
#endif

// out[b * b_stride + i * i_stride] = x_b . w[i] for R Q4_K rows w[i] = w0 + i * stride (bytes) and
// NB rows x_b of x (K, a multiple of 256) as quantize_q8k gives it: row b at xq + b K, d + b K / 256
// and bsums + b K / 32; the same sums as the reference in fp32 rounding. Each super-block of w is
// unpacked once for the NB rows of x.
template <int NB, int R>
inline void dot_q4k(const int8_t* xq, const float* d, const int16_t* bsums, int64_t K, const uint8_t* w0,
                    int64_t stride, bool prefetch, float* out, int64_t b_stride, int64_t i_stride) {
    const int64_t n_super = K / 256;
    Q4KAcc acc[NB][R];
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < R; i++) acc[b][i] = Q4KAcc{};
    for (int64_t j = 0; j < n_super; j++) {
        if (prefetch && R == 4)
            for (int64_t part = 0; part < Q4K_BYTES; part += 48)
                prefetch4(w0, w0 + stride, w0 + 2 * stride, w0 + 3 * stride, j * Q4K_BYTES + part);
        for (int i = 0; i < R; i++) {
            const Q4KBlock u = q4k_block(w0 + i * stride + j * Q4K_BYTES);
            for (int b = 0; b < NB; b++)
                q4k_accumulate(u, xq + b * K + 256 * j, d[b * n_super + j], bsums + b * (K / 32) + 8 * j, acc[b][i]);
        }
    }
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < R; i++) out[b * b_stride + i * i_stride] = q4k_sum(acc[b][i]);
}

// dot_q4k for B rows of x, four at a time
template <int R>
inline void dot_q4k(const int8_t* xq, const float* d, const int16_t* bsums, int64_t B, int64_t K, const uint8_t* w0,
                    int64_t stride, float* out, int64_t b_stride, int64_t i_stride) {
    for (int64_t b = 0; b < B; b += 4) {
        const int8_t* q = xq + b * K;
        const float* db = d + b * (K / 256);
        const int16_t* sums = bsums + b * (K / 32);
        float* o = out + b * b_stride;
        switch (B - b < 4 ? B - b : 4) {  // the weights asked for ahead once, with the first rows of x
            case 1: dot_q4k<1, R>(q, db, sums, K, w0, stride, b == 0, o, b_stride, i_stride); break;
            case 2: dot_q4k<2, R>(q, db, sums, K, w0, stride, b == 0, o, b_stride, i_stride); break;
            case 3: dot_q4k<3, R>(q, db, sums, K, w0, stride, b == 0, o, b_stride, i_stride); break;
            default: dot_q4k<4, R>(q, db, sums, K, w0, stride, b == 0, o, b_stride, i_stride);
        }
    }
}

// A prompt's products (more than a few rows): register tiles of outputs, each weight loaded into a
// register once for MT rows of x. `Vec` is one register of LANES floats.
//   cols_tile: Conv1D's (K, N) weight, MT rows of x by V registers of a weight row: each step
//              broadcasts x[m][k] and adds it times W[k] into MT x V accumulators (no sums across
//              lanes; the outputs come out as rows)
//   rows_tile: an (N, K) weight of fp32, fp16 or bf16, NT weight rows by MT rows of x: each step
//              widens LANES values of each weight row once for the MT rows of x; NT x MT
//              accumulators, each summed across its lanes at the end
// Tile sizes measured on gpt2-small's 48 block products at 128 rows, 2 threads, AMD EPYC Zen 4
// (2026-11-27), GFLOP/s: AVX-512 cols 8 x 3 183-188 (6 x 4: 171, 12 x 2: 131), rows 6 x 4 on fp16
// 188-190 (4 x 6: 160, 2 x 12: 130); the AVX2 build on the same CPU cols 6 x 2 167 (4 x 3: 169),
// rows 3 x 4 174 (3 x 3: 165, 4 x 2: 169), where MKL's fp32 product made 167 with AVX2 alone.
#ifdef GPT2ATTN_AVX512
using Vec = __m512;
constexpr int LANES = 16;
constexpr int COLS_MT = 8, COLS_V = 3, ROWS_NT = 6, ROWS_MT = 4;  // 24 accumulators of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p, bool = false) { return _mm512_loadu_ps(p); }
inline Vec vload(const uint16_t* p, bool bf16) { return load16(p, bf16); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
using Vec = __m256;
constexpr int LANES = 8;
constexpr int COLS_MT = 6, COLS_V = 2, ROWS_NT = 3, ROWS_MT = 4;  // 12 accumulators of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p, bool = false) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p, bool bf16) { return load8(p, bf16); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum(v); }
#endif

// y[m][0 : V * LANES] for the MT rows m of x (K apart) and y (y_stride apart): start from bias (or,
// unless `first`, from y itself: an earlier block of k's sums), then add x[m][k] w[k][...] for k in
// [k0, k1), the rows of w N apart.
template <int MT, int V>
inline void cols_tile(const float* x, int64_t K, const float* w, int64_t N, int64_t k0, int64_t k1,
                      const float* bias, bool first, float* y, int64_t y_stride) {
    Vec acc[MT][V];
    for (int m = 0; m < MT; m++)
        for (int v = 0; v < V; v++)
            acc[m][v] = !first ? vload(y + m * y_stride + v * LANES) : bias ? vload(bias + v * LANES) : vzero();
    for (int64_t k = k0; k < k1; k++) {
        Vec wk[V];
        for (int v = 0; v < V; v++) wk[v] = vload(w + k * N + v * LANES);
        for (int m = 0; m < MT; m++) {
            const Vec xm = vset1(x[m * K + k]);
            for (int v = 0; v < V; v++) acc[m][v] = vfma(xm, wk[v], acc[m][v]);
        }
    }
    for (int m = 0; m < MT; m++)
        for (int v = 0; v < V; v++) vstore(y + m * y_stride + v * LANES, acc[m][v]);
}

// sums[n * MT + m] = x[m] . w[n] (K values each) for the NT rows n of w and the MT rows m of x,
// both K apart
template <typename T, bool bf16, int NT, int MT>
inline void rows_tile(const float* x, const T* w, int64_t K, float* sums) {
    Vec acc[NT][MT];
    for (int n = 0; n < NT; n++)
        for (int m = 0; m < MT; m++) acc[n][m] = vzero();
    const int64_t vec_end = K / LANES * LANES;
    for (int64_t k = 0; k < vec_end; k += LANES) {
        Vec wk[NT];
        for (int n = 0; n < NT; n++) wk[n] = vload(w + n * K + k, bf16);
        for (int m = 0; m < MT; m++) {
            const Vec xm = vload(x + m * K + k);
            for (int n = 0; n < NT; n++) acc[n][m] = vfma(wk[n], xm, acc[n][m]);
        }
    }
    for (int n = 0; n < NT; n++)
        for (int m = 0; m < MT; m++) {
            float s = vsum(acc[n][m]);
            for (int64_t k = vec_end; k < K; k++) s += widen(w[n * K + k], bf16) * x[m * K + k];
            sums[n * MT + m] = s;
        }
}

}  // namespace gpt2attn
