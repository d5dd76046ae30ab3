/* RMS normalisation of bfloat16 rows for x86-64 CPUs, in one call instead of PyTorch's six operators.

   Built with qdot.c into one library by tc/model/native.py (-O3 -march=native -fopenmp) and loaded with ctypes.
   A decoder layer normalises its hidden states twice; PyTorch does it as a conversion to float32, the fused
   rms_norm (itself pow, mean, add, rsqrt and mul at these sizes) and a conversion back, then the weight's
   product: ~40 us a call at decode sizes, ~1 ms of a 12-layer stage's step. The arithmetic here is the
   reference's (tc/model/qwen2.py RMSNorm, transformers' Qwen2RMSNorm): in float32, x * rsqrt(mean(x^2) + eps),
   rounded to bfloat16, times the weight, rounded to bfloat16 again; only the order of the mean's float32
   additions differs. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "these kernels need AVX2 and FMA"
#endif

#define TC_NORM_ABI 1
#define PARALLEL_ROWS 64 /* fewer rows than this run on the calling thread: waking others costs more */

int tc_norm_abi(void) { return TC_NORM_ABI; }

static void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int n, float eps) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = bf16x8_load(x + i), b = bf16x8_load(x + i + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    float sum = sum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) sum += scalar_f32(x[i]) * scalar_f32(x[i]);
    const float inv = 1.f / sqrtf(sum / (float)n + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 normed = bf16x8_round(_mm256_mul_ps(bf16x8_load(x + i), vinv));
        bf16x8_store(y + i, _mm256_mul_ps(bf16x8_load(w + i), normed));
    }
    for (; i < n; i++) {
        float normed = scalar_f32(scalar_bf16(scalar_f32(x[i]) * inv));
        y[i] = scalar_bf16(scalar_f32(w[i]) * normed);
    }
}

/* y[r, :] = w * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) for `rows` contiguous bf16 rows of n, as above. */
void tc_rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* y, int rows, int n, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) norm_row(x + (size_t)r * n, w, y + (size_t)r * n, n, eps);
}
