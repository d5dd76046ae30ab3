/* The elementwise parts of a layer for bfloat16 rows on x86-64 CPUs: the MLP's gated activation, silu(gate) * up,
   in one call; and the sums a decode step adds in place (the residual stream's, a quantized product's bias).

   Built with qdot.c into one library by tc/model/native.py (-O3 -march=native -fopenmp) and loaded with ctypes.
   PyTorch takes three operators for it (the gate and up halves of the fused product, silu, the product), each
   costing several times its hot-loop time in a decode step whose weights have just swept the caches. The
   arithmetic is PyTorch's: silu in float32 as g / (1 + e^-g), rounded to bfloat16, times up in float32, rounded
   again. Only e^x differs (exp8, to ~2 ulp, where PyTorch's is Sleef's to 1), which can move an output by one
   bfloat16 step where the float32 result lies within a few ulp of a rounding boundary. */
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "these kernels need AVX2 and FMA"
#endif

#define TC_ACT_ABI 2
#define PARALLEL_ROWS 16 /* fewer rows than this run on the calling thread: waking others costs more */

int tc_act_abi(void) { return TC_ACT_ABI; }

TC_INLINE __m256 silu8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inner + i] for `rows` contiguous bf16 rows of 2 * inner values
   (the gate half, then the up half) into rows of inner, with the roundings above. */
void tc_silu_mul(const uint16_t* gate_up, int rows, int inner, uint16_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const uint16_t* gate = gate_up + (size_t)r * 2 * inner;
        const uint16_t* up = gate + inner;
        uint16_t* y = out + (size_t)r * inner;
        int i = 0;
        for (; i + 8 <= inner; i += 8)
            bf16x8_store(y + i, _mm256_mul_ps(bf16x8_round(silu8(bf16x8_load(gate + i))), bf16x8_load(up + i)));
        if (i < inner) { /* the tail, through a padded vector */
            uint16_t g[8] = {0}, u[8] = {0}, o[8];
            for (int j = 0; j < inner - i; j++) g[j] = gate[i + j], u[j] = up[i + j];
            bf16x8_store(o, _mm256_mul_ps(bf16x8_round(silu8(bf16x8_load(g))), bf16x8_load(u)));
            for (int j = 0; j < inner - i; j++) y[i + j] = o[j];
        }
    }
}

/* y[r, i] += b[r * b_stride + i] for `rows` contiguous bf16 rows of n: b_stride n adds a row to each row (the
   residual stream's sum), 0 the same row to every row (a bias). Each sum is taken in float32 and rounded to the
   nearest bf16, ties to even: the bits of torch's add_ for every sum that is not NaN (its bf16 kernel computes in
   float32 and rounds the same way; a NaN may come out as another NaN), for one call where PyTorch's costs tens of
   microseconds of dispatch in a step that swept the caches. */
void tc_add_rows(uint16_t* y, const uint16_t* b, int rows, int n, int b_stride) {
    for (int r = 0; r < rows; r++) {
        uint16_t* yr = y + (size_t)r * n;
        const uint16_t* br = b + (size_t)r * b_stride;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            bf16x8_store(yr + i, _mm256_add_ps(bf16x8_load(yr + i), bf16x8_load(br + i)));
        for (; i < n; i++)
            yr[i] = scalar_bf16(scalar_f32(yr[i]) + scalar_f32(br[i]));
    }
}
