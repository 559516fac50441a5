// AVX2 pieces both kernel files use: widening 8 weights to fp32, a horizontal sum, and the
// quantization of activations in blocks of 32 (llama.cpp's q8_0 layout).
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

}  // namespace gpt2attn
