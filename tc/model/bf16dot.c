/* bfloat16 products for the few activation rows of a decode step, on x86-64 CPUs: y = x @ W^T (+ bias).

   Built with qdot.c into one library by tc/model/native.py (-O3 -march=native -fopenmp) and loaded with ctypes.
   A decode step's product reads every weight once for one row (or a few) of activations, so its speed is how
   fast the weight streams from memory. oneDNN, behind F.linear and dense.PackedLinear, reached 17-21 GB/s on a
   2-core AVX512-BF16 EPYC that streams 30; reading each weight row whole, in order, one after the other (each
   thread a contiguous half of the rows), with every activation row's dot product taken against it while it is in
   L1, streams at the machine's rate (27-30 GB/s there). Four weight rows at a time instead, a tile as qdot.c
   uses, fell back to 20-21: four interleaved streams defeat the hardware prefetcher where one does not.

   Except for a batch whose activation rows outgrow L1 (several rows of a long weight row, as a down projection's):
   each weight vector then meets activations that come from L2, one load per product, and reading four weight rows
   at a time (a tile) makes each activation load feed four. With AVX512-BF16, the caller asks for tiles (`tiled`);
   the float32 sum of each output is the same either way, term for term, so the result is too.

   Arithmetic: float32 accumulation of bf16 x bf16 products (vdpbf16ps with AVX512-BF16, else exact bf16 -> fp32
   conversion and FMA), the bias added in float32, one rounding to bfloat16 at the end, as oneDNN's bf16 product
   does; only the order of the float32 additions differs from it. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "bf16.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "these kernels need AVX2 and FMA"
#endif

#define TC_BF16DOT_ABI 7
#define MAX_ROWS 8 /* activation rows per pass over the weights: one accumulator each, all in registers */
/* A pass prefetches its weights where it holds `prefetch_rows` or more activation rows (the caller says;
   tc/model/native.py settles it by a probe at load). With 3 or more rows each weight vector feeds that many dot
   products and the hardware prefetcher alone leaves the loop waiting on its loads (as in qdot.c): on a 2-core
   AVX512 EPYC, a [9728, 896] weight went from 14-17 to 18-21 GB/s for 4 and 8 rows, about oneDNN's blocked
   product's rate there. One row is where machines differ: it streamed at the memory's rate without the hint on that
   EPYC, and at 12.6-14.9 GB/s against 15.1-17.6 with it on a 2-core Sapphire Rapids VM (demo shapes, weights from
   memory, both threads). How far ahead, in bytes, is the caller's `prefetch_ahead` (native.py's probe again). */
#define TILE 4 /* weight rows a tile reads together */
#define MAX_STREAMS 8 /* weight streams a thread may walk for one row: 1, 2, 4 or this many */
/* One row may also walk each thread's rows as several streams side by side (`streams` 2, 4 or 8): its share cut
   in that many parts, row j of each part read in turn. Each stream is still read in order, and a thread keeps that
   many times the loads in flight: on a 2-core Sapphire Rapids VM one row of [896, 4864] from memory (both threads,
   the best prefetch for each, in one process) took 466 us in one stream, 414 in two, 365 in four and 321 in eight
   (27 GB/s; int8 226, 173, 153 and 151, int4 125, 96, 88 and 86: qdot.c's tile streams). Each output's float32
   sum is that of one stream, term for term, so the bits are the same; which is fastest here is native.py's
   probe's to say (one_row_prefetch). */

int tc_bf16dot_abi(void) { return TC_BF16DOT_ABI; }

int tc_bf16dot_max_rows(void) { return MAX_ROWS; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The low and high halves of v added: 8 partial sums. */
TC_INLINE __m256 half_sum(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)));
}

/* acc[r] = the sum of a[r]'s 16 lanes for r < M, all rows reduced together: a weight row of the demo model's
   896 columns takes 28 vector steps per activation row, and eight separate reductions (each a chain of shuffles
   and adds) cost about half as much again; one tree of horizontal adds over the eight (sums8) takes a quarter of
   that. On a 2-core AVX512 EPYC, 8 rows of a [9728, 896] weight: 0.78 ms instead of 0.99 (median, interleaved). */
_Static_assert(MAX_ROWS == 8, "reduce_rows adds up eight rows, as sums8 does");

TC_INLINE void reduce_rows(const __m512* a, int M, float* acc) {
    __m256 v[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) v[r] = r < M ? half_sum(a[r]) : _mm256_setzero_ps();
    float out[MAX_ROWS];
    _mm256_storeu_ps(out, sums8(v));
    for (int r = 0; r < M; r++) acc[r] = out[r];
}

/* acc[r] = sum over k of w[k] * x[r][k], for M rows of x (a compile-time constant after inlining) */
TC_INLINE void dot_rows(const uint16_t* w, const uint16_t* x, int k, int M, int prefetch, float* acc) {
    __m512 a[MAX_ROWS], b = _mm512_setzero_ps(); /* b: a second chain for one row, whose adds would wait */
    for (int r = 0; r < M; r++) a[r] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        if (prefetch) _mm_prefetch((const char*)(w + i) + prefetch, _MM_HINT_T0);
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
        if (M == 1 && (i / 32) % 2) {
            b = _mm512_dpbf16_ps(b, wv, (__m512bh)_mm512_loadu_si512(x + i));
            continue;
        }
        for (int r = 0; r < M; r++)
            a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_loadu_si512(x + (size_t)r * k + i));
    }
    if (i < k) { /* the tail: masked loads read zeros past the row's end */
        __mmask32 m = (__mmask32)((1ull << (k - i)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);
        for (int r = 0; r < M; r++)
            a[r] = _mm512_dpbf16_ps(a[r], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x + (size_t)r * k + i));
    }
    a[0] = _mm512_add_ps(a[0], b);
    if (M >= 4) {
        reduce_rows(a, M, acc);
        return;
    }
    for (int r = 0; r < M; r++) acc[r] = _mm512_reduce_add_ps(a[r]);
}

/* dot_rows for one activation row against S weight rows (S <= MAX_STREAMS, a constant after inlining), row s at
   w + s * gap, their vectors loaded in turn: each sum is dot_rows's for M = 1, term for term (the same two chains,
   the same adds). */
TC_INLINE void dot_streams(const uint16_t* w, size_t gap, const uint16_t* x, int k, int prefetch, const int S,
                           float* acc) {
    __m512 a[MAX_STREAMS], b[MAX_STREAMS];
    for (int s = 0; s < S; s++) a[s] = b[s] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        if (prefetch)
            for (int s = 0; s < S; s++) _mm_prefetch((const char*)(w + s * gap + i) + prefetch, _MM_HINT_T0);
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
        for (int s = 0; s < S; s++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(w + s * gap + i);
            if ((i / 32) % 2)
                b[s] = _mm512_dpbf16_ps(b[s], v, xv);
            else
                a[s] = _mm512_dpbf16_ps(a[s], v, xv);
        }
    }
    if (i < k) {
        __mmask32 m = (__mmask32)((1ull << (k - i)) - 1);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i);
        for (int s = 0; s < S; s++)
            a[s] = _mm512_dpbf16_ps(a[s], (__m512bh)_mm512_maskz_loadu_epi16(m, w + s * gap + i), xv);
    }
    for (int s = 0; s < S; s++) acc[s] = _mm512_reduce_add_ps(_mm512_add_ps(a[s], b[s]));
}

/* dot_rows for the TILE weight rows from w (each k long) at once: acc[t][r] for weight row t and activation row r.
   Each activation vector loaded feeds TILE products; the float32 additions of each output are those of dot_rows
   for M > 1, in the same order, so the sums are identical. Measured on a 2-core AVX512 EPYC, one thread, weights
   from DRAM, [896, 4864]: 8 rows 0.91-0.94 ms instead of 1.55-1.59, 4 rows 0.77-0.86 instead of 1.15-1.34; and on
   [9728, 896], whose 8 activation rows fit L1, 2.6 ms instead of 1.3: short rows read four at a time lose the
   hardware prefetcher, so tiles are only for activations that do not fit (native.Kernels.bf16_product decides). */
TC_INLINE void dot_tile(const uint16_t* w, const uint16_t* x, int k, int M, int ahead, float (*acc)[MAX_ROWS]) {
    __m512 a[TILE][MAX_ROWS];
    for (int t = 0; t < TILE; t++)
        for (int r = 0; r < M; r++) a[t][r] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh v[TILE];
        for (int t = 0; t < TILE; t++) {
            _mm_prefetch((const char*)(w + (size_t)t * k + i) + ahead, _MM_HINT_T0);
            v[t] = (__m512bh)_mm512_loadu_si512(w + (size_t)t * k + i);
        }
        for (int r = 0; r < M; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)r * k + i);
            for (int t = 0; t < TILE; t++) a[t][r] = _mm512_dpbf16_ps(a[t][r], v[t], xv);
        }
    }
    if (i < k) {
        __mmask32 m = (__mmask32)((1ull << (k - i)) - 1);
        __m512bh v[TILE];
        for (int t = 0; t < TILE; t++) v[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (size_t)t * k + i);
        for (int r = 0; r < M; r++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (size_t)r * k + i);
            for (int t = 0; t < TILE; t++) a[t][r] = _mm512_dpbf16_ps(a[t][r], v[t], xv);
        }
    }
    for (int t = 0; t < TILE; t++) {
        if (M >= 4) {
            reduce_rows(a[t], M, acc[t]);
            continue;
        }
        for (int r = 0; r < M; r++) acc[t][r] = _mm512_reduce_add_ps(a[t][r]);
    }
}
#define HAVE_TILES 1

#else
TC_INLINE void dot_rows(const uint16_t* w, const uint16_t* x, int k, int M, int prefetch, float* acc) {
    __m256 a[MAX_ROWS], b = _mm256_setzero_ps();
    for (int r = 0; r < M; r++) a[r] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        if (prefetch && i % 32 == 0) _mm_prefetch((const char*)(w + i) + prefetch, _MM_HINT_T0);
        __m256 wv = bf16x8_load(w + i);
        if (M == 1 && (i / 8) % 2) {
            b = _mm256_fmadd_ps(wv, bf16x8_load(x + i), b);
            continue;
        }
        for (int r = 0; r < M; r++) a[r] = _mm256_fmadd_ps(wv, bf16x8_load(x + (size_t)r * k + i), a[r]);
    }
    a[0] = _mm256_add_ps(a[0], b);
    for (int r = 0; r < M; r++) {
        acc[r] = sum8(a[r]);
        for (int j = i; j < k; j++) acc[r] += scalar_f32(w[j]) * scalar_f32(x[(size_t)r * k + j]);
    }
}

/* dot_rows for one activation row against S weight rows at w + s * gap, loaded in turn (as above). */
TC_INLINE void dot_streams(const uint16_t* w, size_t gap, const uint16_t* x, int k, int prefetch, const int S,
                           float* acc) {
    __m256 a[MAX_STREAMS], b[MAX_STREAMS];
    for (int s = 0; s < S; s++) a[s] = b[s] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        if (prefetch && i % 32 == 0)
            for (int s = 0; s < S; s++) _mm_prefetch((const char*)(w + s * gap + i) + prefetch, _MM_HINT_T0);
        __m256 xv = bf16x8_load(x + i);
        for (int s = 0; s < S; s++) {
            __m256 v = bf16x8_load(w + s * gap + i);
            if ((i / 8) % 2)
                b[s] = _mm256_fmadd_ps(v, xv, b[s]);
            else
                a[s] = _mm256_fmadd_ps(v, xv, a[s]);
        }
    }
    for (int s = 0; s < S; s++) {
        acc[s] = sum8(_mm256_add_ps(a[s], b[s]));
        for (int j = i; j < k; j++) acc[s] += scalar_f32(w[s * gap + j]) * scalar_f32(x[j]);
    }
}
#endif

#ifndef HAVE_TILES /* without AVX512-BF16, one weight row at a time, tiled or not */
#define HAVE_TILES 0
#define dot_tile(w, x, k, M, ahead, acc) ((void)0)
#endif

/* output j of rows [0, M): the float32 sums plus the bias, rounded once */
#define STORE(M, acc, j)                                                                                            \
    do {                                                                                                            \
        const float b_ = bias ? scalar_f32(bias[j]) : 0.f;                                                          \
        for (int r = 0; r < M; r++) y[(size_t)r * n + (j)] = scalar_bf16((acc)[r] + b_);                            \
    } while (0)

/* rows [0, M) of y = x @ W^T + bias, one function per M <= MAX_ROWS: OpenMP outlines the loop into a function of
   its own, where M must already be a constant for the accumulators to stay in registers. With tiles, the rows
   past the last whole tile go one at a time. */
#define PRODUCT(M)                                                                                                  \
    static void product_##M(const uint16_t* x, int k, const uint16_t* w, int n, const uint16_t* bias, uint16_t* y,  \
                            int nthreads, int tiled, int prefetch_rows, int ahead, int streams) {                   \
        const int prefetch = M >= prefetch_rows ? ahead : 0; /* bytes ahead, or none */                            \
        int done = 0;                                                                                               \
        if (tiled && HAVE_TILES) {                                                                                  \
            done = n - n % TILE;                                                                                    \
            _Pragma("omp parallel for num_threads(nthreads) schedule(static)") for (int j = 0; j < done; j += TILE) { \
                float acc[TILE][MAX_ROWS];                                                                          \
                dot_tile(w + (size_t)j * k, x, k, M, ahead, acc);                                                   \
                for (int t = 0; t < TILE; t++) STORE(M, acc[t], j + t);                                             \
            }                                                                                                       \
        }                                                                                                           \
        if (done == n) return; /* an empty loop would still wake the threads */                                 \
        if (M == 1 && streams > 1) {                                                                                \
            _Pragma("omp parallel num_threads(nthreads)") {                                                         \
                const int t = omp_get_thread_num(), threads = omp_get_num_threads();                                \
                const int lo = done + (int)((long)(n - done) * t / threads);                                        \
                const int hi = done + (int)((long)(n - done) * (t + 1) / threads), part = (hi - lo) / streams;     \
                for (int j = lo; j < lo + part; j++) {                                                              \
                    float acc[MAX_STREAMS];                                                                         \
                    if (streams == 8)                                                                               \
                        dot_streams(w + (size_t)j * k, (size_t)part * k, x, k, prefetch, 8, acc);                   \
                    else if (streams == 4)                                                                          \
                        dot_streams(w + (size_t)j * k, (size_t)part * k, x, k, prefetch, 4, acc);                   \
                    else                                                                                            \
                        dot_streams(w + (size_t)j * k, (size_t)part * k, x, k, prefetch, 2, acc);                   \
                    for (int s = 0; s < streams; s++) STORE(1, acc + s, j + s * part);                              \
                }                                                                                                   \
                for (int j = lo + streams * part; j < hi; j++) { /* the rows of a share past its streams' */        \
                    float acc[1];                                                                                   \
                    dot_rows(w + (size_t)j * k, x, k, 1, prefetch, acc);                                            \
                    STORE(1, acc, j);                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            return;                                                                                                 \
        }                                                                                                           \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)") for (int j = done; j < n; j++) {       \
            float acc[M];                                                                                           \
            dot_rows(w + (size_t)j * k, x, k, M, prefetch, acc);                                                    \
            STORE(M, acc, j);                                                                                       \
        }                                                                                                           \
    }
PRODUCT(1)
PRODUCT(2)
PRODUCT(3)
PRODUCT(4)
PRODUCT(5)
PRODUCT(6)
PRODUCT(7)
PRODUCT(8)

/* y [m, n] = x [m, k] @ w [n, k]^T (+ bias [n], or NULL), all contiguous bfloat16, in passes of MAX_ROWS rows
   (each pass reads the weights once); tiled: passes of several rows read the weight in tiles (dot_tile); passes
   of prefetch_rows or more rows prefetch their weights (tiles always do), prefetch_ahead bytes ahead; a pass of one
   row walks each thread's rows as `streams` (1, 2, 4 or 8) streams (dot_streams). */
void tc_bf16_linear(const uint16_t* x, int m, int k, const uint16_t* w, int n, const uint16_t* bias, uint16_t* y,
                    int nthreads, int tiled, int prefetch_rows, int prefetch_ahead, int streams) {
    for (int r0 = 0; r0 < m; r0 += MAX_ROWS) {
        const int rows = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
        const uint16_t* xs = x + (size_t)r0 * k;
        uint16_t* ys = y + (size_t)r0 * n;
        const int tile = tiled && rows > 1; /* one row has its own order of additions (dot_rows) */
        switch (rows) {
            case 1: product_1(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            case 2: product_2(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            case 3: product_3(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            case 4: product_4(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            case 5: product_5(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            case 6: product_6(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            case 7: product_7(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
            default: product_8(xs, k, w, n, bias, ys, nthreads, tile, prefetch_rows, prefetch_ahead, streams); break;
        }
    }
}
