// Matrix-vector products for CPU decoding: every weight read once per step, on every thread.
//
// y (B, N) = x (B, K) · W + bias, for a few rows B (decoding), with W kept in one of two layouts:
//   cols: W (K, N) row-major, Conv1D's layout. A chunk of 64 rows of W, read front to back,
//         adds x[b, k] times row k into its own copy of the outputs (in L1/L2); the chunks'
//         copies are summed at the end.
//   rows: W (N, K) row-major, nn.Linear's layout (the LM head, the int8 weights). A chunk of 64
//         rows takes each row's dot product with every x[b].
// Weights in fp32, fp16 (widened with F16C) or bf16 (widened by a 16-bit shift); accumulation in
// fp32. int8 (rows only): one scale per row; x is quantized once per call in blocks of 32 values
// with one scale each (as llama.cpp's q8_0), the 32-value dot products are exact int32 sums.
// Threads: OpenMP, the runtime torch itself runs on (the caller passes torch's thread count),
// each taking chunks of the outputs.
// Built with -mavx2 -mfma -mf16c (and AVX-512 where the CPU has it: simd.h's dot4 and dot4_q8);
// the Python side loads it only on a CPU that has all three.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "simd.h"

namespace {

using gpt2attn::hsum, gpt2attn::load, gpt2attn::widen;

// Work is handed out in chunks (OpenMP's dynamic schedule), so a thread the OS holds back on a
// busy machine delays the step by one chunk, not by its whole share.
constexpr int64_t KROWS = 64;  // rows of W (K, N) per chunk of a cols product
constexpr int64_t ROWS = 64;   // rows per chunk of a rows product

// [start, end) of part `t` of `n` items split in `parts`, each start a multiple of `align`
inline void slice(int64_t n, int parts, int t, int64_t align, int64_t* start, int64_t* end) {
    int64_t units = (n + align - 1) / align;
    int64_t per = units / parts, extra = units % parts;
    int64_t a = t * per + (t < extra ? t : extra), b = a + per + (t < extra ? 1 : 0);
    *start = a * align < n ? a * align : n;
    *end = b * align < n ? b * align : n;
}

template <typename T>
void cols(const float* x, int64_t B, int64_t K, const T* W, int64_t N, const float* bias, float* y, int threads,
          bool bf16) {
    const int64_t chunks = (K + KROWS - 1) / KROWS;
    std::vector<float> part(chunks * B * N, 0.0f);  // (chunks, B, N): each chunk's share of y
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t k1 = (c + 1) * KROWS < K ? (c + 1) * KROWS : K;
        float* y_part = part.data() + c * B * N;
        const int64_t vec_end = N / 8 * 8;
        int64_t k = c * KROWS;
        for (; k + 4 <= k1; k += 4) {  // four rows of W per pass over the outputs
            const T *w0 = W + k * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
            for (int64_t b = 0; b < B; b++) {
                const float* xb = x + b * K + k;
                __m256 x0 = _mm256_set1_ps(xb[0]), x1 = _mm256_set1_ps(xb[1]);
                __m256 x2 = _mm256_set1_ps(xb[2]), x3 = _mm256_set1_ps(xb[3]);
                float* yb = y_part + b * N;
                for (int64_t n = 0; n < vec_end; n += 8) {
                    __m256 a = _mm256_loadu_ps(yb + n);
                    a = _mm256_fmadd_ps(x0, load<T>(w0 + n, bf16), a);
                    a = _mm256_fmadd_ps(x1, load<T>(w1 + n, bf16), a);
                    a = _mm256_fmadd_ps(x2, load<T>(w2 + n, bf16), a);
                    a = _mm256_fmadd_ps(x3, load<T>(w3 + n, bf16), a);
                    _mm256_storeu_ps(yb + n, a);
                }
                for (int64_t n = vec_end; n < N; n++)
                    yb[n] += xb[0] * widen(w0[n], bf16) + xb[1] * widen(w1[n], bf16) + xb[2] * widen(w2[n], bf16) +
                             xb[3] * widen(w3[n], bf16);
            }
        }
        for (; k < k1; k++)
            for (int64_t b = 0; b < B; b++)
                for (int64_t n = 0; n < N; n++) y_part[b * N + n] += x[b * K + k] * widen(W[k * N + n], bf16);
    }
    for (int64_t i = 0; i < B * N; i++) {  // y = bias + the chunks' shares, in chunk order
        float v = bias ? bias[i % N] : 0.0f;
        for (int64_t c = 0; c < chunks; c++) v += part[c * B * N + i];
        y[i] = v;
    }
}

template <typename T>
float dot(const float* x, const T* w, int64_t K, bool bf16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load<T>(w + k, bf16), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load<T>(w + k + 8, bf16), a1);
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; k < K; k++) s += x[k] * widen(w[k], bf16);
    return s;
}

template <typename T>
void rows(const float* x, int64_t B, int64_t K, const T* W, int64_t N, const float* bias, float* y, int threads,
          bool bf16) {
    const int64_t chunks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * ROWS, r1 = r0 + ROWS < N ? r0 + ROWS : N;
        int64_t r = r0;
        if (K % 8 == 0) {
            for (; r + 4 <= r1; r += 4)  // four rows at a time: four independent sums per x row
                for (int64_t b = 0; b < B; b++) {
                    float* yb = y + b * N + r;
                    if (bf16) gpt2attn::dot4<T, true>(x + b * K, W + r * K, K, K, false, yb);
                    else gpt2attn::dot4<T, false>(x + b * K, W + r * K, K, K, false, yb);
                    for (int i = 0; i < 4; i++) yb[i] += bias ? bias[r + i] : 0.0f;
                }
        }
        for (; r < r1; r++)
            for (int64_t b = 0; b < B; b++) y[b * N + r] = dot(x + b * K, W + r * K, K, bf16) + (bias ? bias[r] : 0.0f);
    }
}

// 32 int8 products summed in int32, eight lanes: |x| (0..127, as u8) times w with x's sign
inline __m256i dot32(__m256i xq, __m256i wq) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(xq, xq), _mm256_sign_epi8(wq, xq));  // |products| < 2^15
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

}  // namespace

extern "C" {

int gpt2attn_abi_version() { return 1; }

// The sum of n floats, read on `threads` threads: the machine's read rate, for the benchmarks.
// Each thread reads its share as `streams` equal runs in step, 32 floats of each in turn: a core
// keeps more reads in flight over several far-apart streams than over one (on this project's
// machines one stream a core read 4% to 28% slower than eight, by the run).
float gpt2attn_read_sum(const float* p, int64_t n, int threads, int streams) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int64_t i0, i1;
        slice(n, omp_get_num_threads(), omp_get_thread_num(), 32, &i0, &i1);
        const int64_t run = (i1 - i0) / streams / 32 * 32;  // floats per stream, read 32 at a time
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < run; i += 32)
            for (int s = 0; s < streams; s++) {
                const float* q = p + i0 + s * run + i;
                a0 = _mm256_add_ps(a0, _mm256_loadu_ps(q));
                a1 = _mm256_add_ps(a1, _mm256_loadu_ps(q + 8));
                a2 = _mm256_add_ps(a2, _mm256_loadu_ps(q + 16));
                a3 = _mm256_add_ps(a3, _mm256_loadu_ps(q + 24));
            }
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (int64_t i = i0 + streams * run; i < i1; i++) sum += p[i];  // what the runs leave
        total += sum;
    }
    return total;
}

void gpt2attn_cols_f32(const float* x, int64_t B, int64_t K, const float* W, int64_t N, const float* bias, float* y,
                       int threads) {
    cols<float>(x, B, K, W, N, bias, y, threads, false);
}
void gpt2attn_cols_16(const float* x, int64_t B, int64_t K, const uint16_t* W, int64_t N, const float* bias, float* y,
                      int threads, int bf16) {
    cols<uint16_t>(x, B, K, W, N, bias, y, threads, bf16 != 0);
}
void gpt2attn_rows_f32(const float* x, int64_t B, int64_t K, const float* W, int64_t N, const float* bias, float* y,
                       int threads) {
    rows<float>(x, B, K, W, N, bias, y, threads, false);
}
void gpt2attn_rows_16(const float* x, int64_t B, int64_t K, const uint16_t* W, int64_t N, const float* bias, float* y,
                      int threads, int bf16) {
    rows<uint16_t>(x, B, K, W, N, bias, y, threads, bf16 != 0);
}

// x (B, K), K a multiple of 32 -> xq (B, K) int8 and xs (B, K/32): per block scale = max|x|/127,
// xq = round-half-even(x / scale) (0 where the block is all zeros), as the torch reference does.
void gpt2attn_quantize_q8(const float* x, int64_t B, int64_t K, int8_t* xq, float* xs) {
    gpt2attn::quantize_q8(x, B * K / 32, xq, xs);
}

// y (B, N) = (xq·xs) (B, K) · (Wq (N, K) · ws (N,))ᵀ + bias; K a multiple of 32
void gpt2attn_rows_q8(const int8_t* xq, const float* xs, int64_t B, int64_t K, const int8_t* W, const float* ws,
                      int64_t N, const float* bias, float* y, int threads) {
    const int64_t nb = K / 32, chunks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * ROWS, r1 = r0 + ROWS < N ? r0 + ROWS : N;
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4)
            for (int64_t b = 0; b < B; b++) {
                float* yb = y + b * N + r;
                gpt2attn::dot4_q8(xq + b * K, xs + b * nb, W + r * K, K, K, false, yb);
                for (int i = 0; i < 4; i++) yb[i] = yb[i] * ws[r + i] + (bias ? bias[r + i] : 0.0f);
            }
        for (; r < r1; r++)
            for (int64_t b = 0; b < B; b++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t j = 0; j < nb; j++)
                    a = _mm256_fmadd_ps(_mm256_set1_ps(xs[b * nb + j]),
                                        _mm256_cvtepi32_ps(dot32(_mm256_loadu_si256((const __m256i*)(xq + b * K + 32 * j)),
                                                                 _mm256_loadu_si256((const __m256i*)(W + r * K + 32 * j)))),
                                        a);
                y[b * N + r] = hsum(a) * ws[r] + (bias ? bias[r] : 0.0f);
            }
    }
}

}  // extern "C"
