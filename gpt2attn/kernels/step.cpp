// One decoding step of a whole GPT-2 in one call: B rows, one new token each, every weight read
// once, on all threads, inside one parallel region (no Python, no thread start between layers).
//
//   ids (B) -> wte[id] + wpe[pos] -> n_layer x [ x += attn(ln_1(x)); x += mlp(ln_2(x)) ] -> ln_f -> head -> logits (B, V)
//
// The keys and values of the new token go into the cache at position `pos`, in the layout of
// gpt2attn's preallocated KVCache block: (n_layer, 2, B, nh, capacity, hs).
//
// Each weight matrix is a `Matrix` of one kind:
//   F32                      (K, N) row-major, Conv1D's layout, read as it is (no copy): threads
//                            take chunks of K rows, each a contiguous stretch of memory, and add
//                            x[k] times every row into their own partial outputs, summed at the end
//   F32_ROWS, F16_ROWS, BF16_ROWS  (N, K), nn.Linear's layout (the LM head, wte itself when tied):
//                            threads take spans of rows, each read as four far-apart streams
//                            (simd.h's dot4: row i of each quarter of the span together)
//   Q8_ROWS                  (N, K) int8 with one fp32 scale per row; x is quantized once per
//                            product in blocks of 32 with one scale each (llama.cpp's q8_0), each
//                            block's 32 products summed exactly in int32
// 16-bit weights are widened to fp32 in registers (F16C; bf16 by a 16-bit shift); sums are fp32.
// Where the build has AVX-512, the rows products take 16 floats or 64 int8 a step (simd.h).
// GELU is the tanh form (gelu_new), computed with the exp below.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <vector>

#include "simd.h"

namespace {

using gpt2attn::dot4, gpt2attn::dot4_q8, gpt2attn::hsum, gpt2attn::load, gpt2attn::widen;

enum Kind : int32_t { F32 = 0, F32_ROWS = 3, F16_ROWS = 4, BF16_ROWS = 5, Q8_ROWS = 6 };  // 1, 2: unused
enum Epilogue { STORE, GELU, ADD };  // y = acc + b;  y = gelu(acc + b);  y += acc + b (the residual)

constexpr int64_t KCHUNK = 32;  // rows of a (K, N) weight per chunk (a multiple of 8): 32 x 2304 fp32 = 295 KB, one stream
#ifndef SPANS
#define SPANS 4
#endif

// e^x for 8 floats: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor series to r^7 (relative
// error below 1e-8), 2^n put into the exponent bits.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  // ln 2 in two parts, so n ln2 is exact
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// gelu_new: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (e^{2u} + 1)
inline __m256 gelu8(__m256 x) {
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f), _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_mul_ps(_mm256_set1_ps(0.044715f), x), x));
    __m256 e = exp8(_mm256_add_ps(u, u));
    __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}
inline float gelu1(float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x))); }

// y[0:n] (op)= acc[0:n] + bias[0:n]
inline void finish(float* y, const float* acc, const float* bias, int64_t n, Epilogue op) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(acc + i);
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
        if (op == GELU) v = gelu8(v);
        if (op == ADD) v = _mm256_add_ps(v, _mm256_loadu_ps(y + i));
        _mm256_storeu_ps(y + i, v);
    }
    for (; i < n; i++) {
        float v = acc[i] + (bias ? bias[i] : 0.0f);
        y[i] = op == GELU ? gelu1(v) : op == ADD ? y[i] + v : v;
    }
}

// The rows of an (N, K) product, handed to the threads in spans of a multiple of 4 rows (SPANS
// per thread, taken in turn: a thread the OS holds back still leaves the others spans to take).
// body(r0, r1) runs once per span of at most span_rows(N, threads) rows.
inline int64_t span_rows(int64_t N, int threads) { return ((N + SPANS * threads - 1) / (SPANS * threads) + 3) / 4 * 4; }
template <typename F>
void for_spans(int64_t N, int threads, F&& body) {
    const int64_t span = span_rows(N, threads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < (N + span - 1) / span; s++) body(s * span, (s + 1) * span < N ? (s + 1) * span : N);
}

inline float dot(const float* a, const float* b, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum(s);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

// y (n) += p * v (n)
inline void axpy(float* y, float p, const float* v, int64_t n) {
    __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += p * v[i];
}

void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t C, float* out) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < C; i++) mean += x[i];
    mean /= C;
    for (int64_t i = 0; i < C; i++) var += (x[i] - mean) * (x[i] - mean);
    float inv = 1.0f / std::sqrt((float)(var / C) + eps), m = (float)mean;
    for (int64_t i = 0; i < C; i++) out[i] = (x[i] - m) * inv * w[i] + b[i];
}

}  // namespace

extern "C" {

struct Matrix {
    const void* weight;  // see Kind for the layout
    const float* scale;  // Q8_ROWS: one per row (N); else null
    const float* bias;   // (N) or null
    int32_t kind;
    int32_t unused;
    int64_t K, N;  // inputs, outputs
};

struct Layer {
    const float *ln_1_weight, *ln_1_bias;
    Matrix c_attn, attn_proj;  // attn.c_attn (C -> 3C), attn.c_proj (C -> C)
    const float *ln_2_weight, *ln_2_bias;
    Matrix c_fc, mlp_proj;  // mlp.c_fc (C -> inner), mlp.c_proj (inner -> C)
    float attn_scale;       // 1/sqrt(hs), divided by layer_idx + 1 where the config says so
    float unused;
};

struct Model {
    int64_t n_layer, n_embd, n_head, n_inner, vocab_size;
    float eps;
    float unused;
    const float *wte, *wpe, *ln_f_weight, *ln_f_bias;
    Matrix lm_head;
    const Layer* layers;
};

}  // extern "C"

namespace {

struct Step {
    const Model& m;
    int64_t B;
    int threads;
    std::vector<float> partial;   // (threads, B, maxN): each thread's share of a (K, N) product
    std::vector<int8_t> xq;       // (threads, B, maxK): x quantized for Q8_ROWS, by each thread for itself
    std::vector<float> xs;        // (threads, B, maxK / 32): its scales
    std::vector<float> acc;       // (threads, B, maxSpan): a rows span's sums before the epilogue
    int64_t maxN, maxK, maxSpan;

    Step(const Model& model, int64_t rows, int nthreads, int64_t max_n, int64_t max_k)
        : m(model), B(rows), threads(nthreads), partial(nthreads * rows * max_n), xq(nthreads * rows * max_k),
          xs(nthreads * rows * (max_k / 32)), maxN(max_n), maxK(max_k),
          maxSpan(span_rows(max_n > model.vocab_size ? max_n : model.vocab_size, nthreads)) {
        acc.resize(nthreads * rows * maxSpan);
    }

    // y (B, N) (op)= x (B, K) . W + bias, called by every thread of the region
    void product(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op) {
        switch (W.kind) {
            case F32: cols<float, false>(W, x, y, y_stride, op); break;
            case F32_ROWS: rows<float, false>(W, x, y, y_stride, op); break;
            case F16_ROWS: rows<uint16_t, false>(W, x, y, y_stride, op); break;
            case BF16_ROWS: rows<uint16_t, true>(W, x, y, y_stride, op); break;
            case Q8_ROWS: rows_q8(W, x, y, y_stride, op); break;
        }
    }

    template <typename T, bool bf16>  // bf16: T is uint16_t holding bfloat16 (else fp16, or fp32)
    void cols(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op) {
        const int64_t K = W.K, N = W.N, vec_end = N / 8 * 8;
        const T* w = (const T*)W.weight;
        float* mine = partial.data() + omp_get_thread_num() * B * maxN;  // (B, N) of this thread
        memset(mine, 0, B * N * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < (K + KCHUNK - 1) / KCHUNK; c++) {
            const int64_t k1 = (c + 1) * KCHUNK < K ? (c + 1) * KCHUNK : K;
            int64_t k = c * KCHUNK;
            for (; k + 8 <= k1; k += 8) {  // eight rows of W per pass over the outputs
                const T* w0 = w + k * N;
                for (int64_t b = 0; b < B; b++) {
                    const float* xb = x + b * K + k;
                    __m256 xk[8];
                    for (int i = 0; i < 8; i++) xk[i] = _mm256_set1_ps(xb[i]);
                    float* yb = mine + b * N;
                    for (int64_t n = 0; n < vec_end; n += 8) {
                        const T* wn = w0 + n;
                        __m256 a = _mm256_fmadd_ps(xk[0], load<T>(wn, bf16), _mm256_loadu_ps(yb + n));
                        __m256 odd = _mm256_mul_ps(xk[1], load<T>(wn + N, bf16));
                        a = _mm256_fmadd_ps(xk[2], load<T>(wn + 2 * N, bf16), a);
                        odd = _mm256_fmadd_ps(xk[3], load<T>(wn + 3 * N, bf16), odd);
                        a = _mm256_fmadd_ps(xk[4], load<T>(wn + 4 * N, bf16), a);
                        odd = _mm256_fmadd_ps(xk[5], load<T>(wn + 5 * N, bf16), odd);
                        a = _mm256_fmadd_ps(xk[6], load<T>(wn + 6 * N, bf16), a);
                        odd = _mm256_fmadd_ps(xk[7], load<T>(wn + 7 * N, bf16), odd);
                        _mm256_storeu_ps(yb + n, _mm256_add_ps(a, odd));
                    }
                    for (int64_t n = vec_end; n < N; n++) {
                        float v = yb[n];
                        for (int i = 0; i < 8; i++) v += xb[i] * widen(w0[i * N + n], bf16);
                        yb[n] = v;
                    }
                }
            }
            for (; k < k1; k++)
                for (int64_t b = 0; b < B; b++) {
                    const float xk = x[b * K + k];
                    for (int64_t n = 0; n < N; n++) mine[b * N + n] += xk * widen(w[k * N + n], bf16);
                }
        }  // implicit barrier: every partial is complete
        // the threads' partials summed, bias and epilogue, over slices of the outputs
        constexpr int64_t SLICE = 256;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < B * ((N + SLICE - 1) / SLICE); s++) {
            const int64_t per_row = (N + SLICE - 1) / SLICE, b = s / per_row, n0 = s % per_row * SLICE;
            const int64_t n1 = n0 + SLICE < N ? n0 + SLICE : N;
            float sum[SLICE];
            memcpy(sum, partial.data() + b * N + n0, (n1 - n0) * sizeof(float));
            for (int t = 1; t < omp_get_num_threads(); t++) {
                const float* p = partial.data() + t * B * maxN + b * N + n0;
                for (int64_t i = 0; i < n1 - n0; i++) sum[i] += p[i];
            }
            finish(y + b * y_stride + n0, sum, W.bias ? W.bias + n0 : nullptr, n1 - n0, op);
        }  // implicit barrier
    }

    // A span of rows is read as four far-apart streams, row i of each quarter together in one dot4:
    // a core keeps more reads in flight over four streams than over one (a step 12-17% faster, measured).
    template <typename T, bool bf16>
    void rows(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op) {
        const int64_t K = W.K;
        const T* w = (const T*)W.weight;
        float* sums = acc.data() + omp_get_thread_num() * B * maxSpan;  // (B, n)
        for_spans(W.N, threads, [&](int64_t r0, int64_t r1) {
            const int64_t n = r1 - r0, q = K % 8 == 0 ? n / 4 : 0;
            float out[4];
            for (int64_t i = 0; i < q; i++)
                for (int64_t b = 0; b < B; b++) {
                    dot4<T, bf16>(x + b * K, w + (r0 + i) * K, q * K, K, b == 0, out);
                    for (int j = 0; j < 4; j++) sums[b * n + i + j * q] = out[j];
                }
            for (int64_t r = r0 + 4 * q; r < r1; r++)  // what the quarters leave (the head's last row; odd K)
                for (int64_t b = 0; b < B; b++) {
                    float s = 0.0f;
                    for (int64_t k = 0; k < K; k++) s += x[b * K + k] * widen(w[r * K + k], bf16);
                    sums[b * n + r - r0] = s;
                }
            for (int64_t b = 0; b < B; b++)
                finish(y + b * y_stride + r0, sums + b * n, W.bias ? W.bias + r0 : nullptr, n, op);
        });  // implicit barrier
    }

    void rows_q8(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op) {
        const int64_t K = W.K, nb = K / 32;
        // every thread quantizes x for itself (a few microseconds): no barrier before the rows
        int8_t* xq_mine = xq.data() + omp_get_thread_num() * B * maxK;
        float* xs_mine = xs.data() + omp_get_thread_num() * B * (maxK / 32);
        gpt2attn::quantize_q8(x, B * K / 32, xq_mine, xs_mine);
        const int8_t* w = (const int8_t*)W.weight;
        float* sums = acc.data() + omp_get_thread_num() * B * maxSpan;  // (B, n)
        for_spans(W.N, threads, [&](int64_t r0, int64_t r1) {
            const int64_t n = r1 - r0, q = n / 4;
            float out[4];
            for (int64_t i = 0; i < q; i++)
                for (int64_t b = 0; b < B; b++) {
                    dot4_q8(xq_mine + b * K, xs_mine + b * nb, w + (r0 + i) * K, q * K, K, b == 0, out);
                    for (int j = 0; j < 4; j++) sums[b * n + i + j * q] = out[j] * W.scale[r0 + i + j * q];
                }
            for (int64_t r = r0 + 4 * q; r < r1; r++)
                for (int64_t b = 0; b < B; b++) {
                    float total = 0.0f;
                    for (int64_t j = 0; j < nb; j++) {
                        int32_t s = 0;
                        for (int i = 0; i < 32; i++) s += (int32_t)xq_mine[b * K + 32 * j + i] * w[r * K + 32 * j + i];
                        total += xs_mine[b * nb + j] * (float)s;
                    }
                    sums[b * n + r - r0] = total * W.scale[r];
                }
            for (int64_t b = 0; b < B; b++)
                finish(y + b * y_stride + r0, sums + b * n, W.bias ? W.bias + r0 : nullptr, n, op);
        });  // implicit barrier
    }
};

}  // namespace

extern "C" {

int gpt2attn_step_abi_version() { return 1; }

// logits (B, V) of the token after ids (B), each row's cache holding `pos` tokens; writes the new
// keys and values into kv (n_layer, 2, B, nh, capacity, hs) at position pos. Returns 0, or -1 (and
// computes nothing) when a matrix's sizes or kind do not fit the model's (the buffers assume them).
int gpt2attn_decode_step(const Model* model, const int64_t* ids, int64_t B, int64_t pos, float* kv, int64_t capacity,
                          float* logits, int threads) {
    const Model& m = *model;
    const int64_t C = m.n_embd, nh = m.n_head, hs = C / nh, inner = m.n_inner, V = m.vocab_size;
    auto fits = [](const Matrix& w, int64_t K, int64_t N) {
        return w.K == K && w.N == N && (w.kind == F32 || (w.kind >= F32_ROWS && w.kind <= Q8_ROWS));
    };
    bool ok = fits(m.lm_head, C, V) && m.lm_head.kind >= F32_ROWS && hs * nh == C;  // the head is rows: no partials of V
    for (int64_t l = 0; l < m.n_layer; l++) {
        const Layer& L = m.layers[l];
        ok = ok && fits(L.c_attn, C, 3 * C) && fits(L.attn_proj, C, C) && fits(L.c_fc, C, inner) && fits(L.mlp_proj, inner, C);
    }
    if (!ok) return -1;
    const int64_t T = pos + 1;  // keys attended to
    const int64_t widest = 3 * C > inner ? 3 * C : inner;
    Step step(m, B, threads, widest, inner > C ? inner : C);
    std::vector<float> x(B * C), h(B * C), qkv(B * 3 * C), att(B * C), f(B * inner);  // residual, normed, ...
    std::vector<float> scores(threads * T);

#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < C; i++) x[b * C + i] = m.wte[ids[b] * C + i] + m.wpe[pos * C + i];
        for (int64_t l = 0; l < m.n_layer; l++) {
            const Layer& L = m.layers[l];
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) layer_norm(&x[b * C], L.ln_1_weight, L.ln_1_bias, m.eps, C, &h[b * C]);
            step.product(L.c_attn, h.data(), qkv.data(), 3 * C, STORE);  // (B, 3C): q, k, v
            // each (row, head): keep its new key and value, then attend over the T cached ones
            float* p = scores.data() + omp_get_thread_num() * T;
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * nh; bh++) {
                const int64_t b = bh / nh, head = bh % nh;
                float* keys = kv + (((l * 2 + 0) * B + b) * nh + head) * capacity * hs;  // (capacity, hs)
                float* values = kv + (((l * 2 + 1) * B + b) * nh + head) * capacity * hs;
                const float* q = &qkv[b * 3 * C + head * hs];
                memcpy(keys + pos * hs, q + C, hs * sizeof(float));
                memcpy(values + pos * hs, q + 2 * C, hs * sizeof(float));
                float top = -INFINITY;
                for (int64_t t = 0; t < T; t++) {
                    p[t] = dot(q, keys + t * hs, hs) * L.attn_scale;
                    top = p[t] > top ? p[t] : top;
                }
                float total = 0.0f;
                int64_t t = 0;
                for (; t + 8 <= T; t += 8) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(top)));
                    _mm256_storeu_ps(p + t, e);
                    total += hsum(e);
                }
                for (; t < T; t++) total += (p[t] = std::exp(p[t] - top));
                float* y = &att[b * C + head * hs];
                memset(y, 0, hs * sizeof(float));
                for (t = 0; t < T; t++) axpy(y, p[t] / total, values + t * hs, hs);
            }
            step.product(L.attn_proj, att.data(), x.data(), C, ADD);  // x += attn
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) layer_norm(&x[b * C], L.ln_2_weight, L.ln_2_bias, m.eps, C, &h[b * C]);
            step.product(L.c_fc, h.data(), f.data(), inner, GELU);         // (B, inner)
            step.product(L.mlp_proj, f.data(), x.data(), C, ADD);          // x += mlp
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) layer_norm(&x[b * C], m.ln_f_weight, m.ln_f_bias, m.eps, C, &h[b * C]);
        step.product(m.lm_head, h.data(), logits, V, STORE);  // (B, V)
    }
    return 0;
}

}  // extern "C"
