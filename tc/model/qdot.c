/* Weight-only quantized products for x86-64 CPUs: int4 and int8 weights times activations quantized to int8.

   Built at run time by tc/model/native.py with the machine's C compiler (-O3 -march=native -fopenmp) and loaded
   with ctypes; see that module for why and for what it is checked against.

   Both products work on tiles of 8 weight rows laid out so that one 32-byte vector holds 4 consecutive columns
   of each of the 8 rows: a u8 x s8 dot-product instruction (vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd, the
   latter once per activation block for int4: int4_accumulate) then adds 4 products into each of 8 int32 lanes,
   one lane per weight row, against the same 4 activation codes broadcast to every lane. Nothing is ever summed
   across lanes, and every weight vector loaded serves up to MR activation rows at once, which is what makes a
   batch of rows cost little more than one.

   Activations are quantized per row and per XGROUP columns: xq = round(x / xs), xs = max|x| / 127 over the
   block (small blocks, as llama.cpp's Q8_0: a large activation in one channel coarsens only its own block).
   The result is then exactly (up to float summation order) the product of the dequantized activations with the
   dequantized weights, which is the reference the Python side checks against. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "these kernels need AVX2 and FMA"
#endif

#define TC_QDOT_ABI 12
#if defined(__AVX512VL__)
#define MR 8 /* activation rows per pass over a tile: 32 vector registers hold their accumulators */
#else
#define MR 4 /* ... 16 registers */
#endif
#define MB 64 /* activation rows per block: a block's codes stay in cache while the weights stream past */
#define XGROUP 32 /* activation columns per quantization block */
#define MAX_STREAMS 8 /* tile streams a thread may walk for one row: 1, 2, 4 or this many */
/* A tile prefetches its weights, `prefetch_ahead` bytes ahead, where it serves `prefetch_rows` or more activation
   rows (the caller says both; tc/model/native.py settles them for each kind of product by a probe at load). With many rows each 32-byte weight
   vector feeds that many dot products, and the hardware prefetcher alone left the loop waiting on its loads: on a
   2-core AVX512 EPYC, 8 rows took 10.7 ms instead of 12.2 (median) over a 12-layer int4 stage of the demo model,
   and 8.9 instead of 10.7 over its int8 lm_head; 4 rows 10% less; and on another, over the int4 products of 24 demo
   layers (40 interleaved steps each way), 2 rows 11.6 ms instead of 13.8 and 3 rows 13.4 instead of 15.6, and the
   int8 lm_head at 2 rows 5.9 ms instead of 7.3. One row is where machines differ: an int8 row streams near the
   memory's rate without it on a Zen 4 EPYC (2.5% slower with it over 12 demo layers) and an int4 row was 12% faster
   with it there (5.6 ms against 6.3 over 12 layers); on a 2-core Sapphire Rapids VM both gained 25-30% (an int8
   row of the demo shapes at 14.5-17.6 GB/s against 11.7-13.8). */

int tc_qdot_abi(void) { return TC_QDOT_ABI; }

int tc_qdot_rows_per_pass(void) { return MR; }

int tc_qdot_activation_group(void) { return XGROUP; }

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
#define HAS_VNNI 1 /* a u8 x s8 dot product into int32 lanes is one instruction */
#else
#define HAS_VNNI 0
#endif

TC_INLINE __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    /* pairs of u8 x s8 products fit int16 here: dot_s8s8 keeps |u| <= 127 (int4 tiles sum in int16 themselves) */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if HAS_VNNI
#define S8_OFFSET 128 /* dot_s8s8 adds 128 * sum(x): its unsigned operand is w + 128 */
TC_INLINE __m256i dot_s8s8(__m256i acc, __m256i w, __m256i x) {
    __m256i u = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* in place: for the intrinsic, GCC gave each row's accumulator a fresh register every step and copied it back,
       two moves per product that took the front end's bandwidth with many rows (8 rows of the demo's int8 lm_head:
       8.6 ms against 10.7 on a Zen 4 EPYC; the same bits). The int4 tile, whose products chain in pairs, was
       slower so and keeps the intrinsic. */
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x));
    return acc;
#else
    return dot_u8s8(acc, u, x);
#endif
}
#else
#define S8_OFFSET 0
TC_INLINE __m256i dot_s8s8(__m256i acc, __m256i w, __m256i x) {
    return dot_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

TC_INLINE __m256 load8(const void* x, int bf16, size_t i) {
    return bf16 ? bf16x8_load((const uint16_t*)x + i) : _mm256_loadu_ps((const float*)x + i);
}

/* y_bf16 says how a product's outputs are written: 0 float32, 1 bfloat16, 2 rounded to bfloat16 and written as
   float32 (the values of 1 widened, for a caller that wants them in float32: the head's logits) */
TC_INLINE void store8(void* y, int y_bf16, size_t i, __m256 v) {
    if (y_bf16 == 1)
        bf16x8_store((uint16_t*)y + i, v);
    else
        _mm256_storeu_ps((float*)y + i, y_bf16 == 2 ? bf16x8_round(v) : v);
}

/* A tile's prefetch of the weights `ahead` bytes past vector kb (32 bytes each, one 64-byte line per two) where it
   serves `from_rows` or more activation rows. */
TC_INLINE void prefetch_weights(const void* tile, int kb, int mr, int from_rows, int ahead) {
    if (mr >= from_rows && !(kb & 1))
        _mm_prefetch((const char*)tile + (size_t)kb * 32 + ahead, _MM_HINT_T0);
}

TC_INLINE __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* An int4 vector's codes as two vectors of bytes: its low nibbles (columns 0-3 of each row) and its high ones. */
TC_INLINE void int4_nibbles(__m256i v, __m256i* lo, __m256i* hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(v, mask);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
}

/* Adds one vector's int4 products within an activation block: low nibbles `lo` against activation codes xl,
   high ones `hi` against xh. With VNNI into two int32 chains (hi_acc may be lo_acc itself: one chain).
   Without VNNI a u8 x s8 dot product is two multiplies, vpmaddubsw (pairs of products summed into int16 lanes)
   and vpmaddwd (pairs of those widened into int32): here the int16 pair sums of the whole block are added in
   lo_acc first and widened once, by int4_block_sums: exact, since a block's (XGROUP / 4 of them, each at most
   2 x 15 x 127) fit int16, and 9 multiplies a block and row instead of 16. The products of many rows (a prefill)
   are bound by those multiplies: on a 2-core AVX2 Zen 3 EPYC (same bits) the demo's int4 products of 64 or 256
   rows took 1.43-1.46x less time, a prefill of 128 positions through 12 int4 layers 0.64-0.70x the time; and one
   row, over weights in DRAM, ~10% less at every prefetch and stream setting. */
_Static_assert(XGROUP / 4 * 2 * 15 * 127 <= 32767, "an int4 block's pair sums must fit int16");
TC_INLINE void int4_accumulate(__m256i* lo_acc, __m256i* hi_acc, __m256i lo, __m256i hi, __m256i xl, __m256i xh) {
#if HAS_VNNI
    *lo_acc = dot_u8s8(*lo_acc, lo, xl);
    *hi_acc = dot_u8s8(*hi_acc, hi, xh);
#else
    (void)hi_acc;
    *lo_acc = _mm256_add_epi16(*lo_acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
#endif
}

/* A block's int32 sums per lane from int4_accumulate's accumulators (`split`: two chains, to be added). */
TC_INLINE __m256i int4_block_sums(__m256i lo_acc, __m256i hi_acc, int split) {
#if HAS_VNNI
    return split ? _mm256_add_epi32(lo_acc, hi_acc) : lo_acc;
#else
    (void)hi_acc, (void)split;
    return _mm256_madd_epi16(lo_acc, _mm256_set1_epi16(1));
#endif
}

/* Row m of x -> its codes and, per XGROUP columns, xs (scale) and xqsum (sum of codes). */
static void quantize_row(const void* x, int bf16, int m, int K, int8_t* xq, float* xs, int32_t* xqsum) {
    int B = K / XGROUP;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int b = 0; b < B; b++) {
        size_t at = (size_t)m * K + (size_t)b * XGROUP;
        __m256 v[XGROUP / 8], vmax = _mm256_setzero_ps();
        for (int i = 0; i < XGROUP / 8; i++) {
            v[i] = load8(x, bf16, at + 8 * i);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i sum = _mm256_setzero_si256();
        int32_t lanes[XGROUP];
        for (int i = 0; i < XGROUP / 8; i++) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)); /* rounds to nearest even */
            sum = _mm256_add_epi32(sum, q);
            _mm256_storeu_si256((__m256i*)(lanes + 8 * i), q);
        }
        for (int l = 0; l < XGROUP; l++) xq[at + l] = (int8_t)lanes[l];
        _mm256_storeu_si256((__m256i*)lanes, sum);
        int32_t total = 0;
        for (int l = 0; l < 8; l++) total += lanes[l];
        xs[m * B + b] = amax / 127.f;
        xqsum[m * B + b] = total;
    }
}

/* int4 tile t = weight rows 8t..8t+7: packed bytes [N/8, K/8, 8, 4], byte (t, kb, r, b) holding the code of
   W[8t+r, 8kb+b] in its low nibble and of W[8t+r, 8kb+4+b] in its high one (w = (c - 8) * scale + zero);
   scales and zeros bf16 [N/8, K/group, 8]. Activation rows m0..m0+mr-1, mr <= MR; xg[m, g]: the sum of row m's
   dequantized activations over group g (int4_group_sums), for the zero points.
   Each block's integer dot products are scaled by the activations' scale into a sum per group, and that by the
   weights' scale once per group: two vector operations a row and block, not three, with the zero points' sums
   made once per row rather than once per tile, where 8 rows of them had no registers left. */
TC_INLINE void int4_tile(const int mr, const int8_t* xq, const float* xs, const float* xg, int K,
                             const uint8_t* packed, const uint16_t* scales, const uint16_t* zeros, int G, int group,
                             int t, int m0, int N, void* y, int y_bf16, int prefetch_rows, int prefetch_ahead) {
    const uint8_t* wt = packed + (size_t)t * 4 * K;
    const int B = K / XGROUP, BPG = group / XGROUP;
    __m256 acc[MR];
    for (int j = 0; j < mr; j++) acc[j] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256 gacc[MR];
        for (int j = 0; j < mr; j++) gacc[j] = _mm256_setzero_ps();
        for (int b = g * BPG; b < (g + 1) * BPG; b++) {
            /* with VNNI a few rows get two independent chains each (low and high nibbles) to keep the dot-product
               unit busy; many rows have chains enough, and their registers are needed for the accumulators */
            const int split = HAS_VNNI && mr <= 4;
            __m256i lo_acc[MR], hi_acc[MR];
            for (int j = 0; j < mr; j++) lo_acc[j] = hi_acc[j] = _mm256_setzero_si256();
            for (int kb = b * (XGROUP / 8); kb < (b + 1) * (XGROUP / 8); kb++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(wt + (size_t)kb * 32)), lo, hi;
                prefetch_weights(wt, kb, mr, prefetch_rows, prefetch_ahead);
                int4_nibbles(v, &lo, &hi);
                for (int j = 0; j < mr; j++) {
                    const int8_t* xp = xq + (size_t)(m0 + j) * K + kb * 8;
                    int4_accumulate(&lo_acc[j], split ? &hi_acc[j] : &lo_acc[j], lo, hi, bcast4(xp), bcast4(xp + 4));
                }
            }
            for (int j = 0; j < mr; j++) {
                __m256 dot = _mm256_cvtepi32_ps(int4_block_sums(lo_acc[j], hi_acc[j], split));
                gacc[j] = _mm256_fmadd_ps(dot, _mm256_set1_ps(xs[(m0 + j) * B + b]), gacc[j]);
            }
        }
        __m256 s = bf16x8_load(scales + ((size_t)t * G + g) * 8);
        __m256 zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, bf16x8_load(zeros + ((size_t)t * G + g) * 8));
        for (int j = 0; j < mr; j++) {
            acc[j] = _mm256_fmadd_ps(gacc[j], s, acc[j]);
            acc[j] = _mm256_fmadd_ps(zc, _mm256_set1_ps(xg[(m0 + j) * G + g]), acc[j]);
        }
    }
    for (int j = 0; j < mr; j++) store8(y, y_bf16, (size_t)(m0 + j) * N + (size_t)t * 8, acc[j]);
}

/* int4_tile for one activation row against S tiles at once (S <= MAX_STREAMS, a constant after inlining), tile
   t + s * gap for s < S, their vectors loaded in turn: several streams of weights a thread (int8_tile_streams says
   why). Each tile's sums are int4_tile's for one row, step for step. */
TC_INLINE void int4_tile_streams(const int8_t* xq, const float* xs, const float* xg, int K, const uint8_t* packed,
                                 const uint16_t* scales, const uint16_t* zeros, int G, int group, int t, int gap,
                                 const int S, void* y, int y_bf16, int prefetch_rows, int prefetch_ahead) {
    const int BPG = group / XGROUP;
    __m256 acc[MAX_STREAMS];
    for (int s = 0; s < S; s++) acc[s] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256 gacc[MAX_STREAMS];
        for (int s = 0; s < S; s++) gacc[s] = _mm256_setzero_ps();
        for (int b = g * BPG; b < (g + 1) * BPG; b++) {
            __m256i lo_acc[MAX_STREAMS], hi_acc[MAX_STREAMS];
            for (int s = 0; s < S; s++) lo_acc[s] = hi_acc[s] = _mm256_setzero_si256();
            for (int kb = b * (XGROUP / 8); kb < (b + 1) * (XGROUP / 8); kb++) {
                __m256i xl = bcast4(xq + kb * 8), xh = bcast4(xq + kb * 8 + 4);
                for (int s = 0; s < S; s++) {
                    const uint8_t* wt = packed + (size_t)(t + s * gap) * 4 * K;
                    __m256i v = _mm256_loadu_si256((const __m256i*)(wt + (size_t)kb * 32)), lo, hi;
                    prefetch_weights(wt, kb, 1, prefetch_rows, prefetch_ahead);
                    int4_nibbles(v, &lo, &hi);
                    int4_accumulate(&lo_acc[s], &hi_acc[s], lo, hi, xl, xh);
                }
            }
            __m256 scale = _mm256_set1_ps(xs[b]);
            for (int s = 0; s < S; s++)
                gacc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int4_block_sums(lo_acc[s], hi_acc[s], 1)), scale, gacc[s]);
        }
        __m256 sum = _mm256_set1_ps(xg[g]);
        for (int s = 0; s < S; s++) {
            const size_t at = ((size_t)(t + s * gap) * G + g) * 8;
            __m256 sc = bf16x8_load(scales + at);
            __m256 zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sc, bf16x8_load(zeros + at));
            acc[s] = _mm256_fmadd_ps(zc, sum, _mm256_fmadd_ps(gacc[s], sc, acc[s]));
        }
    }
    for (int s = 0; s < S; s++) store8(y, y_bf16, (size_t)(t + s * gap) * 8, acc[s]);
}

/* xg[m, g] for int4_tile: row m's dequantized activations summed over each group of `group` columns. */
static void int4_group_sums(const float* xs, const int32_t* xqsum, int m, int K, int group, float* xg) {
    const int B = K / XGROUP, BPG = group / XGROUP, G = K / group;
    for (int g = 0; g < G; g++) {
        float sum = 0.f;
        for (int b = g * BPG; b < (g + 1) * BPG; b++) sum += xs[m * B + b] * (float)xqsum[m * B + b];
        xg[m * G + g] = sum;
    }
}

/* int8 tile t: qweight bytes [N/8, K/4, 8, 4], byte (t, kb, r, b) = W[8t+r, 4kb+b]; a float scale per row. */
TC_INLINE void int8_tile(const int mr, const int8_t* xq, const float* xs, const int32_t* xqsum, int K,
                             const int8_t* qweight, const float* wscale, int t, int m0, int N, void* y, int y_bf16,
                             int prefetch_rows, int prefetch_ahead) {
    const int8_t* wt = qweight + (size_t)t * 8 * K;
    const int B = K / XGROUP;
    __m256 acc[MR];
    for (int j = 0; j < mr; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < B; b++) {
        __m256i iacc[MR];
        for (int j = 0; j < mr; j++) iacc[j] = _mm256_setzero_si256();
        for (int kb = b * (XGROUP / 4); kb < (b + 1) * (XGROUP / 4); kb++) {
            __m256i w = _mm256_loadu_si256((const __m256i*)(wt + (size_t)kb * 32));
            prefetch_weights(wt, kb, mr, prefetch_rows, prefetch_ahead);
            for (int j = 0; j < mr; j++) iacc[j] = dot_s8s8(iacc[j], w, bcast4(xq + (size_t)(m0 + j) * K + kb * 4));
        }
        for (int j = 0; j < mr; j++) {
            int mb = (m0 + j) * B + b;
            __m256i dot = _mm256_sub_epi32(iacc[j], _mm256_set1_epi32(S8_OFFSET * xqsum[mb]));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xs[mb]), acc[j]);
        }
    }
    __m256 ws = _mm256_loadu_ps(wscale + (size_t)t * 8);
    for (int j = 0; j < mr; j++) store8(y, y_bf16, (size_t)(m0 + j) * N + (size_t)t * 8, _mm256_mul_ps(acc[j], ws));
}

/* int8_tile for one activation row against S tiles at once (S <= MAX_STREAMS, a constant after inlining), tile
   t + s * gap for s < S, their vectors loaded in turn: several streams of weights a thread, as bf16dot.c's
   dot_streams (where that says why). Each tile's sums are int8_tile's, step for step, so the bits are the same. */
TC_INLINE void int8_tile_streams(const int8_t* xq, const float* xs, const int32_t* xqsum, int K,
                                 const int8_t* qweight, const float* wscale, int t, int gap, const int S, void* y,
                                 int y_bf16, int prefetch_rows, int prefetch_ahead) {
    const int B = K / XGROUP;
    __m256 acc[MAX_STREAMS];
    for (int s = 0; s < S; s++) acc[s] = _mm256_setzero_ps();
    for (int b = 0; b < B; b++) {
        __m256i iacc[MAX_STREAMS];
        for (int s = 0; s < S; s++) iacc[s] = _mm256_setzero_si256();
        for (int kb = b * (XGROUP / 4); kb < (b + 1) * (XGROUP / 4); kb++) {
            __m256i xv = bcast4(xq + kb * 4);
            for (int s = 0; s < S; s++) {
                const int8_t* wt = qweight + (size_t)(t + s * gap) * 8 * K;
                __m256i w = _mm256_loadu_si256((const __m256i*)(wt + (size_t)kb * 32));
                prefetch_weights(wt, kb, 1, prefetch_rows, prefetch_ahead);
                iacc[s] = dot_s8s8(iacc[s], w, xv);
            }
        }
        __m256i offset = _mm256_set1_epi32(S8_OFFSET * xqsum[b]);
        __m256 scale = _mm256_set1_ps(xs[b]);
        for (int s = 0; s < S; s++)
            acc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(iacc[s], offset)), scale, acc[s]);
    }
    for (int s = 0; s < S; s++) {
        const size_t tile = (size_t)(t + s * gap);
        store8(y, y_bf16, tile * 8, _mm256_mul_ps(acc[s], _mm256_loadu_ps(wscale + tile * 8)));
    }
}

/* Scratch for the activation codes, one per calling thread, grown as needed and kept. */
static __thread void* scratch;
static __thread size_t scratch_bytes;

static void* scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = malloc(bytes);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* Quantize x's rows, then run CALL(r) on every tile and every group of r <= MR rows, in one parallel region. */
#define PRODUCT(CALL, PREP, STREAMS)                                                                          \
    size_t codes = ((size_t)M * K + 63) / 64 * 64, blocks = (size_t)M * (K / XGROUP);                        \
    int8_t* xq = (int8_t*)scratch_for(codes + blocks * 12);                                                   \
    if (!xq) return -1;                                                                                       \
    float* xs = (float*)(xq + codes);                                                                         \
    int32_t* xqsum = (int32_t*)(xs + blocks);                                                                 \
    float* xg = (float*)(xqsum + blocks); /* int4: per row and group, at most a float per block */            \
    (void)xg;                                                                                                 \
    _Pragma("omp parallel num_threads(nthreads)") {                                                           \
        _Pragma("omp for schedule(static)") for (int m = 0; m < M; m++) {                                     \
            quantize_row(x, x_bf16, m, K, xq, xs, xqsum);                                                     \
            PREP;                                                                                             \
        }                                                                                                     \
        if (M == 1 && streams > 1) { /* one row, each thread's tiles walked as several streams */            \
            const int t_ = omp_get_thread_num(), threads_ = omp_get_num_threads(), tiles_ = N / 8;            \
            const int lo_ = (int)((long)tiles_ * t_ / threads_), hi_ = (int)((long)tiles_ * (t_ + 1) / threads_); \
            const int part_ = (hi_ - lo_) / streams;                                                          \
            for (int t = lo_; t < lo_ + part_; t++) {                                                         \
                if (streams == 8)                                                                             \
                    STREAMS(t, part_, 8);                                                                     \
                else if (streams == 4)                                                                        \
                    STREAMS(t, part_, 4);                                                                     \
                else                                                                                          \
                    STREAMS(t, part_, 2);                                                                     \
            }                                                                                                 \
            for (int t = lo_ + streams * part_; t < hi_; t++) { /* the tiles of a share past its streams' */  \
                const int m0 = 0;                                                                             \
                CALL(1);                                                                                      \
            }                                                                                                 \
        } else                                                                                                \
        for (int mb = 0; mb < M; mb += MB) {                                                                  \
            int m1 = mb + MB < M ? mb + MB : M;                                                               \
            _Pragma("omp for schedule(static) nowait") for (int t = 0; t < N / 8; t++) {                      \
                int m0 = mb;                                                                                  \
                for (; m0 + MR <= m1; m0 += MR) CALL(MR);                                                     \
                switch (m1 - m0) {                                                                            \
                    REMAINDERS(CALL)                                                                          \
                    case 3: CALL(3); break;                                                                   \
                    case 2: CALL(2); break;                                                                   \
                    case 1: CALL(1); break;                                                                   \
                    default: break;                                                                           \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    return 0;

#if MR == 8
#define REMAINDERS(CALL) case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break; case 4: CALL(4); break;
#else
#define REMAINDERS(CALL)
#endif

/* y[M, N] = x[M, K] @ W^T for an int4 W (layout above); x and y float32, or bfloat16 where *_bf16.
   N a multiple of 8, group a multiple of XGROUP dividing K; a pass of prefetch_rows or more activation rows
   prefetches its weights, prefetch_ahead bytes ahead (above); one row walks each thread's tiles as `streams` (1, 2,
   4 or 8) streams (int4_tile_streams). Returns 0, or -1 if scratch memory ran out. */
int tc_int4_linear(const void* x, int x_bf16, int M, int K, const uint8_t* packed, const uint16_t* scales,
                   const uint16_t* zeros, int N, int group, void* y, int y_bf16, int nthreads, int prefetch_rows,
                   int prefetch_ahead, int streams) {
    int G = K / group;
#define INT4_CALL(R) \
    int4_tile(R, xq, xs, xg, K, packed, scales, zeros, G, group, t, m0, N, y, y_bf16, prefetch_rows, prefetch_ahead)
#define INT4_STREAMS(T, GAP, S)                                                                       \
    int4_tile_streams(xq, xs, xg, K, packed, scales, zeros, G, group, T, GAP, S, y, y_bf16, prefetch_rows, \
                      prefetch_ahead)
    PRODUCT(INT4_CALL, int4_group_sums(xs, xqsum, m, K, group, xg), INT4_STREAMS)
}

/* y[M, N] = x[M, K] @ W^T for an int8 W (layout above); N a multiple of 8, K of XGROUP; a pass of prefetch_rows
   or more activation rows prefetches its weights, prefetch_ahead bytes ahead; one row walks each thread's tiles as
   `streams` (1, 2, 4 or 8) streams (int8_tile_streams). Returns 0, or -1 if scratch memory ran out. */
int tc_int8_linear(const void* x, int x_bf16, int M, int K, const int8_t* qweight, const float* wscale, int N,
                   void* y, int y_bf16, int nthreads, int prefetch_rows, int prefetch_ahead, int streams) {
#define INT8_CALL(R) \
    int8_tile(R, xq, xs, xqsum, K, qweight, wscale, t, m0, N, y, y_bf16, prefetch_rows, prefetch_ahead)
#define INT8_STREAMS(T, GAP, S) \
    int8_tile_streams(xq, xs, xqsum, K, qweight, wscale, T, GAP, S, y, y_bf16, prefetch_rows, prefetch_ahead)
    PRODUCT(INT8_CALL, (void)0, INT8_STREAMS)
}


/* Weights laid back out as plain bfloat16 rows, for prefill-sized products: there the codes-by-codes products above
   cost compute for every activation row, while a CPU with bfloat16 matrix units (AMX) multiplies converted weights
   several times faster, so converting a slab of rows and multiplying it densely wins (quant.py's dense prefill,
   chosen by a probe at load). Both take rows [8 t0, 8 t1) (whole tiles) into out [8 (t1 - t0), K]. */

/* int4: (code - 8) * scale + zero, to the nearest bf16: quant.dequantize_int4's float32 value converted by torch,
   bit for bit, since (code - 8) * scale (a 4-bit integer times a bf16) is exact in float32, fused or not. */
void tc_int4_dequantize(const uint8_t* packed, const uint16_t* scales, const uint16_t* zeros, int K, int group,
                        int t0, int t1, uint16_t* out, int nthreads) {
    const int KB = K / 8, G = K / group, per_group = group / 8;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = t0; t < t1; t++) {
        for (int r = 0; r < 8; r++) {
            uint16_t* row = out + ((size_t)(t - t0) * 8 + r) * K;
            for (int g = 0; g < G; g++) {
                const size_t param = ((size_t)t * G + g) * 8 + r;
                const __m256 s = _mm256_set1_ps(scalar_f32(scales[param]));
                const __m256 z = _mm256_set1_ps(scalar_f32(zeros[param]));
                for (int kb = g * per_group; kb < (g + 1) * per_group; kb++) {
                    uint32_t b; /* columns 8kb+0..3 in the low nibbles, 8kb+4..7 in the high ones */
                    memcpy(&b, packed + (((size_t)t * KB + kb) * 8 + r) * 4, 4);
                    const uint64_t codes = (uint64_t)(b & 0x0F0F0F0Fu) | ((uint64_t)((b >> 4) & 0x0F0F0F0Fu) << 32);
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)codes)));
                    const __m256 signed_codes = _mm256_sub_ps(v, _mm256_set1_ps(8.f));
                    bf16x8_store(row + (size_t)kb * 8, _mm256_add_ps(_mm256_mul_ps(signed_codes, s), z));
                }
            }
        }
    }
}

/* int8: the codes themselves, exact in bf16 (|code| <= 127); the row scales are applied after the product. */
void tc_int8_dequantize(const int8_t* qweight, int K, int t0, int t1, uint16_t* out, int nthreads) {
    const int K4 = K / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = t0; t < t1; t++) {
        for (int r = 0; r < 8; r++) {
            uint16_t* row = out + ((size_t)(t - t0) * 8 + r) * K;
            for (int kb = 0; kb < K4; kb += 2) { /* columns 4kb..4kb+7: two 4-byte groups, 32 bytes apart */
                uint32_t lo, hi;
                memcpy(&lo, qweight + (((size_t)t * K4 + kb) * 8 + r) * 4, 4);
                memcpy(&hi, qweight + (((size_t)t * K4 + kb + 1) * 8 + r) * 4, 4);
                const __m128i codes = _mm_cvtsi64_si128((long long)((uint64_t)lo | ((uint64_t)hi << 32)));
                bf16x8_store(row + (size_t)kb * 4, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
            }
        }
    }
}

/* x [M, K] (float32, or bfloat16 where x_bf16) as the products above see it, for the rows a prompt multiplies
   densely: quantized per row and XGROUP columns by quantize_row, and back (code * scale in float32), rounded to
   bf16, which is native.quantize_activations' value converted by torch. With it the dense way differs from the
   codes-by-codes products only in roundings of the last bits, so a decode row computed beside a prompt's chunk
   comes out as it would alone, up to those bits. */
void tc_quantize_activations(const void* x, int x_bf16, int M, int K, uint16_t* out, int nthreads) {
    const int B = K / XGROUP;
    const size_t element = x_bf16 ? 2 : 4;
#pragma omp parallel num_threads(nthreads) if (M >= 16)
    {
        int8_t xq[K]; /* one row's codes on this thread's stack: K bytes, and 8 per XGROUP columns */
        float xs[B];
        int32_t xqsum[B];
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            quantize_row((const char*)x + (size_t)m * K * element, x_bf16, 0, K, xq, xs, xqsum);
            uint16_t* row = out + (size_t)m * K;
            for (int b = 0; b < B; b++) {
                const __m256 scale = _mm256_set1_ps(xs[b]);
                for (int i = 0; i < XGROUP; i += 8) {
                    const __m128i codes = _mm_loadl_epi64((const __m128i*)(xq + b * XGROUP + i));
                    bf16x8_store(row + b * XGROUP + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)),
                                                                      scale));
                }
            }
        }
    }
}
