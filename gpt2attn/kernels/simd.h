// The vector pieces of decode.cpp: widening 8 weights to fp32, a horizontal sum, the
// quantization of activations in blocks of 32 (llama.cpp's q8_0 layout), and the inner loop of
// every (N, K) rows product: four rows' dot products with one input row (dot4) or a tile of input
// rows (dot4_q8).
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

// n_blocks blocks of 32 floats x -> q (32 int8 each) and scales (one each): scale = max|x| / 127,
// q = round-half-even(x / scale) (0 where the block is all zeros), as the torch reference does.
inline void quantize_q8(const float* x, int64_t n_blocks, int8_t* q, float* scales) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t j = 0; j < n_blocks; j++) {
        const float* p = x + j * 32;
        __m256 top = _mm256_setzero_ps();
        for (int i = 0; i < 32; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float scale = _mm_cvtss_f32(h) / 127.0f;
        scales[j] = scale;
        const __m256 d = _mm256_set1_ps(scale == 0.0f ? 1.0f : scale);
        __m256i lanes[4];
        for (int i = 0; i < 4; i++)
            lanes[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(p + 8 * i), d),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i v = _mm256_packs_epi16(_mm256_packs_epi32(lanes[0], lanes[1]), _mm256_packs_epi32(lanes[2], lanes[3]));
        v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // packs interleave lanes
        _mm256_storeu_si256((__m256i*)(q + j * 32), v);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define GPT2ATTN_AVX512 1
#endif

// A rows product reads its four rows as four streams; each step asks for the bytes PREFETCH_AHEAD
// ahead in each (the hardware prefetcher alone keeps fewer reads in flight).
constexpr int64_t PREFETCH_AHEAD = 2048;
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

}  // namespace gpt2attn
