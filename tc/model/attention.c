/* Decode attention for x86-64 CPUs: one new position per sequence, many sequences in one call.

   Built with qdot.c into one library by tc/model/native.py (-O3 -march=native -fopenmp) and loaded with ctypes;
   see that module for why and for what it is checked against.

   A decode step of a batch attends one query row per sequence to that sequence's own cache. PyTorch does that as
   one scaled_dot_product_attention call per sequence and layer, and at decode sizes each call costs ~25 us of
   dispatch and setup for a few microseconds of arithmetic: 8 sequences through 12 layers spent ~3.5 ms a step in
   those calls. Here one call per layer stores every sequence's new key and value in its cache and attends all of
   them, one task per (sequence, KV head) spread over the OpenMP threads.

   The arithmetic is SDPA's, in float32 from bfloat16 inputs: scores q . k * scale for the query heads sharing a
   KV head, a softmax over every cached position (max subtracted, then exp, then the sum), the weighted sum of
   the values, and one rounding of the output to bfloat16.

   Given each row's rotary cos and sin, it also rotates the query and the key heads before attending and storing
   them, with rope.rotate_'s roundings, so a decode step of native rows needs none of rotate_'s operators: each of
   those costs several times its hot-loop time in a step, whose weights have just swept the caches (a 12-layer int4
   stage spent 0.5-0.9 ms a step in rotate_ on a 2-core AVX512 EPYC). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "these kernels need AVX2 and FMA"
#endif

#define TC_ATTENTION_ABI 3

int tc_attention_abi(void) { return TC_ATTENTION_ABI; }

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_DIM 256   /* head size */
#define KB 8          /* keys (or values) converted to float32 at a time, then used by every query head */

/* rows [t0, t0 + n) of a bf16 [T, D] matrix as float32 rows of D in f, the rows past n zero */
TC_INLINE void convert_rows(const uint16_t* m, int t0, int n, int D, float* f) {
    for (int k = 0; k < KB; k++)
        for (int i = 0; i < D; i += 8)
            _mm256_store_ps(f + k * D + i, k < n ? bf16x8_load(m + (size_t)(t0 + k) * D + i) : _mm256_setzero_ps());
}

/* scores[j, t] = q_j . k_t for the G query heads (qf [G, D] float32, already scaled) and keys [T, D] (bf16) */
static void scores_of(const float* qf, const uint16_t* keys, int T, int G, int D, float* scores) {
    float kf[KB * MAX_DIM] __attribute__((aligned(32)));
    for (int t0 = 0; t0 < T; t0 += KB) {
        const int n = T - t0 < KB ? T - t0 : KB;
        convert_rows(keys, t0, n, D, kf);
        for (int j = 0; j < G; j++) {
            __m256 a[KB];
            for (int k = 0; k < KB; k++) a[k] = _mm256_setzero_ps();
            for (int i = 0; i < D; i += 8) {
                __m256 q = _mm256_load_ps(qf + j * D + i);
                for (int k = 0; k < KB; k++) a[k] = _mm256_fmadd_ps(q, _mm256_load_ps(kf + k * D + i), a[k]);
            }
            float sums[KB] __attribute__((aligned(32)));
            _mm256_store_ps(sums, sums8(a));
            memcpy(scores + (size_t)j * T + t0, sums, (size_t)n * sizeof(float));
        }
    }
}

/* scores[j, :] -> exp(scores - max) in place; returns 1 / their sum */
static float softmax_numerators(float* s, int T) {
    /* The largest score, 8 lanes at a time: the scalar loop is one chain of dependent compares, which the compiler
       may not vectorize (NaN), and took a fifth of the kernel at 4096 positions. max_ps(x, top) keeps top where x
       is NaN, as the scalar loop did. */
    __m256 vtop = _mm256_set1_ps(s[0]);
    int t = 0;
    for (; t + 8 <= T; t += 8) vtop = _mm256_max_ps(_mm256_loadu_ps(s + t), vtop);
    float lanes[8] __attribute__((aligned(32)));
    _mm256_store_ps(lanes, vtop);
    float top = lanes[0];
    for (int l = 1; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    for (; t < T; t++) top = s[t] > top ? s[t] : top;
    vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    t = 0;
    for (; t + 8 <= T; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vtop));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float total = sum8(vsum);
    if (t < T) {
        float tail[8] __attribute__((aligned(32)));
        for (int l = 0; l < 8; l++) tail[l] = l < T - t ? s[t + l] : top; /* unused lanes: e^0 */
        _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), vtop)));
        for (int l = 0; l < T - t; l++) total += tail[l];
        memcpy(s + t, tail, (size_t)(T - t) * sizeof(float));
    }
    return 1.f / total;
}

/* acc[j, :] += sum over t of p[j, t] * v_t for the G heads (acc [G, D] float32) and values [T, D] (bf16). Kept
   out of line: inlined into the OpenMP task beside scores_wide, it ran ~8% slower there. */
__attribute__((noinline)) static void weighted_values(const float* p, const uint16_t* values, int T, int G, int D,
                                                      float* acc) {
    float vf[KB * MAX_DIM] __attribute__((aligned(32)));
    for (int t0 = 0; t0 < T; t0 += KB) {
        const int n = T - t0 < KB ? T - t0 : KB;
        convert_rows(values, t0, n, D, vf);
        for (int j = 0; j < G; j++) {
            const float* pj = p + (size_t)j * T + t0;
            float* aj = acc + j * D;
            int i0 = 0;
            for (; i0 + 64 <= D; i0 += 64) { /* 8 accumulators held in registers over the block's keys */
                __m256 r[8];
                for (int v = 0; v < 8; v++) r[v] = _mm256_load_ps(aj + i0 + 8 * v);
                for (int k = 0; k < n; k++) {
                    __m256 w = _mm256_set1_ps(pj[k]);
                    for (int v = 0; v < 8; v++)
                        r[v] = _mm256_fmadd_ps(w, _mm256_load_ps(vf + k * D + i0 + 8 * v), r[v]);
                }
                for (int v = 0; v < 8; v++) _mm256_store_ps(aj + i0 + 8 * v, r[v]);
            }
            for (; i0 < D; i0 += 8) {
                __m256 r = _mm256_load_ps(aj + i0);
                for (int k = 0; k < n; k++)
                    r = _mm256_fmadd_ps(_mm256_set1_ps(pj[k]), _mm256_load_ps(vf + k * D + i0), r);
                _mm256_store_ps(aj + i0, r);
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* weighted_values for G query heads known when compiled, D a multiple of 32, with AVX-512: 32 columns at a time,
   every head's sums of those columns held in registers over all T positions (2 G of the 32 registers), each value
   row read and widened once for all G heads, each weight broadcast from memory into its FMA. weighted_values
   widens a block of rows into scratch memory, then reads it back and loads and stores every head's sums once a
   block; at 4096 positions that took ~40% of the kernel's time. Every sum is the same chain of FMAs over t in
   the same order, so the result is the same to the bit. */
#define MAX_WIDE_GROUP 8 /* 2 G sums in registers, with the two widened halves of a row */
TC_INLINE void values_wide(const float* p, const uint16_t* values, int T, const int G, int D, float* acc) {
    for (int i0 = 0; i0 < D; i0 += 32) {
        __m512 lo[MAX_WIDE_GROUP], hi[MAX_WIDE_GROUP];
        for (int j = 0; j < G; j++) lo[j] = hi[j] = _mm512_setzero_ps();
        const uint16_t* v = values + i0;
        for (int t = 0; t < T; t++, v += D) {
            const __m512i x = _mm512_loadu_si512(v); /* 32 bf16 */
            const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_castsi512_si256(x)), 16));
            const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1)), 16));
            for (int j = 0; j < G; j++) {
                const __m512 w = _mm512_set1_ps(p[(size_t)j * T + t]);
                lo[j] = _mm512_fmadd_ps(w, a, lo[j]);
                hi[j] = _mm512_fmadd_ps(w, b, hi[j]);
            }
        }
        for (int j = 0; j < G; j++) {
            _mm512_storeu_ps(acc + j * D + i0, lo[j]);
            _mm512_storeu_ps(acc + j * D + i0 + 16, hi[j]);
        }
    }
}

#define VALUES_WIDE(g) \
    case g:            \
        values_wide(p, values, T, g, D, acc); \
        return 1;

/* values_wide where it takes the shape (returns 1), else 0: each G its own copy, so that the compiler holds the
   heads' sums in registers */
static int values_wide_for(const float* p, const uint16_t* values, int T, int G, int D, float* acc) {
    if (D % 32 != 0) return 0;
    switch (G) {
        VALUES_WIDE(1) VALUES_WIDE(2) VALUES_WIDE(3) VALUES_WIDE(4)
        VALUES_WIDE(5) VALUES_WIDE(6) VALUES_WIDE(7) VALUES_WIDE(8)
    }
    return 0;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* With AVX512-BF16 and heads of a multiple of 32 (attend_group), the scores come straight from the bf16 query
   and keys, 32 products a vdpbf16ps (exact products, float32 sums), then times the scale, where the 256-bit path
   converts every key to float32 first. On a 2-core AVX512 EPYC, one sequence's attention (14 heads over 2 of 64)
   took 36 us instead of 41 at 550 positions and 126 instead of 143 at 2000 (median, interleaved); the values'
   sums 16 lanes at a time gained nothing there and stay 8. Only the order of float32 additions, and the scale
   applied to the sum rather than to the query, differ. */
#define WIDE_ATTENTION 1

/* The sum of 16 lanes, for eight vectors at once: their halves added, then sums8. */
TC_INLINE __m256 sums8_wide(const __m512* a) {
    __m256 h[8];
    for (int k = 0; k < 8; k++)
        h[k] = _mm256_add_ps(_mm512_castps512_ps256(a[k]),
                             _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(a[k]), 1)));
    return sums8(h);
}

/* scores[j, t] = scale * (q_j . k_t) for the G query heads (q [G, D] bf16) and keys [T, D] (bf16), D % 32 == 0 */
static void scores_wide(const uint16_t* q, const uint16_t* keys, int T, int G, int D, float scale, float* scores) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int t0 = 0; t0 < T; t0 += KB) {
        const int n = T - t0 < KB ? T - t0 : KB;
        const uint16_t* kt = keys + (size_t)t0 * D;
        for (int j = 0; j < G; j++) {
            __m512 a[KB];
            for (int k = 0; k < KB; k++) a[k] = _mm512_setzero_ps();
            for (int i = 0; i < D; i += 32) {
                __m512bh qv = (__m512bh)_mm512_loadu_si512(q + (size_t)j * D + i);
                if (n == KB) {
                    for (int k = 0; k < KB; k++)
                        a[k] = _mm512_dpbf16_ps(a[k], qv, (__m512bh)_mm512_loadu_si512(kt + (size_t)k * D + i));
                } else {
                    for (int k = 0; k < n; k++)
                        a[k] = _mm512_dpbf16_ps(a[k], qv, (__m512bh)_mm512_loadu_si512(kt + (size_t)k * D + i));
                }
            }
            float sums[KB] __attribute__((aligned(32)));
            _mm256_store_ps(sums, _mm256_mul_ps(sums8_wide(a), vscale));
            memcpy(scores + (size_t)j * T + t0, sums, (size_t)n * sizeof(float));
        }
    }
}
#endif

/* heads [n, D] bf16 rotated into out as rope.rotate_ rotates them: x * cos + swap(x) * sin, where swap exchanges
   the two halves of a head and sin (a row of Rotary's table, bf16 [D]) has its first half negated, each product
   rounded to bf16 and then their sum, as PyTorch's bf16 operators round each result */
static void rotate_heads(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int n, int D, uint16_t* out) {
    const int half = D / 2;
    for (int h = 0; h < n; h++, x += D, out += D) {
        if (half % 8 == 0) {
            for (int i = 0; i < D; i += 8) {
                const int j = i < half ? i + half : i - half;
                __m256 a = bf16x8_round(_mm256_mul_ps(bf16x8_load(x + i), bf16x8_load(cos + i)));
                __m256 b = bf16x8_round(_mm256_mul_ps(bf16x8_load(x + j), bf16x8_load(sin + i)));
                bf16x8_store(out + i, _mm256_add_ps(a, b));
            }
            continue;
        }
        for (int i = 0; i < D; i++) { /* halves that are not whole vectors */
            const int j = i < half ? i + half : i - half;
            const float a = scalar_f32(scalar_bf16(scalar_f32(x[i]) * scalar_f32(cos[i])));
            const float b = scalar_f32(scalar_bf16(scalar_f32(x[j]) * scalar_f32(sin[i])));
            out[i] = scalar_bf16(a + b);
        }
    }
}

/* scores[j, t] = q_j . k_t * scale for the G query heads (q [G, D] bf16) and keys [T, D] (bf16): scores_wide where
   it runs, else scores_of on the query scaled first, as SDPA scales it */
static void scores_scaled(const uint16_t* q, const uint16_t* keys, int T, int G, int D, float scale, float* scores) {
#ifdef WIDE_ATTENTION
    if (D % 32 == 0) {
        scores_wide(q, keys, T, G, D, scale, scores);
        return;
    }
#endif
    float qf[MAX_GROUP * MAX_DIM] __attribute__((aligned(32)));
    for (int j = 0; j < G; j++)
        for (int i = 0; i < D; i += 8)
            _mm256_store_ps(qf + j * D + i, _mm256_mul_ps(bf16x8_load(q + (size_t)j * D + i), _mm256_set1_ps(scale)));
    scores_of(qf, keys, T, G, D, scores);
}

/* One sequence's query heads g*G .. g*G+G-1 against KV head g: keys and values [T, D] (bf16, rows of D),
   q [G, D] bf16, out [G, D] bf16; scores [G, T] float32 scratch. */
static void attend_group(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int T, int G, int D,
                         float scale, float* scores, uint16_t* out) {
    float acc[MAX_GROUP * MAX_DIM] __attribute__((aligned(32)));
    memset(acc, 0, (size_t)G * D * sizeof(float));
    scores_scaled(q, keys, T, G, D, scale, scores);
    float inv[MAX_GROUP];
    for (int j = 0; j < G; j++) inv[j] = softmax_numerators(scores + (size_t)j * T, T);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (!values_wide_for(scores, values, T, G, D, acc))
#endif
        weighted_values(scores, values, T, G, D, acc);
    for (int j = 0; j < G; j++)
        for (int i = 0; i < D; i += 8)
            bf16x8_store(out + (size_t)j * D + i,
                         _mm256_mul_ps(_mm256_load_ps(acc + j * D + i), _mm256_set1_ps(inv[j])));
}

/* A decode step's attention for n sequences, all bf16. Sequence s's query, key and value heads are row rows[s]
   of qkv ([rows, (H + 2 H_kv) D]: H query heads, H_kv key heads, H_kv value heads); its cache for this layer
   starts at slots[s], laid out [2 (keys, values), H_kv, capacity[s], D]; its new position is positions[s]
   (< capacity[s]). The key and value are stored at that position, and the attention of the H query heads over
   positions [0, positions[s]] goes to row rows[s] of out ([rows, H D]). With cos and sin ([rows, D] bf16, row
   rows[s] for sequence s; or NULL), the query and key heads are rotated first (rotate_heads); qkv is only read.
   Several of the n may be one sequence's consecutive positions (a draft checked in one step: the same slots, each
   its own row and position): every key and value is stored before any row attends, so each sees those before it.
   D a multiple of 8 up to MAX_DIM, H / H_kv up to MAX_GROUP. Returns 0, -1 if scratch memory ran out, -2 for a
   shape it does not take. */
int tc_decode_attention(int n, const int64_t* slots, const int32_t* positions, const int32_t* capacity,
                        const int32_t* rows, const uint16_t* qkv, uint16_t* out, int H, int H_kv, int D, float scale,
                        const uint16_t* cos, const uint16_t* sin, int nthreads) {
    if (H_kv <= 0 || H % H_kv != 0 || H / H_kv > MAX_GROUP || D % 8 != 0 || D > MAX_DIM) return -2;
    const int G = H / H_kv;
    const size_t row = (size_t)(H + 2 * H_kv) * D;
    int failed = 0;
    /* The stores first, on this thread: a few hundred bytes each, where a parallel region of their own would cost
       more than they do. */
    for (int task = 0; task < n * H_kv; task++) {
        const int s = task / H_kv, g = task % H_kv, pos = positions[s];
        uint16_t* keys = (uint16_t*)(intptr_t)slots[s] + (size_t)g * capacity[s] * D;
        uint16_t* values = (uint16_t*)(intptr_t)slots[s] + (size_t)(H_kv + g) * capacity[s] * D;
        const uint16_t* x = qkv + (size_t)rows[s] * row;
        if (cos) {
            const size_t r = (size_t)rows[s] * D;
            rotate_heads(x + (size_t)(H + g) * D, cos + r, sin + r, 1, D, keys + (size_t)pos * D);
        } else {
            memcpy(keys + (size_t)pos * D, x + (size_t)(H + g) * D, (size_t)D * 2);
        }
        memcpy(values + (size_t)pos * D, x + (size_t)(H + H_kv + g) * D, (size_t)D * 2);
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : failed)
    for (int task = 0; task < n * H_kv; task++) {
        const int s = task / H_kv, g = task % H_kv, pos = positions[s], T = pos + 1;
        const uint16_t* keys = (uint16_t*)(intptr_t)slots[s] + (size_t)g * capacity[s] * D;
        const uint16_t* values = (uint16_t*)(intptr_t)slots[s] + (size_t)(H_kv + g) * capacity[s] * D;
        const uint16_t* q = qkv + (size_t)rows[s] * row + (size_t)g * G * D;
        uint16_t rotated[MAX_GROUP * MAX_DIM];
        if (cos) {
            const size_t r = (size_t)rows[s] * D;
            rotate_heads(q, cos + r, sin + r, G, D, rotated);
            q = rotated;
        }
        float* scores = (float*)malloc((size_t)G * T * sizeof(float));
        if (!scores) {
            failed = 1;
            continue;
        }
        attend_group(q, keys, values, T, G, D, scale, scores, out + (size_t)rows[s] * H * D + (size_t)g * G * D);
        free(scores);
    }
    return failed ? -1 : 0;
}
