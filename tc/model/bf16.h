/* bfloat16 <-> float32 for the native kernels (qdot.c, attention.c, norm.c, bf16dot.c, act.c): one definition of
   the rounding every kernel's output must share with torch's own conversion; and the float32 sums and e^x they
   share. */
#ifndef TC_BF16_H
#define TC_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TC_INLINE static inline __attribute__((always_inline))

/* 8 bf16 values -> float32 (exact: a bf16 is the high half of a float32) */
TC_INLINE __m256 bf16x8_load(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* float32 -> the nearest bf16, ties to even, as torch's float -> bfloat16 conversion does (the inputs are
   finite), still held as float32 */
TC_INLINE __m256 bf16x8_round(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 float32 values -> bf16 at p, rounded as bf16x8_round */
TC_INLINE void bf16x8_store(uint16_t* p, __m256 v) {
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(bf16x8_round(v)), 16);
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

/* one float32 -> bf16 and one bf16 -> float32, for scalar tails and single outputs, rounded as the vectors are */
TC_INLINE uint16_t scalar_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

TC_INLINE float scalar_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* the sum of 8 float32 lanes */
TC_INLINE float sum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at once. hadd(p, q) = [p01 p23 q01 q23 | p45 p67 q45 q67],
   so two rounds leave a[r]'s sum of lanes 0-3 in lane r % 4 of the low half and of lanes 4-7 in the high half,
   a[0..3] in u0 and a[4..7] in u1. */
TC_INLINE __m256 sums8(const __m256* a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x in float32 to ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' polynomial, times 2^n. Below -87
   (where e^x is under float32's normal range) it returns e^-87. Above 88.37, where 2^n would leave float32's
   exponents, it takes e^(x - ln 2) and doubles it, which overflows to infinity past 88.72 as e^x does. A NaN
   stays NaN (maxps and minps return their second operand when either is NaN, and the comparison is false for
   it), so a NaN or infinite score spoils the attention's output as it does SDPA's rather than vanishing into the
   softmax. */
TC_INLINE __m256 exp8(__m256 x) {
    const __m256 high = _mm256_cmp_ps(x, _mm256_set1_ps(88.3762626647949f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(89.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
    x = _mm256_sub_ps(x, _mm256_and_ps(high, _mm256_set1_ps(0.693147180559945f)));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
    return _mm256_blendv_ps(e, _mm256_add_ps(e, e), high);
}

#endif
