/* What our C kernels share: bf16 <-> fp32 as torch converts, and on AVX-512 (unless EPDMESH_SCALAR) 16-lane loads,
 * exp and rounding. Included by cpu_paged.c and cpu_prompt.c; kernels/cbuild.py keys a build by it too. */
#ifndef EPDMESH_CPU_VEC_H
#define EPDMESH_CPU_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#if defined(__AVX512F__) && !defined(EPDMESH_SCALAR)
#include <immintrin.h>
#define VEC 1
/* 16 values from element `at` as fp32 (bf16 widened exactly). */
static inline __m512 load16(const void *src, int64_t at, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + at))), 16));
    return _mm512_loadu_ps((const float *)src + at);
}
/* exp of 16 values, Cephes' expf (≤ 1 ulp as glibc's expf and torch's Sleef exp); NaN stays NaN, below
 * -104 is 0. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* a NaN x is kept: max returns its second operand then */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* f32_to_bf16 then back, 16 at once. */
static inline __m512 round_bf16_16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i even = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), high);
    const __m512i nan = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), even, nan));
}

/* 16 fp32 rounded to bf16 (to nearest even, a NaN kept quiet) and stored at dst. */
static inline void store_bf16_16(uint16_t *dst, __m512 f) {
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_16(f)), 16)));
}
#else
#define VEC 0
#endif
#endif
