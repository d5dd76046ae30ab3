/* bfloat16 <-> float32 for the native kernels (qdot.c, attention.c, norm.c): one definition of the rounding
   every kernel's output must share with torch's own conversion. */
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

#endif
