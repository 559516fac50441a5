// The vector pieces of decode.cpp: widening 8 weights to fp32, a horizontal sum, the
// quantization of activations in blocks of 32 (llama.cpp's q8_0 layout) or, for Q4_K rows, of 256
// (its Q8_K), and the inner loop of every (N, K) rows product: four rows' dot products with one
// input row (dot4), or those of a group of 16 int8 rows (dot_q8g) or 16 Q4_K rows (dot_q4k).
//
// AVX2, FMA and F16C always; where the build has AVX-512 (F, BW, VL, DQ and VNNI: the kernels are
// built with those flags on a CPU that has them), dot4 takes 16 floats a step, and the int8
// products one VNNI instruction (vpdpbusd) per 64 bytes instead of several.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <initializer_list>  // prefetch4's loop over its four rows

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
// q = round-half-even(x / scale) (0 where the block is all zeros), as the torch reference does;
// and, where sums is given, each block's sum of q (what dot_q8g's unsigned weights take back).
inline void quantize_q8(const float* x, int64_t n_blocks, int8_t* q, float* scales, int32_t* sums = nullptr) {
    for (int64_t j = 0; j < n_blocks; j++) {
        scales[j] = abs_max(x + 32 * j, 32) / 127.0f;
        const int32_t sum = round32(x + 32 * j, scales[j], q + 32 * j);
        if (sums) sums[j] = sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define GPT2ATTN_AVX512 1
#endif

// A rows product reads its four rows as four streams; each step asks for the bytes PREFETCH_AHEAD
// ahead in each (the hardware prefetcher alone keeps fewer reads in flight). Measured on Zen 4 in
// A/B runs of one-call steps (2026-11-27): 256 bytes beat 2048 by 2-7% when memory read at
// 32 GB/s and by 6-14% when it read at 50 GB/s; 128 and 384 were within 1-3% of 256. The build
// sets another distance where a CPU measured better with one (gpt2attn.kernels.PREFETCH_AHEAD).
#ifndef GPT2ATTN_PREFETCH_AHEAD
#define GPT2ATTN_PREFETCH_AHEAD 256
#endif
constexpr int64_t PREFETCH_AHEAD = GPT2ATTN_PREFETCH_AHEAD;
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
// `prefetch`: ask for each row's bytes ahead (once per weight row, not for every input row), once
// per 64 bytes of it. Asked for every 16 or 8 weights instead (each line of a 16-bit row two or four
// times), one-call steps took longer (Intel Emerald Rapids VM, 2 threads, A/B in one process,
// 2026-11-29): gpt2-small from memory, fp16 1.5% (AVX-512) and 2.8% (AVX2), bf16 within a point; a
// 4-layer model held in the L3, fp16 and bf16 0.7-1.7% and 2.5-4.5%. (On the Zen 5 VM, a prefetch a
// line instead of two moved its fast memory state by less than a point.) The sums are the same.
template <typename T, bool bf16>
inline void dot4(const float* x, const T* w0, int64_t stride, int64_t K, bool prefetch, float* out) {
    constexpr int64_t LINE = 64 / sizeof(T);  // weights in 64 bytes of a row
    const T *w1 = w0 + stride, *w2 = w1 + stride, *w3 = w2 + stride;
    int64_t k = 0;
#ifdef GPT2ATTN_AVX512
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
    auto step16 = [&](int64_t j) {
        const __m512 xv = _mm512_loadu_ps(x + j);
        b0 = _mm512_fmadd_ps(xv, load16(w0 + j, bf16), b0);
        b1 = _mm512_fmadd_ps(xv, load16(w1 + j, bf16), b1);
        b2 = _mm512_fmadd_ps(xv, load16(w2 + j, bf16), b2);
        b3 = _mm512_fmadd_ps(xv, load16(w3 + j, bf16), b3);
    };
    for (; k + LINE <= K; k += LINE) {
        if (prefetch) prefetch4(w0, w1, w2, w3, k * (int64_t)sizeof(T));
        for (int64_t j = k; j < k + LINE; j += 16) step16(j);
    }
    for (; k + 16 <= K; k += 16) step16(k);  // (within the last 64 bytes, asked for already)
#endif
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    auto step8 = [&](int64_t j) {
        const __m256 xv = _mm256_loadu_ps(x + j);
        a0 = _mm256_fmadd_ps(xv, load<T>(w0 + j, bf16), a0);
        a1 = _mm256_fmadd_ps(xv, load<T>(w1 + j, bf16), a1);
        a2 = _mm256_fmadd_ps(xv, load<T>(w2 + j, bf16), a2);
        a3 = _mm256_fmadd_ps(xv, load<T>(w3 + j, bf16), a3);
    };
    for (; k + LINE <= K; k += LINE) {
        if (prefetch) prefetch4(w0, w1, w2, w3, k * (int64_t)sizeof(T));
        for (int64_t j = k; j < k + LINE; j += 8) step8(j);
    }
    for (; k < K; k += 8) step8(k);
    sum4(out, a0, a1, a2, a3);
#ifdef GPT2ATTN_AVX512
    add4(out, b0, b1, b2, b3);
#endif
}

// The rows of int8 and Q4_K matrices are laid out by groups of GROUP_ROWS, so that one 64-byte
// load holds the same few weights of each row of a group and each row sums in its own lane.
constexpr int64_t GROUP_ROWS = 16;

// int8 rows in groups (gpt2attn.kernels.group_rows_q8): a group of n rows is K / 4 quads of 4 n
// bytes, quad p holding bytes 4p .. 4p + 3 of row r at 4r, each weight w stored as the unsigned
// byte w + 128; so one 64-byte load holds the same four weights of 16 rows. A last group of fewer
// rows (N not a multiple of 16) is copied into 16 rows' layout, its missing rows zeros, before it
// is read (q8_pad_group).

// The last group's n < 16 rows (from `group`, K values each) laid out as a whole group's in `padded`
// (16 K bytes), rows n..15 zeros
inline void q8_pad_group(const uint8_t* group, int64_t n, int64_t K, uint8_t* padded) {
    memset(padded, 0, GROUP_ROWS * K);
    for (int64_t p = 0; p < K / 4; p++) memcpy(padded + 64 * p, group + 4 * n * p, 4 * n);
}

// out[16 g + r] = sum over blocks j of xs[j] * (x . row r of group g over block j's 32 values), for
// the groups g = 0..NG-1 at group0 + g * stride, x quantized in blocks of 32 (xq, xs) with each
// block's sum of xq (xsums); K a multiple of 32. Each block's products are summed exactly in int32,
// row r's in lane r, then times xs[j] into an fp32 lane: the same sums, in the same order, in
// both builds and whatever the rows around.
//   AVX-512: one VNNI vpdpbusd per 64 bytes ((w + 128) as u8 times x's four bytes broadcast),
//            started from -128 times the block's sum of x, so exactly w . x;
//   AVX2:    per 32 bytes (8 rows), w back to signed, |x| times w carrying x's sign (maddubs:
//            pairs in int16, which 127 x 127 x 2 cannot overflow), then madd into int32.
template <int NG>
inline void dot_q8g(const int8_t* xq, const float* xs, const int32_t* xsums, int64_t K, const uint8_t* group0,
                    int64_t stride, float* out) {
    const int32_t* x4 = (const int32_t*)xq;  // x four bytes at a time
#ifdef GPT2ATTN_AVX512
    __m512 acc[NG];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 32; j++) {
        const __m512i start = _mm512_set1_epi32(-128 * xsums[j]);
        __m512i dots[NG];
        for (auto& v : dots) v = start;
        for (int t = 0; t < 8; t++) {
            const __m512i xv = _mm512_set1_epi32(x4[8 * j + t]);
            for (int g = 0; g < NG; g++)
                dots[g] = _mm512_dpbusd_epi32(dots[g], _mm512_loadu_si512(group0 + g * stride + 64 * (8 * j + t)), xv);
        }
        const __m512 scale = _mm512_set1_ps(xs[j]);
        for (int g = 0; g < NG; g++) acc[g] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dots[g]), acc[g]);
    }
    for (int g = 0; g < NG; g++) _mm512_storeu_ps(out + 16 * g, acc[g]);
#else
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[NG][2];
    for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 32; j++) {
        __m256i dots[NG][2];
        for (auto& d : dots) d[0] = d[1] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i xv = _mm256_set1_epi32(x4[8 * j + t]), ax = _mm256_sign_epi8(xv, xv);
            for (int g = 0; g < NG; g++)
                for (int h = 0; h < 2; h++) {  // rows 0-7, then 8-15
                    const __m256i w = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i*)(group0 + g * stride + 64 * (8 * j + t) + 32 * h)), flip);
                    const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, xv));
                    dots[g][h] = _mm256_add_epi32(dots[g][h], _mm256_madd_epi16(pairs, ones));
                }
        }
        const __m256 scale = _mm256_set1_ps(xs[j]);
        for (int g = 0; g < NG; g++)
            for (int h = 0; h < 2; h++) acc[g][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dots[g][h]), acc[g][h]);
    }
    for (int g = 0; g < NG; g++) _mm256_storeu_ps(out + 16 * g, acc[g][0]), _mm256_storeu_ps(out + 16 * g + 8, acc[g][1]);
#endif
}

// Q4_K rows (llama.cpp's block_q4_K, gpt2attn/q4_k.py) in groups of GROUP_ROWS rows: each row K/256
// super-blocks of 144 bytes (d and dmin in fp16, twelve bytes of 6-bit scales sc and mins m, one
// pair per sub-block of 32, and 128 bytes of nibbles q), weight i of sub-block s being
// (d sc[s]) q[i] - (dmin m[s]). The kernels read the same bytes laid out by group
// (gpt2attn.q4_k.group_rows): super-block j of a group's n rows is 144 n bytes,
//     d of rows 0..n-1 (2 n bytes), then their dmin (2 n), then byte p of their twelve scale bytes
//     (n bytes for each p), then quad (c, t) of their nibbles for c = 0..3 and t = 0..7 (4 n bytes
//     each: row r's bytes 32c + 4t .. 32c + 4t + 3 at 4r)
// so one 64-byte load holds four bytes of each of 16 rows: their low nibbles are weights
// 64c + 4t .. + 3 (sub-block 2c), their high ones the same 32 further on (sub-block 2c + 1), and
// one u8 x s8 product summed per 4 bytes (VNNI's vpdpbusd) gives each row's share in its own
// int32 lane, with no sums across lanes. A last group of fewer rows (N not a multiple of 16) is
// copied into 16 rows' layout, its missing rows zeros, before it is read (q4k_pad_group).
constexpr int64_t Q4K_BYTES = 144;
constexpr int64_t Q4K_GROUP_BYTES = GROUP_ROWS * Q4K_BYTES;  // one super-block of a whole group

// x for Q4_K rows as llama.cpp's Q8_K: n_super super-blocks of 256 floats -> q (256 int8 each),
// d (one scale each: max|x| / 127, q = round-half-even(x / d)) and bsums (each block of 32's sum
// of q: what the mins take from x)
inline void quantize_q8k(const float* x, int64_t n_super, int8_t* q, float* d, int16_t* bsums) {
    for (int64_t j = 0; j < n_super; j++) {
        d[j] = abs_max(x + 256 * j, 256) / 127.0f;
        for (int s = 0; s < 8; s++) bsums[8 * j + s] = (int16_t)round32(x + 256 * j + 32 * s, d[j], q + 256 * j + 32 * s);
    }
}

// The last group's n < 16 rows (K/256 super-blocks from `group`) laid out as a whole group's in
// `padded` (K/256 * Q4K_GROUP_BYTES bytes), rows n..15 zeros
inline void q4k_pad_group(const uint8_t* group, int64_t n, int64_t K, uint8_t* padded) {
    memset(padded, 0, K / 256 * Q4K_GROUP_BYTES);
    for (int64_t j = 0; j < K / 256; j++) {
        const uint8_t* from = group + j * Q4K_BYTES * n;
        uint8_t* to = padded + j * Q4K_GROUP_BYTES;
        memcpy(to, from, 2 * n), memcpy(to + 32, from + 2 * n, 2 * n);  // d, dmin
        for (int p = 0; p < 12; p++) memcpy(to + 64 + 16 * p, from + 4 * n + n * p, n);
        for (int quad = 0; quad < 32; quad++) memcpy(to + 256 + 64 * quad, from + 16 * n + 4 * n * quad, 4 * n);
    }
}

// The 6-bit sc (bytes 0-7 of each row) and m (8-15) of a group's super-block from its twelve
// scale bytes u[0..11] (16 bytes each, one per row): sc 0-3 are u 0-3's low 6 bits, sc 4-7
// u 8-11's low nibbles with u 0-3's top 2 bits above them; m the same from u 4-7 and u 8-11's
// high nibbles. Out: sc[s] of row r at out[16 s + r], m[s] at out[128 + 16 s + r].
inline void q4k_scales(const uint8_t* u, uint8_t* out) {
    for (int h = 0; h < 2; h++) {  // 32 bytes at a time: two of the twelve
        const __m256i low4 = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi8(0x3F), top2 = _mm256_set1_epi8(0x30);
        const __m256i sc = _mm256_loadu_si256((const __m256i*)(u + 32 * h));       // u 0-3
        const __m256i m = _mm256_loadu_si256((const __m256i*)(u + 64 + 32 * h));   // u 4-7
        const __m256i lows = _mm256_loadu_si256((const __m256i*)(u + 128 + 32 * h));  // u 8-11
        // (a 16-bit shift brings the next byte's bits down; the masks drop them)
        _mm256_storeu_si256((__m256i*)(out + 32 * h), _mm256_and_si256(sc, six));
        _mm256_storeu_si256((__m256i*)(out + 64 + 32 * h),
                            _mm256_or_si256(_mm256_and_si256(lows, low4), _mm256_and_si256(_mm256_srli_epi16(sc, 2), top2)));
        _mm256_storeu_si256((__m256i*)(out + 128 + 32 * h), _mm256_and_si256(m, six));
        _mm256_storeu_si256((__m256i*)(out + 192 + 32 * h),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lows, 4), low4),
                                            _mm256_and_si256(_mm256_srli_epi16(m, 2), top2)));
    }
}

// Ask for the bytes this far ahead of a group's nibbles as they are read (the next super-block's,
// then the next group's: a thread's groups lie one after another)
constexpr int64_t Q4K_PREFETCH_AHEAD = 2048;

// out[16 g + r] = x . row r of group g = 0..NG-1 of Q4_K rows, at group0 + g * stride (K/256
// super-blocks of Q4K_GROUP_BYTES each), x as quantize_q8k gives it (xq, d, bsums). The NG groups
// are read in step, 64 bytes of each in turn (NG streams, as dot4 reads four rows). Per super-block
// and row, exactly in int32: dots = sum_s sc[s] (xq . q over s) and mins = sum_s m[s] bsums[s];
// then out += d_x (d dots - dmin mins) in fp32.
template <int NG>
inline void dot_q4k(const int8_t* xq, const float* d, const int16_t* bsums, int64_t K, const uint8_t* group0,
                    int64_t stride, float* out) {
    alignas(64) uint8_t scales[NG][256];
#ifdef GPT2ATTN_AVX512
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[NG];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 256; j++) {
        const uint8_t* block[NG];
        for (int g = 0; g < NG; g++) block[g] = group0 + g * stride + j * Q4K_GROUP_BYTES, q4k_scales(block[g] + 64, scales[g]);
        const int32_t* x4 = (const int32_t*)(xq + 256 * j);  // x four bytes at a time
        __m512i dots[NG];
        for (auto& v : dots) v = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {  // sub-blocks 2c (the low nibbles) and 2c + 1 (the high)
            __m512i low[NG], high[NG];  // x . q over each, for each row
            for (int g = 0; g < NG; g++) low[g] = high[g] = _mm512_setzero_si512();
            for (int t = 0; t < 8; t++) {
                const __m512i xl = _mm512_set1_epi32(x4[16 * c + t]), xh = _mm512_set1_epi32(x4[16 * c + 8 + t]);
                for (int g = 0; g < NG; g++) {
                    const uint8_t* quad = block[g] + 256 + 64 * (8 * c + t);
                    _mm_prefetch((const char*)quad + Q4K_PREFETCH_AHEAD, _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512(quad);
                    low[g] = _mm512_dpbusd_epi32(low[g], _mm512_and_si512(v, low4), xl);
                    high[g] = _mm512_dpbusd_epi32(high[g], _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), xh);
                }
            }
            for (int g = 0; g < NG; g++) {
                const __m512i sc_low = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(scales[g] + 32 * c)));
                const __m512i sc_high = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(scales[g] + 32 * c + 16)));
                dots[g] = _mm512_add_epi32(dots[g], _mm512_add_epi32(_mm512_mullo_epi32(low[g], sc_low),
                                                                     _mm512_mullo_epi32(high[g], sc_high)));
            }
        }
        const __m512 d_x = _mm512_set1_ps(d[j]);
        for (int g = 0; g < NG; g++) {
            __m512i mins = _mm512_setzero_si512();
            for (int s = 0; s < 8; s++)
                mins = _mm512_add_epi32(mins, _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(scales[g] + 128 + 16 * s))),
                                                                 _mm512_set1_epi32(bsums[8 * j + s])));
            const __m512 step = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block[g])), d_x);
            const __m512 min_step = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block[g] + 32))), d_x);
            acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[g]), step, acc[g]);
            acc[g] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), min_step, acc[g]);
        }
    }
    for (int g = 0; g < NG; g++) _mm512_storeu_ps(out + 16 * g, acc[g]);
#else
    // rows 0-7 in the low 32 bytes of each quad, 8-15 in the high: u8 x s8 in pairs (maddubs,
    // at most 2 x 15 x 127), the eight quads of a sub-block summed in int16 (at most 30480), then
    // in int32 (madd by ones)
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[NG][2];
    for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 256; j++) {
        const uint8_t* block[NG];
        for (int g = 0; g < NG; g++) block[g] = group0 + g * stride + j * Q4K_GROUP_BYTES, q4k_scales(block[g] + 64, scales[g]);
        const int32_t* x4 = (const int32_t*)(xq + 256 * j);
        __m256i dots[NG][2], mins[NG][2];
        for (int g = 0; g < NG; g++) dots[g][0] = dots[g][1] = mins[g][0] = mins[g][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++)
            for (int g = 0; g < NG; g++) {
                __m256i pairs[2][2];  // [low/high nibbles][rows 0-7/8-15]
                for (auto& nibbles : pairs) nibbles[0] = nibbles[1] = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) {
                    const uint8_t* quad = block[g] + 256 + 64 * (8 * c + t);
                    _mm_prefetch((const char*)quad + Q4K_PREFETCH_AHEAD, _MM_HINT_T0);
                    const __m256i xl = _mm256_set1_epi32(x4[16 * c + t]), xh = _mm256_set1_epi32(x4[16 * c + 8 + t]);
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(quad + 32 * h));
                        pairs[0][h] = _mm256_add_epi16(pairs[0][h], _mm256_maddubs_epi16(_mm256_and_si256(v, low4), xl));
                        pairs[1][h] = _mm256_add_epi16(pairs[1][h],
                                                       _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), xh));
                    }
                }
                for (int half = 0; half < 2; half++)  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
                    for (int h = 0; h < 2; h++) {
                        const int s = 2 * c + half;
                        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(scales[g] + 16 * s + 8 * h)));
                        const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(scales[g] + 128 + 16 * s + 8 * h)));
                        dots[g][h] = _mm256_add_epi32(dots[g][h], _mm256_mullo_epi32(_mm256_madd_epi16(pairs[half][h], ones), sc));
                        mins[g][h] = _mm256_add_epi32(mins[g][h], _mm256_mullo_epi32(m, _mm256_set1_epi32(bsums[8 * j + s])));
                    }
            }
        const __m256 d_x = _mm256_set1_ps(d[j]);
        for (int g = 0; g < NG; g++)
            for (int h = 0; h < 2; h++) {
                const __m256 step = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block[g] + 16 * h))), d_x);
                const __m256 min_step = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block[g] + 32 + 16 * h))), d_x);
                acc[g][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[g][h]), step, acc[g][h]);
                acc[g][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[g][h]), min_step, acc[g][h]);
            }
    }
    for (int g = 0; g < NG; g++) _mm256_storeu_ps(out + 16 * g, acc[g][0]), _mm256_storeu_ps(out + 16 * g + 8, acc[g][1]);
#endif
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
