// CPU decoding for GPT-2: the weight products of a few rows (and of a prompt's), and a whole decoding
// step in one call.
//
// A product is y (B, N) = x (B, K) · W + bias for a few rows B, every weight read once, on all
// threads. W is a `Matrix` of one kind:
//   COLS_F32                 (K, N) row-major, Conv1D's layout, read as it is (no copy): each
//                            thread takes an equal share of W's rows and reads it as four
//                            far-apart runs in step, adding x[k] times four rows (one from each
//                            run) into its own partial outputs a pass; the partials are summed at
//                            the end. Four long streams a core keep more reads in flight than one
//                            (a step 8% faster than eight adjacent rows a pass, measured on Zen 4)
//   ROWS_F32, ROWS_F16, ROWS_BF16  (N, K), nn.Linear's layout (the LM head, wte itself when tied):
//                            each thread a share of the rows (a step) or spans of them (a
//                            prompt), each read as four far-apart streams (simd.h's dot4: row i
//                            of each quarter of the share together)
//   ROWS_Q8                  (N, K) int8 with one fp32 scale per row, laid out by groups of 16
//                            rows (simd.h); x is quantized in blocks of 32 with one scale each
//                            (llama.cpp's q8_0), each block's 32 products summed exactly in int32,
//                            16 rows in the lanes of one register. Any number of rows: a prompt's
//                            (the int8 model's one copy serves prompts too) a row at a time, in
//                            chunks of x that stay in the core's cache
//   ROWS_Q4K                 (N, K) as llama.cpp's Q4_K super-blocks of 256 (144 bytes), K a
//                            multiple of 256, laid out by groups of 16 rows (simd.h); x quantized
//                            as llama.cpp's Q8_K (one scale per 256, by each thread for itself,
//                            whatever the rows); a super-block's products of nibbles and x, times
//                            the sub-blocks' 6-bit scales, and its mins times x's sums, summed
//                            exactly in int32, 16 rows in the lanes of one register: two float
//                            multiply-adds per super-block
// 16-bit weights are widened to fp32 in registers (F16C; bf16 by a 16-bit shift); sums are fp32.
// Where the build has AVX-512, the products take 16 floats or 64 int8 a step (simd.h; a cols
// step of the plain fp32 model 7.302 -> 7.046 ms against 8 floats, one-call steps A/B, memory at
// about 75 GB/s, AMD EPYC Zen 5, 2026-11-28).
// A product of more rows than TILE_ROWS (a prompt) of COLS_F32 or a 16-bit or fp32 rows kind takes
// register tiles instead (prompt_tiles), each weight loaded once for several rows of x.
//
// Threads: OpenMP, the runtime torch itself runs on (the caller passes torch's thread count).
// A rows product hands its spans out in turn (schedule(dynamic)), so a thread the OS holds back on
// a busy machine delays it by one span, not by its whole share (except where a step's matrix is
// small enough for one span a thread: for_spans): each row's sum is one thread's, the same
// whichever thread takes it. A cols product gives each thread the same share of rows on
// every run, so its partial sums, and a step's results, do not change from run to run (with chunks
// taken in turn, they changed in the last bits). In a step of a few rows each thread computes the q,
// k and v of the heads it attends to, so attention follows c_attn with no barrier (Step::run).
//
// gpt2attn_product runs one product in its own parallel region (the modules' path);
// gpt2attn_decode_step runs every product of a step inside one region, no Python between layers:
//
//   ids (B) -> wte[id] + wpe[position] -> n_layer x [ x += attn(ln_1(x)); x += mlp(ln_2(x)) ] -> ln_f -> head -> logits (B, V)
//
// The keys and values of the new token go into the cache at index `pos`, in the layout of
// gpt2attn's preallocated KVCache block: (n_layer, 2, B, nh, capacity, hs). GELU is the tanh
// form (gelu_new), computed with the exp below.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd.h"

extern "C" {

enum Kind : int32_t { COLS_F32 = 0, ROWS_F32 = 1, ROWS_F16 = 2, ROWS_BF16 = 3, ROWS_Q8 = 4, ROWS_Q4K = 5 };

struct Matrix {
    const void* weight;  // see Kind for the layout
    const float* scale;  // ROWS_Q8: one per row (N); else null
    const float* bias;   // (N) or null
    int64_t K, N;        // inputs, outputs
    int32_t kind;
};

struct Layer {
    const float *ln_1_weight, *ln_1_bias;
    Matrix c_attn, attn_proj;  // attn.c_attn (C -> 3C), attn.c_proj (C -> C)
    const float *ln_2_weight, *ln_2_bias;
    Matrix c_fc, mlp_proj;  // mlp.c_fc (C -> inner), mlp.c_proj (inner -> C)
    float attn_scale;       // 1/sqrt(hs), divided by layer_idx + 1 where the config says so
};

struct Model {
    int64_t n_layer, n_embd, n_head, n_inner, vocab_size, n_positions;
    float eps;
    const float *wte, *wpe, *ln_f_weight, *ln_f_bias;  // wte (V, C), wpe (n_positions, C)
    Matrix lm_head;
    const Layer* layers;
};

}  // extern "C"

namespace {

using gpt2attn::dot4, gpt2attn::hsum, gpt2attn::load, gpt2attn::widen;

enum Epilogue { STORE, GELU, ADD };  // y = acc + b;  y = gelu(acc + b);  y += acc + b (the residual)

constexpr int64_t QUARTERS = 4;  // far-apart runs of rows each thread reads in step in a cols product
constexpr int64_t SPANS = 4;    // spans of rows per thread in a rows product (at most; for_spans)
constexpr int64_t SLICE = 256;  // outputs per task when the threads' partials of a cols product are summed
constexpr int64_t X_CHUNK_BYTES = 1 << 18;  // a prompt's int8 x taken this much at a time (in L2)
constexpr int64_t ALONE_ROWS = 8;  // an int8 product of up to this many rows: each thread quantizes x for itself

bool is_kind(int32_t kind) { return kind >= COLS_F32 && kind <= ROWS_Q4K; }

// K values a row of this kind must come in multiples of (its blocks)
int64_t k_multiple(int32_t kind) { return kind == ROWS_Q8 ? 32 : kind == ROWS_Q4K ? 256 : 1; }

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

// Bytes of one row of a rows matrix
inline int64_t row_bytes(const Matrix& W) {
    switch (W.kind) {
        case ROWS_F32: return 4 * W.K;
        case ROWS_F16: case ROWS_BF16: return 2 * W.K;
        case ROWS_Q8: return W.K;
        default: return W.K / 256 * gpt2attn::Q4K_BYTES;
    }
}

// The rows of an (N, K) product, handed to the threads. In a step (at most ALONE_ROWS rows of x)
// each thread reads one contiguous share, the same rows on every call, with no scheduling between
// the threads. gpt2-small's one-call steps against the spans taken in turn that a step used before
// (fewer than SPANS a thread where a span held under 1 MiB), A/B alternating in one process on the
// 2-core AMD EPYC Zen 4 VM (2026-11-28), both built as shipped and both with -falign-loops=64 (the
// code's layout alone moved the 16-bit steps by up to 5 points): when memory read at about 59 GB/s,
// fp16 80% -> 83% of the read rate, int8 76% -> 79%, q4 69% -> 71%; at 34 GB/s the same. A
// prompt's rows go in SPANS spans a thread, taken in turn, so that a thread slowed by other work
// takes fewer. body(r0, r1) runs once per span (or share). A span is a multiple of 16 rows (the
// last excepted), so it never splits a group of int8 or Q4_K rows (simd.h).
inline int64_t span_rows(int64_t N, int64_t spans) {
    return ((N + spans - 1) / spans + gpt2attn::GROUP_ROWS - 1) / gpt2attn::GROUP_ROWS * gpt2attn::GROUP_ROWS;
}
// Thread t's even share [first, end) of n things among T (the first n % T threads one more)
struct Share {
    int64_t first, end;
};
inline Share even_share(int64_t n, int t, int T) {
    const int64_t first = n / T * t + std::min<int64_t>(t, n % T);
    return {first, first + n / T + (t < n % T)};
}

// Rows of a step's product that a thread takes in place of its even share, with no barrier after:
// `parts` runs of `count` rows, `stride` apart from `first` (c_attn's q, k and v rows of the heads
// whose attention the thread computes next, so that attention waits for no other thread)
struct OwnRows {
    int64_t first, count, stride, parts;
};

template <typename F>
void for_spans(const Matrix& W, int64_t B, int threads, const OwnRows* own, F&& body) {
    const int64_t N = W.N;
    if (own) {
        for (int64_t part = 0; part < own->parts; part++) body(own->first + part * own->stride, own->first + part * own->stride + own->count);
        return;
    }
    if (B <= ALONE_ROWS) {
        const int64_t share = span_rows(N, threads);  // (should the team be smaller, a thread takes several)
        for (int64_t r0 = omp_get_thread_num() * share; r0 < N; r0 += omp_get_num_threads() * share)
            body(r0, std::min<int64_t>(N, r0 + share));
#pragma omp barrier
        return;
    }
    const int64_t span = span_rows(N, SPANS * threads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < (N + span - 1) / span; s++) body(s * span, (s + 1) * span < N ? (s + 1) * span : N);
}

// Registers of 8 or 16 floats, so that one loop serves both builds
struct Lanes8 {
    using V = __m256;
    static constexpr int64_t L = 8;
    static V splat(float v) { return _mm256_set1_ps(v); }
    static V load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
};
#ifdef GPT2ATTN_AVX512
struct Lanes16 {
    using V = __m512;
    static constexpr int64_t L = 16;
    static V splat(float v) { return _mm512_set1_ps(v); }
    static V load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
};
#endif

// A cols product's pass over outputs [n, end), R::L at a time while that many remain: y[n] +=
// x4[0] w[n] + x4[1] w[far + n] + x4[2] w[2 far + n] + x4[3] w[3 far + n], the same sums in the same
// order at either width (so the same bits in either build). Returns the first output not done.
template <typename R>
int64_t cols_pass(const float* x4, const float* w, int64_t far, float* y, int64_t n, int64_t end) {
    const typename R::V x0 = R::splat(x4[0]), x1 = R::splat(x4[1]), x2 = R::splat(x4[2]), x3 = R::splat(x4[3]);
    for (; n + R::L <= end; n += R::L) {
        const float* wn = w + n;
        typename R::V a = R::fmadd(x0, R::load(wn), R::load(y + n));
        typename R::V c = R::mul(x1, R::load(wn + far));
        a = R::fmadd(x2, R::load(wn + 2 * far), a);
        c = R::fmadd(x3, R::load(wn + 3 * far), c);
        R::store(y + n, R::add(a, c));
    }
    return n;
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

// the sum over x[0:n] of f(x[i] - shift) in double, eight lanes a step; f: the value or its square
template <bool square>
double sum_pd(const float* x, int64_t n, double shift) {
    const __m256d c = _mm256_set1_pd(shift);
    __m256d lo = _mm256_setzero_pd(), hi = lo;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256d a = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), c);
        const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), c);
        lo = square ? _mm256_fmadd_pd(a, a, lo) : _mm256_add_pd(lo, a);
        hi = square ? _mm256_fmadd_pd(d, d, hi) : _mm256_add_pd(hi, d);
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(lo, hi));
    double total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++) total += square ? (x[i] - shift) * (x[i] - shift) : x[i] - shift;
    return total;
}

void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t C, float* out) {
    const double mean = sum_pd<false>(x, C, 0.0) / C, var = sum_pd<true>(x, C, mean) / C;
    const float inv = 1.0f / std::sqrt((float)var + eps), m = (float)mean;
    for (int64_t i = 0; i < C; i++) out[i] = (x[i] - m) * inv * w[i] + b[i];
}

// The products of B rows, with every thread's scratch space: sized once for the widest matrix
// they will see, then called by every thread of a parallel region.
struct Products {
    int64_t B;
    int threads;
    int64_t max_cols_n, max_k, max_span;  // widest cols output, widest input, longest rows span
    std::vector<float> partial;  // (2, threads, B, max_cols_n): each thread's share of a (K, N) product, in
                                 // two halves taken in turn, so that one product's partials can be written
                                 // while another thread still sums the last one's
    std::vector<int64_t> cols_calls;  // (threads, 16): how many cols products each thread has taken part in
    std::vector<int8_t> xq;      // (copies, B, max_k): x quantized for ROWS_Q8, a copy per thread for few rows
    std::vector<float> xs;       // (copies, B, max_k / 32): its scales
    std::vector<float> sums;     // (threads, B, max_span): a rows span's sums before the epilogue
    std::vector<int32_t> xsums;  // (copies, B, max_k / 32): for ROWS_Q8, each block's sum of xq
    std::vector<int16_t> bsums;  // (threads, B, max_k / 32): for ROWS_Q4K, each block's sum of xq (xs: one scale per 256)
    std::vector<uint8_t> last_group;  // (threads, 16 max_k): a last group of fewer int8 or Q4_K rows, padded

    // cols_n: the widest N of a COLS_F32 matrix, rows_n of a rows matrix, k: the widest K; q4k:
    // whether a ROWS_Q4K matrix may come (its scratch space is then made too)
    Products(int64_t rows, int nthreads, int64_t cols_n, int64_t rows_n, int64_t k, bool q4k)
        : B(rows), threads(nthreads), max_cols_n(cols_n), max_k(k),
          max_span(span_rows(rows_n, rows > ALONE_ROWS ? SPANS * nthreads : nthreads)),
          partial(2 * nthreads * rows * cols_n), cols_calls(16 * nthreads), xq(copies(q4k) * rows * k), xs(copies(q4k) * rows * (k / 32)),
          xsums(copies(q4k) * rows * (k / 32)), sums(nthreads * rows * max_span), bsums(q4k ? nthreads * rows * (k / 32) : 0),
          last_group(nthreads * gpt2attn::GROUP_ROWS * k) {}

    // copies of x quantized: one a thread for a few rows (and always for ROWS_Q4K, whose threads each
    // quantize for themselves), one shared by the threads for a prompt's rows in ROWS_Q8
    int64_t copies(bool q4k) const { return B > ALONE_ROWS && !q4k ? 1 : threads; }

    // y (B, N) (op)= x (B, K) . W + bias, rows of y y_stride apart; ends in a barrier, or where own
    // is given (at most ALONE_ROWS rows of x), gives this thread's outputs those rows and no others,
    // with no barrier after them. inputs (COLS_F32 only; null: its even share): the inputs whose rows
    // of W this thread reads, which may be all it has of x until the threads meet after the partials
    void product(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op, const OwnRows* own = nullptr,
                 const Share* inputs = nullptr) {
        switch (W.kind) {
            case COLS_F32: cols(W, x, y, y_stride, op, own, inputs); break;
            case ROWS_F32: rows<float, false>(W, x, y, y_stride, op, own); break;
            case ROWS_F16: rows<uint16_t, false>(W, x, y, y_stride, op, own); break;
            case ROWS_BF16: rows<uint16_t, true>(W, x, y, y_stride, op, own); break;
            case ROWS_Q8: rows_q8(W, x, y, y_stride, op, own); break;
            case ROWS_Q4K: rows_q4k(W, x, y, y_stride, op, own); break;
        }
    }

    void cols(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op, const OwnRows* own, const Share* inputs) {
        const int64_t K = W.K, N = W.N;
        const float* w = (const float*)W.weight;
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        float* half = partial.data() + cols_calls[16 * t]++ % 2 * T * B * max_cols_n;  // (T, B, N): this product's
        float* mine = half + t * B * max_cols_n;  // (B, N) of this thread
        memset(mine, 0, B * N * sizeof(float));
        // this thread's rows of W, [k0, k1) (an equal share unless inputs says), read as QUARTERS far-apart runs in step
        const Share ks = inputs ? *inputs : even_share(K, t, T);
        const int64_t k0 = ks.first, k1 = ks.end;
        const int64_t run = (k1 - k0) / QUARTERS;
        const int64_t far = run * N;  // from a row of one run to the same row of the next
        for (int64_t i = 0; i < run; i++) {
            const float* w0 = w + (k0 + i) * N;  // row k0 + i, and the rows far, 2 far and 3 far on
            for (int64_t b = 0; b < B; b++) {
                const float* xb = x + b * K + k0 + i;
                const float x4[4] = {xb[0], xb[run], xb[2 * run], xb[3 * run]};
                float* yb = mine + b * N;
                int64_t n = 0;
#ifdef GPT2ATTN_AVX512
                n = cols_pass<Lanes16>(x4, w0, far, yb, n, N);
#endif
                n = cols_pass<Lanes8>(x4, w0, far, yb, n, N);
                for (; n < N; n++) yb[n] += x4[0] * w0[n] + x4[1] * w0[far + n] + x4[2] * w0[2 * far + n] + x4[3] * w0[3 * far + n];
            }
        }
        for (int64_t k = k0 + QUARTERS * run; k < k1; k++)  // what the quarters leave (fewer than QUARTERS rows)
            for (int64_t b = 0; b < B; b++) axpy(mine + b * N, x[b * K + k], w + k * N, N);
#pragma omp barrier
        // the threads' partials summed, bias and epilogue, over slices of the outputs (at most SLICE)
        auto reduce = [&](int64_t b, int64_t n0, int64_t n1) {
            float sum[SLICE];
            memcpy(sum, half + b * N + n0, (n1 - n0) * sizeof(float));
            for (int u = 1; u < T; u++) {
                const float* p = half + u * B * max_cols_n + b * N + n0;
                for (int64_t i = 0; i < n1 - n0; i++) sum[i] += p[i];
            }
            finish(y + b * y_stride + n0, sum, W.bias ? W.bias + n0 : nullptr, n1 - n0, op);
        };
        if (own) {  // this thread's outputs only, no barrier after
            for (int64_t b = 0; b < B; b++)
                for (int64_t part = 0; part < own->parts; part++)
                    for (int64_t n0 = own->first + part * own->stride, end = n0 + own->count; n0 < end; n0 += SLICE)
                        reduce(b, n0, std::min(end, n0 + SLICE));
            return;
        }
        const int64_t per_row = (N + SLICE - 1) / SLICE;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < B * per_row; s++) reduce(s / per_row, s % per_row * SLICE, std::min(N, s % per_row * SLICE + SLICE));
        // implicit barrier
    }

    // A span of rows is read as four far-apart streams, row i of each quarter together in one dot4:
    // a core keeps more reads in flight over four streams than over one (a step 12-17% faster, measured).
    template <typename T, bool bf16>
    void rows(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op, const OwnRows* own) {
        const int64_t K = W.K;
        const T* w = (const T*)W.weight;
        float* mine = sums.data() + omp_get_thread_num() * B * max_span;  // (B, n)
        for_spans(W, B, threads, own, [&](int64_t r0, int64_t r1) {
            const int64_t n = r1 - r0, q = K % 8 == 0 ? n / 4 : 0;
            float out[4];
            for (int64_t i = 0; i < q; i++)
                for (int64_t b = 0; b < B; b++) {
                    dot4<T, bf16>(x + b * K, w + (r0 + i) * K, q * K, K, b == 0, out);
                    for (int j = 0; j < 4; j++) mine[b * n + i + j * q] = out[j];
                }
            for (int64_t r = r0 + 4 * q; r < r1; r++)  // what the quarters leave (the head's last row; odd K)
                for (int64_t b = 0; b < B; b++) {
                    float s = 0.0f;
                    for (int64_t k = 0; k < K; k++) s += x[b * K + k] * widen(w[r * K + k], bf16);
                    mine[b * n + r - r0] = s;
                }
            for (int64_t b = 0; b < B; b++)
                finish(y + b * y_stride + r0, mine + b * n, W.bias ? W.bias + r0 : nullptr, n, op);
        });  // implicit barrier
    }

    // The spans of a kind laid out by groups of GROUP_ROWS rows (ROWS_Q8, ROWS_Q4K; group_bytes
    // each): a span's groups as four far-apart streams, group i of each quarter together, then what
    // the quarters leave, the last of all padded if it has fewer rows; the rows of x `chunk` at a
    // time (a chunk of x stays in cache while the span's groups pass, the groups' bytes after the
    // first row). dot(ng, b, group0, stride, out): out[16 g + r] = row b of x . row r of group g,
    // for the ng (4 or 1) groups at group0 + g * stride; pad(group, rows, padded) lays out a last
    // group of fewer rows as a whole one; scale: each row's, or null.
    template <typename Dot, typename Pad>
    void grouped_rows(const Matrix& W, int64_t group_bytes, int64_t chunk, const float* scale, float* y, int64_t y_stride,
                      Epilogue op, const OwnRows* own, Dot&& dot, Pad&& pad) {
        constexpr int64_t G = gpt2attn::GROUP_ROWS;
        const int t = omp_get_thread_num();
        float* mine = sums.data() + t * B * max_span;  // (B, n)
        for_spans(W, B, threads, own, [&](int64_t r0, int64_t r1) {  // r0 starts a group (span_rows; own's rows)
            const int64_t n = r1 - r0, whole = n / G, q = whole / 4;
            const uint8_t* span = (const uint8_t*)W.weight + r0 / G * group_bytes;
            float out[4 * G];
            auto keep = [&](int64_t b, int64_t row, const float* sums_, int64_t rows) {  // row of the span
                for (int64_t r = 0; r < rows; r++) mine[b * n + row + r] = scale ? sums_[r] * scale[r0 + row + r] : sums_[r];
            };
            for (int64_t b0 = 0; b0 < B; b0 += chunk)
                for (int64_t i = 0; i < q; i++)
                    for (int64_t b = b0; b < std::min(B, b0 + chunk); b++) {
                        dot(std::integral_constant<int, 4>(), b, span + i * group_bytes, q * group_bytes, out);
                        for (int quarter = 0; quarter < 4; quarter++) keep(b, (quarter * q + i) * G, out + quarter * G, G);
                    }
            for (int64_t g = 4 * q * G; g < n; g += G) {
                const int64_t rows = std::min(G, n - g);
                const uint8_t* group = span + g / G * group_bytes;
                if (rows < G) {
                    uint8_t* padded = last_group.data() + t * max_k * G;
                    pad(group, rows, padded);
                    group = padded;
                }
                for (int64_t b = 0; b < B; b++) {
                    dot(std::integral_constant<int, 1>(), b, group, 0, out);
                    keep(b, g, out, rows);
                }
            }
            for (int64_t b = 0; b < B; b++)
                finish(y + b * y_stride + r0, mine + b * n, W.bias ? W.bias + r0 : nullptr, n, op);
        });  // implicit barrier
    }

    // int8 rows in groups (simd.h): measured against four rows side by side, each summed across its
    // lanes at the end (2026-11-28, AMD EPYC Zen 5, 2 threads, see docs/cpu-decoding.md), a product
    // of 240 MB read 97% of a plain read of the same bytes instead of 89% when memory read at about
    // 90 GB/s
    void rows_q8(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op, const OwnRows* own) {
        const int64_t K = W.K, nb = K / 32;
        // x quantized: a few rows by every thread for itself (a few microseconds; no barrier before
        // the products), a prompt's rows by the threads together into one copy
        const bool together = B > ALONE_ROWS;
        const int64_t copy = together ? 0 : omp_get_thread_num();
        int8_t* xq_all = xq.data() + copy * B * max_k;  // (B, K)
        float* xs_all = xs.data() + copy * B * (max_k / 32);  // (B, K / 32)
        int32_t* xsums_all = xsums.data() + copy * B * (max_k / 32);  // (B, K / 32)
        if (together) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++)
                gpt2attn::quantize_q8(x + b * K, nb, xq_all + b * K, xs_all + b * nb, xsums_all + b * nb);
            // implicit barrier: every row is quantized before any is read
        } else {
            gpt2attn::quantize_q8(x, B * nb, xq_all, xs_all, xsums_all);
        }
        grouped_rows(
            W, gpt2attn::GROUP_ROWS * K, std::max<int64_t>(1, X_CHUNK_BYTES / K), W.scale, y, y_stride, op, own,
            [&](auto ng, int64_t b, const uint8_t* group0, int64_t stride, float* out) {
                gpt2attn::dot_q8g<decltype(ng)::value>(xq_all + b * K, xs_all + b * nb, xsums_all + b * nb, K, group0, stride, out);
            },
            [&](const uint8_t* group, int64_t rows, uint8_t* padded) { gpt2attn::q8_pad_group(group, rows, K, padded); });
    }

    void rows_q4k(const Matrix& W, const float* x, float* y, int64_t y_stride, Epilogue op, const OwnRows* own) {
        const int64_t K = W.K;
        const int t = omp_get_thread_num();  // each thread quantizes x for itself, as rows_q8 for a few rows
        int8_t* xq_mine = xq.data() + t * B * max_k;
        float* d_mine = xs.data() + t * B * (max_k / 32);
        int16_t* bsums_mine = bsums.data() + t * B * (max_k / 32);
        gpt2attn::quantize_q8k(x, B * K / 256, xq_mine, d_mine, bsums_mine);
        grouped_rows(
            W, K / 256 * gpt2attn::Q4K_GROUP_BYTES, B, nullptr, y, y_stride, op, own,
            [&](auto ng, int64_t b, const uint8_t* group0, int64_t stride, float* out) {
                gpt2attn::dot_q4k<decltype(ng)::value>(xq_mine + b * K, d_mine + b * (K / 256), bsums_mine + b * (K / 32), K,
                                                       group0, stride, out);
            },
            [&](const uint8_t* group, int64_t rows, uint8_t* padded) { gpt2attn::q4k_pad_group(group, rows, K, padded); });
    }
};

// A prompt's products, more than TILE_ROWS rows: y (B, N) = x (B, K) . W + bias in simd.h's register
// tiles. Each thread takes its share of W's columns (cols) or rows (rows) with every row of x, so
// each weight comes from memory once and each output is one thread's sum, in the same order
// whatever the threads. gpt2-small's 48 block products at 128 rows, 2 threads, AMD EPYC Zen 4
// (2026-11-27): fp32 cols 116 ms against MKL's 129-134 (its faster orientation; 151-178 the
// other), fp16 rows 114 ms against 152 for widening slices for MKL, which the tiles replaced.
constexpr int64_t TILE_ROWS = 8;
constexpr int64_t COLS_KC = 384;  // k's of W at a time: the copied block (192 KiB AVX2, 144 KiB AVX-512) stays in L2 for every row of x
// strips copied together, so that each row of W is read as one span of about 512 bytes: 8 strips of
// 16 floats (AVX2), 2 of 48 (AVX-512)
constexpr int64_t COLS_GROUP = std::max<int64_t>(1, 512 / (gpt2attn::COLS_V * gpt2attn::LANES * sizeof(float)));
constexpr int64_t COLS_AHEAD = 4;  // rows of W asked for ahead of the copy

// tile(std::integral_constant<int, rows>) for the rows (1 to MAX) left after a prompt's full tiles:
// one tile of them all, each weight loaded once for them, rather than a tile a row. gpt2-small's 48
// block products at 15 rows (2 threads, Intel Emerald Rapids VM, 2026-11-29): 9-14% less time, fp32
// and fp16, either build; at 130-131 rows -4% to +2%.
template <int MAX, typename Tile>
void tail_rows(int64_t rows, Tile&& tile) {
    if constexpr (MAX >= 1) {
        if (rows == MAX) tile(std::integral_constant<int, MAX>());
        else tail_rows<MAX - 1>(rows, tile);
    }
}

// W as the cols tiles read it, a row of k at a time, copied a block at a time:
//   copy(n, S, width, k0, k1, packed): rows k0 .. k1 - 1 of the S strips of `width` columns from
//                                      column n, into packed ((S, k1 - k0, width): each strip's rows adjacent)
//   at(k, n):                          one weight, for the columns after the last full register
// ColsSource: a Conv1D's (K, N) fp32 weight as it lies, each row of W read as one span (several
// strips at once) and the row COLS_AHEAD below asked for.
struct ColsSource {
    const float* w;
    int64_t K, N;
    void copy(int64_t n, int64_t S, int64_t width, int64_t k0, int64_t k1, float* packed) const {
        for (int64_t k = k0; k < k1; k++) {
            if (k + COLS_AHEAD < K)
                for (int64_t c = 0; c < S * width; c += 16) _mm_prefetch((const char*)(w + (k + COLS_AHEAD) * N + n + c), _MM_HINT_T0);
            for (int64_t s = 0; s < S; s++) memcpy(packed + (s * (k1 - k0) + k - k0) * width, w + k * N + n + s * width, width * sizeof(float));
        }
    }
    float at(int64_t k, int64_t n) const { return w[k * N + n]; }
};

// r[0..7], 8 rows of 8 floats -> their 8 columns, in place
inline void transpose8(__m256 r[8]) {
    __m256 pairs[8], quads[8];
    for (int i = 0; i < 8; i += 2) pairs[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), pairs[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int h = 0; h < 8; h += 4) {
        quads[h] = _mm256_shuffle_ps(pairs[h], pairs[h + 2], 0x44), quads[h + 1] = _mm256_shuffle_ps(pairs[h], pairs[h + 2], 0xEE);
        quads[h + 2] = _mm256_shuffle_ps(pairs[h + 1], pairs[h + 3], 0x44), quads[h + 3] = _mm256_shuffle_ps(pairs[h + 1], pairs[h + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) r[i] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x31);
}

// RowsSource: an (N, K) weight of fp32, fp16 or bf16, transposed (and widened) as it is copied, 8
// rows of W by 8 k's at a time, each row's bytes ROWS_COPY_AHEAD ahead asked for
constexpr int64_t ROWS_COPY_AHEAD = 512;
template <typename T, bool bf16>
struct RowsSource {
    const T* w;
    int64_t K;
    void copy(int64_t n, int64_t S, int64_t width, int64_t k0, int64_t k1, float* packed) const {
        const int64_t rows = k1 - k0, k8 = k0 + rows / 8 * 8;
        for (int64_t s = 0; s < S; s++)
            for (int64_t j = 0; j < width; j += 8) {  // width: a multiple of 8
                const T* from = w + (n + s * width + j) * K;  // W's rows n + s * width + j ..
                float* to = packed + s * rows * width + j;   // .. their columns of packed
                for (int64_t k = k0; k < k8; k += 8) {
                    if (k * (int64_t)sizeof(T) % 64 == 0)  // once a cache line
                        for (int i = 0; i < 8; i++) _mm_prefetch((const char*)(from + i * K + k) + ROWS_COPY_AHEAD, _MM_HINT_T0);
                    __m256 r[8];
                    for (int i = 0; i < 8; i++) r[i] = gpt2attn::load<T>(from + i * K + k, bf16);
                    transpose8(r);
                    for (int i = 0; i < 8; i++) _mm256_storeu_ps(to + (k - k0 + i) * width, r[i]);
                }
                for (int64_t k = k8; k < k1; k++)
                    for (int i = 0; i < 8; i++) to[(k - k0) * width + i] = gpt2attn::widen(from[i * K + k], bf16);
            }
    }
    float at(int64_t k, int64_t n) const { return gpt2attn::widen(w[n * K + k], bf16); }
};

// y[:, n : n + S * V * LANES] for every row of x: S strips of V registers side by side. Each block of
// COLS_KC rows of the strips is first copied into `packed` by `src`, then every row of x passes
// over it. The copy waits on memory and is not overlapped by the tiles, so it weighs most in short
// prompts: against copying one strip at a time, gpt2-small's 48 block products (2 threads, Intel
// Emerald Rapids VM, 2026-11-29) took 36% less time in the AVX2 build at 12 rows, 26% at 24, 12% at
// 128 and 2% at 512; 17%, 0%, 4% and 3% less in the AVX-512 build.
template <int V, typename Source>
void cols_strips(const float* x, int64_t B, int64_t K, const Source& src, int64_t N, int64_t n, int64_t S,
                 const float* bias, float* y, float* packed) {
    using gpt2attn::COLS_MT, gpt2attn::LANES, gpt2attn::cols_tile;
    constexpr int64_t width = V * LANES;
    for (int64_t k0 = 0; k0 < K; k0 += COLS_KC) {
        const int64_t k1 = std::min(K, k0 + COLS_KC), rows = k1 - k0;
        src.copy(n, S, width, k0, k1, packed);
        for (int64_t s = 0; s < S; s++) {
            const float* p = packed + (s * rows - k0) * width;  // row k of strip s at p + k * width
            const float* strip_bias = bias ? bias + s * width : nullptr;
            float* strip_y = y + n + s * width;
            int64_t b = 0;
            for (; b + COLS_MT <= B; b += COLS_MT) cols_tile<COLS_MT, V>(x + b * K, K, p, width, k0, k1, strip_bias, k0 == 0, strip_y + b * N, N);
            if (b < B)
                tail_rows<COLS_MT - 1>(B - b, [&](auto mt) {
                    cols_tile<decltype(mt)::value, V>(x + b * K, K, p, width, k0, k1, strip_bias, k0 == 0, strip_y + b * N, N);
                });
        }
    }
}

template <typename Source>
void cols_tiles(const Matrix& W, const Source& src, const float* x, int64_t B, float* y) {
    using gpt2attn::COLS_V, gpt2attn::LANES;
    const int64_t K = W.K, N = W.N, panel = COLS_V * LANES, panels = N / panel, vec_end = N / LANES * LANES;
    auto bias = [&](int64_t n) { return W.bias ? W.bias + n : nullptr; };
    std::unique_ptr<float[]> packed(new float[COLS_GROUP * COLS_KC * panel]);  // this thread's, filled before read
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;  // this thread's panels, COLS_GROUP at a time
    for (int64_t p = p0; p < p1; p += COLS_GROUP)
        cols_strips<COLS_V>(x, B, K, src, N, p * panel, std::min(COLS_GROUP, p1 - p), bias(p * panel), y, packed.get());
#pragma omp for schedule(static) nowait
    for (int64_t n = panels * panel; n < vec_end; n += LANES) cols_strips<1>(x, B, K, src, N, n, 1, bias(n), y, packed.get());
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++)  // the columns after the last full register
        for (int64_t n = vec_end; n < N; n++) {
            float s = W.bias ? W.bias[n] : 0.0f;
            for (int64_t k = 0; k < K; k++) s = std::fma(x[b * K + k], src.at(k, n), s);  // one rounding, whichever source
            y[b * N + n] = s;
        }  // implicit barrier
}

// y[:, n0 : n0 + NT] for every row of x
template <typename T, bool bf16, int NT>
void rows_strip(const float* x, int64_t B, int64_t K, const T* w, int64_t N, int64_t n0, const float* bias, float* y) {
    using gpt2attn::ROWS_MT, gpt2attn::rows_tile;
    float sums[NT * ROWS_MT];
    auto put = [&](int64_t b, int mt) {
        for (int n = 0; n < NT; n++)
            for (int m = 0; m < mt; m++) y[(b + m) * N + n0 + n] = sums[n * mt + m] + (bias ? bias[n0 + n] : 0.0f);
    };
    int64_t b = 0;
    for (; b + ROWS_MT <= B; b += ROWS_MT) rows_tile<T, bf16, NT, ROWS_MT>(x + b * K, w + n0 * K, K, sums), put(b, ROWS_MT);
    if (b < B)
        tail_rows<ROWS_MT - 1>(B - b, [&](auto mt) {
            rows_tile<T, bf16, NT, decltype(mt)::value>(x + b * K, w + n0 * K, K, sums), put(b, decltype(mt)::value);
        });
}

// A rows weight's prompt of TRANSPOSED_ROWS rows or more takes the cols tiles, its weight transposed
// (and widened) block by block as it is copied; a shorter one the rows tiles (NT rows of W widened
// in registers for ROWS_MT rows of x, no copy), where the copy would cost more than it saves.
// gpt2-small's 48 block products, fp16 weights, 2 threads, Intel Emerald Rapids VM (2026-11-29),
// A/B in one process, time against the rows tiles: 9 rows +21%, 12 rows +11%, 16 rows -7.5%, 24
// rows -9%, 128 rows -30% (133.5 -> 98.4 ms; MKL's fp32 product 92.7), 512 rows -37% (494 -> 349
// ms); the AVX2 build 12 rows +10%, 128 rows -16%; fp32 and bf16 rows at 128 rows -19% and -33%.
// At many rows the rows tiles read all of x again for each tile of W (6 MB at 512 rows of 3072)
// and widen each weight again for each tile of x; the cols tiles do neither.
constexpr int64_t TRANSPOSED_ROWS = 16;

template <typename T, bool bf16>
void rows_tiles(const Matrix& W, const float* x, int64_t B, float* y) {
    using gpt2attn::ROWS_NT;
    const int64_t K = W.K, N = W.N, tiles = N / ROWS_NT;
    const T* w = (const T*)W.weight;
    if (B >= TRANSPOSED_ROWS) return cols_tiles(W, RowsSource<T, bf16>{w, K}, x, B, y);
#pragma omp for schedule(static)
    for (int64_t t = 0; t <= tiles; t++) {  // the last: the rows after the last full tile, one at a time
        if (t < tiles) rows_strip<T, bf16, ROWS_NT>(x, B, K, w, N, t * ROWS_NT, W.bias, y);
        else for (int64_t n = tiles * ROWS_NT; n < N; n++) rows_strip<T, bf16, 1>(x, B, K, w, N, n, W.bias, y);
    }  // implicit barrier
}

void prompt_tiles(const Matrix& W, const float* x, int64_t B, float* y) {
    switch (W.kind) {
        case COLS_F32: cols_tiles(W, ColsSource{(const float*)W.weight, W.K, W.N}, x, B, y); break;
        case ROWS_F32: rows_tiles<float, false>(W, x, B, y); break;
        case ROWS_F16: rows_tiles<uint16_t, false>(W, x, B, y); break;
        case ROWS_BF16: rows_tiles<uint16_t, true>(W, x, B, y); break;
    }
}

// One (row, head) of a step's attention: the new key k and value v (hs) go to index pos of the
// row's cache (keys, values (capacity, hs)), then y (hs) = softmax(q . keys / scale) values over the
// T = pos + 1 cached positions, those key_mask (T), where given, marks 0 left out. p: T floats of scratch.
// The cache comes from memory (a step's weights pass through the caches between one layer's
// attention and the next), so the values are asked for while the keys are read, and next_keys
// (the keys of the head attended next, or null) while the values are summed. Measured on
// gpt2-small's one-call steps at position 64 against asking for nothing (A/B in one process, 2
// threads, AMD EPYC Zen 5, 2026-11-28, memory reading at about 75 GB/s): fp16 3.938 -> 3.900 ms,
// bf16 3.907 -> 3.870, int8 2.097 -> 2.057, plain fp32 7.357 -> 7.326; at about 48 GB/s fp16 5.647
// -> 5.617, int8 2.979 -> 2.957, plain 10.877 -> 10.869.
void attend(const float* q, const float* k, const float* v, float* keys, float* values, int64_t pos, int64_t hs,
            float scale, const int64_t* key_mask, float* p, float* y, const float* next_keys) {
    memcpy(keys + pos * hs, k, hs * sizeof(float));
    memcpy(values + pos * hs, v, hs * sizeof(float));
    const int64_t T = pos + 1;
    // q . key t: four keys at a time through the rows products' dot4 (rows hs apart), where hs is
    // whole registers; one at a time otherwise and for the last few
    int64_t t = 0;
    if (hs % 8 == 0)
        for (; t + 4 <= T; t += 4) {
            for (int64_t i = 0; i < 4 * hs; i += 16) _mm_prefetch((const char*)(values + t * hs + i), _MM_HINT_T0);  // values t..t+3
            dot4<float, false>(q, keys + t * hs, hs, hs, false, p + t);
            for (int j = 0; j < 4; j++) p[t + j] *= scale;
        }
    for (; t < T; t++) p[t] = dot(q, keys + t * hs, hs) * scale;
    float top = -INFINITY;
    for (t = 0; t < T; t++) {
        if (key_mask && !key_mask[t]) p[t] = -INFINITY;
        top = p[t] > top ? p[t] : top;
    }
    t = 0;
    for (; t + 8 <= T; t += 8) _mm256_storeu_ps(p + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(top))));
    for (; t < T; t++) p[t] = std::exp(p[t] - top);
    float total = 0.0f;
    for (t = 0; t < T; t++) {
        if (key_mask && !key_mask[t]) p[t] = 0.0f;  // exp8 gives e^-87 for -inf, not 0
        total += p[t];
    }
    // y = sum over t of (p[t] / total) values[t], 64 outputs at a time in registers (same bits as axpy)
    int64_t i0 = 0;
    for (; i0 + 64 <= hs; i0 += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (t = 0; t < T; t++) {
            if (next_keys && i0 == 0)
                for (int64_t i = 0; i < hs; i += 16) _mm_prefetch((const char*)(next_keys + t * hs + i), _MM_HINT_T0);
            const __m256 w = _mm256_set1_ps(p[t] / total);
            const float* vt = values + t * hs + i0;
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(y + i0 + 8 * j, a[j]);
    }
    if (i0 < hs) {
        memset(y + i0, 0, (hs - i0) * sizeof(float));
        for (t = 0; t < T; t++) axpy(y + i0, p[t] / total, values + t * hs + i0, hs - i0);
    }
}

// The largest of n values and the index of its first occurrence (plus offset), or the index of the
// first NaN (nan) where they hold one, as torch's argmax picks; index -1 for no values.
struct Top {
    float value;
    int64_t index;
    bool nan;
};

Top top_of(const float* p, int64_t n, int64_t offset = 0) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(p + i);
        top = _mm256_max_ps(top, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (float v : lanes) best = v > best ? v : best;
    bool nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < n; i++) nan |= std::isnan(p[i]), best = p[i] > best ? p[i] : best;
    if (n == 0) return {best, -1, false};
    int64_t j = 0;
    if (nan) {
        while (!std::isnan(p[j])) j++;
        return {NAN, offset + j, true};
    }
    const __m256 wanted = _mm256_set1_ps(best);
    for (; j + 8 <= n; j += 8)
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), wanted, _CMP_EQ_OQ))) break;
    while (p[j] != best) j++;  // within the eight found, or in the tail
    return {best, offset + j, false};
}

// Of a and b, b's values coming after a's: the one torch's argmax of both together would pick.
inline Top better(const Top& a, const Top& b) {
    if (a.nan || b.index < 0) return a;
    return b.nan || a.index < 0 || b.value > a.value ? b : a;
}

// Whether every matrix has the sizes and a kind the step's buffers assume (the head is rows: no partials of V).
bool fits(const Model& m) {
    const int64_t C = m.n_embd, inner = m.n_inner;
    auto shaped = [](const Matrix& w, int64_t K, int64_t N) {
        return w.K == K && w.N == N && is_kind(w.kind) && K % k_multiple(w.kind) == 0;
    };
    bool ok = shaped(m.lm_head, C, m.vocab_size) && m.lm_head.kind != COLS_F32 && C / m.n_head * m.n_head == C;
    for (int64_t l = 0; l < m.n_layer; l++) {
        const Layer& L = m.layers[l];
        ok = ok && shaped(L.c_attn, C, 3 * C) && shaped(L.attn_proj, C, C) && shaped(L.c_fc, C, inner) && shaped(L.mlp_proj, inner, C);
    }
    return ok;
}

// 0, -2 for an id outside the vocabulary, -3 for a position past the model's or an index past the cache's.
int check_step(const Model& m, const int64_t* ids, const int64_t* positions, int64_t B, int64_t pos, int64_t capacity) {
    for (int64_t b = 0; b < B; b++) {
        if (ids[b] < 0 || ids[b] >= m.vocab_size) return -2;
        if ((positions ? positions[b] : pos) < 0 || (positions ? positions[b] : pos) >= m.n_positions) return -3;
    }
    return pos < 0 || pos >= capacity ? -3 : 0;
}

// One decoding step of B rows: its buffers, shared by the threads of one parallel region, each of
// which calls run().
struct Step {
    const Model& m;
    const int64_t B, C, nh, hs, inner, V;
    Products products;
    std::vector<float> x, qkv, att, f;  // (B, C) residual, (B, 3C) q k v, (B, C) attention, (B, inner) mlp
    std::vector<float> h, scores;       // each thread's normed rows (B, C) and attention scores (max_pos + 1)

    Step(const Model& model, int64_t rows, int threads, int64_t max_pos)
        : m(model), B(rows), C(m.n_embd), nh(m.n_head), hs(C / nh), inner(m.n_inner), V(m.vocab_size),
          products(B, threads, std::max(3 * C, inner), std::max({3 * C, inner, V}), std::max(inner, C), true),
          x(B * C), qkv(B * 3 * C), att(B * C), f(B * inner), h(threads * B * C), scores(threads * (max_pos + 1)) {}

    // ids (B) at positions (B) (null: pos), as gpt2attn_decode_step; ends in a barrier.
    void run(const int64_t* ids, const int64_t* positions, const int64_t* key_mask, int64_t pos, float* kv,
             int64_t capacity, float* logits) {
        // Every thread normalizes every row for itself (a few microseconds), so no barrier stands
        // between a product and the LayerNorm before the next: each product ends in one, after
        // which x is whole, and the next write to x comes after two more.
        float* normed = &h[omp_get_thread_num() * B * C];  // (B, C)
        auto norm = [&](const float* weight, const float* bias) {
            for (int64_t b = 0; b < B; b++) layer_norm(&x[b * C], weight, bias, m.eps, C, normed + b * C);
        };
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            const float* wpe = m.wpe + (positions ? positions[b] : pos) * C;
            for (int64_t i = 0; i < C; i++) x[b * C + i] = m.wte[ids[b] * C + i] + wpe[i];
        }
        // With a few rows, thread t attends to heads [h0, h1) of every row, and computes those heads'
        // q, k and v itself in c_attn (where each such run of rows is whole groups of 16, as the int8
        // and Q4_K layouts need), so no barrier stands between c_attn and attention: a thread starts
        // on its heads as soon as its own rows are done. Otherwise every (row, head) is handed out in turn.
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const Share own_heads = even_share(nh, t, T);
        const int64_t h0 = own_heads.first, h1 = own_heads.end;
        bool by_heads = B <= ALONE_ROWS;
        for (int u = 0; u < T; u++) {
            const Share heads = even_share(nh, u, T);
            by_heads = by_heads && (heads.end - heads.first) * hs % gpt2attn::GROUP_ROWS == 0;
        }
        const OwnRows heads_rows{h0 * hs, (h1 - h0) * hs, C, 3};  // their rows of q, of k and of v
        const Share heads_inputs{h0 * hs, h1 * hs};              // and their outputs, attn.c_proj's inputs
        const Share mlp_share = even_share(inner, t, T);        // this thread's inputs of a plain mlp.c_proj
        const OwnRows mlp_rows{mlp_share.first, mlp_share.end - mlp_share.first, 0, 1};
        for (int64_t l = 0; l < m.n_layer; l++) {
            const Layer& L = m.layers[l];
            norm(L.ln_1_weight, L.ln_1_bias);
            products.product(L.c_attn, normed, qkv.data(), 3 * C, STORE, by_heads ? &heads_rows : nullptr);  // (B, 3C): q, k, v
            float* p = scores.data() + t * (pos + 1);
            // the cache (capacity, hs) of (row, head) i in this layer: its keys (which 0) or values (1)
            auto cached = [&](int64_t which, int64_t i) { return kv + ((l * 2 + which) * B * nh + i) * capacity * hs; };
            auto attend_to = [&](int64_t b, int64_t head, int64_t next) {  // next: the (row, head) attended next, or -1
                const int64_t bh = b * nh + head;
                const float* q = &qkv[b * 3 * C + head * hs];
                attend(q, q + C, q + 2 * C, cached(0, bh), cached(1, bh), pos, hs, L.attn_scale,
                       key_mask ? key_mask + b * capacity : nullptr, p, &att[b * C + head * hs], next < 0 ? nullptr : cached(0, next));
            };
            // a plain (in, out) attn.c_proj reads the rows of W of this thread's heads' outputs (its
            // partials need nothing else), so it starts when the thread's attention is done
            const bool proj_by_heads = by_heads && L.attn_proj.kind == COLS_F32;
            if (by_heads) {
                for (int64_t b = 0; b < B; b++)
                    for (int64_t head = h0; head < h1; head++)
                        attend_to(b, head, head + 1 < h1 ? b * nh + head + 1 : b + 1 < B ? (b + 1) * nh + h0 : -1);
                if (!proj_by_heads) {
#pragma omp barrier
                }
            } else {
#pragma omp for schedule(static)
                for (int64_t bh = 0; bh < B * nh; bh++)  // (the next may be another thread's: asked for in vain)
                    attend_to(bh / nh, bh % nh, bh + 1 < B * nh ? bh + 1 : -1);
            }
            products.product(L.attn_proj, att.data(), x.data(), C, ADD, nullptr, proj_by_heads ? &heads_inputs : nullptr);  // x += attn
            norm(L.ln_2_weight, L.ln_2_bias);
            // between two plain (in, out) products each thread sums (and passes through GELU) just
            // the outputs of c_fc whose rows of mlp.c_proj it reads next, so no barrier stands between
            const bool plain_mlp = L.c_fc.kind == COLS_F32 && L.mlp_proj.kind == COLS_F32;
            products.product(L.c_fc, normed, f.data(), inner, GELU, plain_mlp ? &mlp_rows : nullptr);  // (B, inner)
            products.product(L.mlp_proj, f.data(), x.data(), C, ADD);   // x += mlp
        }
        norm(m.ln_f_weight, m.ln_f_bias);
        products.product(m.lm_head, normed, logits, V, STORE);  // (B, V)
    }
};

}  // namespace

extern "C" {

// y (B, N) = x (B, K) . W + bias on `threads` threads (more than TILE_ROWS rows of fp32 or 16-bit
// weights: prompt_tiles). Returns 0, or -1 (and computes nothing)
// for a kind it does not know or a quantized matrix whose K is not a multiple of its blocks.
int gpt2attn_product(const Matrix* W, const float* x, int64_t B, float* y, int threads) {
    if (!is_kind(W->kind) || W->K % k_multiple(W->kind) != 0) return -1;
    if (B > TILE_ROWS && W->kind <= ROWS_BF16) {  // a prompt, fp32 or 16-bit weights
#pragma omp parallel num_threads(threads)
        prompt_tiles(*W, x, B, y);
        return 0;
    }
    Products products(B, threads, W->kind == COLS_F32 ? W->N : 0, W->N, W->K, W->kind == ROWS_Q4K);
#pragma omp parallel num_threads(threads)
    products.product(*W, x, y, W->N, STORE);
    return 0;
}

// y = gelu_new(x) for n floats on `threads` threads: the steps' GELU epilogue (finish), for the MLP
// of a prompt through the modules (torch's tanh GELU took 400 us for 128 x 3072 values on 2 threads,
// Intel Emerald Rapids VM, 2026-11-29: 7 ms of a 128-token prompt pass of gpt2-small).
void gpt2attn_gelu(const float* x, int64_t n, float* y, int threads) {
    constexpr int64_t CHUNK = 4096;  // values a thread takes at a time
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) finish(y + i0, x + i0, nullptr, std::min(CHUNK, n - i0), GELU);
}

// out[r] = torch's argmax of row r's n values of x (rows n apart): the index of the largest, the first
// of equal ones, or of the first NaN where the row holds one. Eight values a step, where torch's CPU
// argmax reads one (gpt2-small's 50257 logits: 44 us, 2026-11-27, AMD EPYC Zen 4).
void gpt2attn_argmax(const float* x, int64_t rows, int64_t n, int64_t* out) {
    for (int64_t r = 0; r < rows; r++) out[r] = top_of(x + r * n, n).index;
}

// x (B, K), K a multiple of 32 -> xq (B, K) int8 and xs (B, K/32): per block scale = max|x|/127,
// xq = round-half-even(x / scale) (0 where the block is all zeros), as the torch reference does.
void gpt2attn_quantize_q8(const float* x, int64_t B, int64_t K, int8_t* xq, float* xs) {
    gpt2attn::quantize_q8(x, B * K / 32, xq, xs);
}

// logits (B, V) of the tokens after ids (B), at positions (B) (null: pos for every row), each
// row's cache holding pos entries, of which key_mask (B, capacity) (null: all) marks those to
// attend to; writes the new keys and values into kv (n_layer, 2, B, nh, capacity, hs) at index pos.
// Returns 0, or (computing nothing) -1 when a matrix's sizes or kind do not fit the model's (the
// buffers assume them), -2 for an id outside the vocabulary, -3 for a position past the model's
// or an index past the cache's.
int gpt2attn_decode_step(const Model* model, const int64_t* ids, const int64_t* positions, const int64_t* key_mask,
                          int64_t B, int64_t pos, float* kv, int64_t capacity, float* logits, int threads) {
    if (!fits(*model)) return -1;
    if (const int status = check_step(*model, ids, positions, B, pos, capacity)) return status;
    Step step(*model, B, threads, pos);
#pragma omp parallel num_threads(threads)
    step.run(ids, positions, key_mask, pos, kv, capacity, logits);
    return 0;
}

// generate's greedy loop, up to `steps` tokens, in one parallel region: each time the step of
// tokens (B) (in: each row's last token; out: the last written) at pos + s (positions (B), null: the
// cache's length, count on by one), then each row's argmax as gpt2attn_argmax gives it, or pad for a
// row that unfinished (B) marks 0 when eos (n_eos ids) are given, written to out[b * out_stride + s];
// a row whose token is one of eos is finished (unfinished[b] = 0), and the loop ends early when no
// row is unfinished. logits (B, V): the last step's. Returns how many tokens each row got (the cache
// holds as many more entries); a step that would not fit (decode_step's status: -1 for the first, the
// model; -2, -3 for any, an id or a position out of range) is not taken, the loop ends before it and
// its status goes to *status (else 0), so the caller can raise as the step would have.
int64_t gpt2attn_decode_greedy(const Model* model, int64_t* tokens, int64_t* positions, const int64_t* key_mask,
                               int64_t B, int64_t pos, float* kv, int64_t capacity, float* logits, int threads,
                               int64_t steps, const int64_t* eos, int64_t n_eos, int64_t pad, uint8_t* unfinished,
                               int64_t* out, int64_t out_stride, int32_t* status) {
    const Model& m = *model;
    *status = fits(m) ? check_step(m, tokens, positions, B, pos, capacity) : -1;
    if (*status) return 0;
    const int64_t V = m.vocab_size;
    Step step(m, B, threads, pos + steps - 1);
    std::vector<Top> tops(threads * B);  // (threads, B): each thread's best of its share of every row
    int64_t done = 0;                    // tokens written to every row
    bool stop = false;
#pragma omp parallel num_threads(threads)
    while (!stop) {
        step.run(tokens, positions, key_mask, pos + done, kv, capacity, logits);  // ends in a barrier
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t v0 = V * t / T, v1 = V * (t + 1) / T;
        for (int64_t b = 0; b < B; b++) tops[t * B + b] = top_of(logits + b * V + v0, v1 - v0, v0);
#pragma omp barrier
#pragma omp single
        {
            bool any = false;
            for (int64_t b = 0; b < B; b++) {
                Top best = tops[b];  // the threads' shares in order: the first of equal values, the first NaN
                for (int u = 1; u < T; u++) best = better(best, tops[u * B + b]);
                int64_t token = best.index;
                if (n_eos && !unfinished[b]) token = pad;
                out[b * out_stride + done] = token;
                tokens[b] = token;
                if (n_eos) {
                    for (int64_t e = 0; e < n_eos; e++) unfinished[b] &= token != eos[e];
                    any |= unfinished[b] != 0;
                }
                if (positions) positions[b]++;
            }
            done++;
            stop = done == steps || (n_eos && !any);
            if (!stop && (*status = check_step(m, tokens, positions, B, pos + done, capacity))) stop = true;
        }  // implicit barrier: every thread sees the tokens and stop
    }
    return done;
}

}  // extern "C"
