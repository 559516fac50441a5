// How fast this machine reads memory, the bound of a decoding step: the benchmarks' read rate.
// Built and loaded by bench_common.read_sum (with gpt2attn.kernels' build and cache).
//
// The sum of n floats, read on `threads` threads. Each thread reads its share as `streams` equal
// runs in step, 32 floats of each in turn: a core keeps more reads in flight over several
// far-apart streams than over one (on this project's machines one stream a core read 4% to 28%
// slower than eight, by the run).

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

extern "C" float read_sum(const float* p, int64_t n, int threads, int streams) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t blocks = n / 32, per = blocks / omp_get_num_threads(), extra = blocks % omp_get_num_threads();
        const int t = omp_get_thread_num();
        const int64_t i0 = 32 * (t * per + (t < extra ? t : extra)), i1 = i0 + 32 * (per + (t < extra ? 1 : 0));
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
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        float sum = 0.0f;
        for (float v : lanes) sum += v;
        for (int64_t i = i0 + streams * run; i < i1; i++) sum += p[i];  // what the runs leave
        if (t == omp_get_num_threads() - 1)
            for (int64_t i = 32 * blocks; i < n; i++) sum += p[i];  // the last partial block
        total += sum;
    }
    return total;
}
