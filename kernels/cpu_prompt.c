/* Prompt attention on the CPU: every query row of a prompt (or its last n rows) against the prompt's K/V, causal
 * (aligned bottom-right) or not (the vision tower), with GQA.
 *
 * The arithmetic is that of torch's fused CPU kernel (SDPA's flash attention) with one block of keys: the scores q·k
 * accumulated in fp32 and scaled in fp32; the softmax's exponentials in fp32, their sum in fp32; for bf16, the
 * exponentials rounded to bf16 before their product with V, accumulated in fp32, divided by the sum and rounded
 * once. Only the order of the fp32 sums differs. SDPA runs ~50–110 GFLOP/s on these shapes (head_dim 64, 128–1024
 * tokens) where the cores do ~500 a core: it works a row block at a time through generic GEMM calls.
 *
 * Here a task is 16 query rows of one head. Keys are packed first, once per kv head, in the order the dot-product
 * instruction reads them: 16 keys × pairs of dims (bf16, VDPBF16PS: 16 scores a row from one key load and one
 * broadcast of the row's pair of q values) or 16 keys × 1 dim (fp32, FMA); bf16 values in pairs of tokens. The 16
 * rows' scores stay in registers over a block of 16 keys; their products with V in registers over all keys.
 *
 * AVX-512 only (bf16 also needs AVX512_BF16): `epdmesh_prompt_supports` says whether this build computes a dtype
 * and head_dim; elsewhere the caller keeps SDPA.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_vec.h"

#define ROWS 16
#define MAX_DIM 256

typedef struct {
    int64_t batch, n, len, num_heads, num_kv_heads, head_dim, causal;
    int64_t q_batch, q_tok, q_head, k_batch, k_tok, k_head, v_batch, v_tok, v_head, o_batch, o_tok, o_head;
    float scale;
} prompt_shape;

#if VEC && defined(__AVX512BF16__)
#define BF16 1
#else
#define BF16 0
#endif

int epdmesh_prompt_supports(int bf16, int64_t head_dim) {
    return (bf16 ? BF16 : VEC) && head_dim % 16 == 0 && head_dim <= MAX_DIM;
}

static inline int64_t padded(int64_t len) { return (len + 15) / 16 * 16; }

/* Bytes of scratch a call needs: the packed K and V of every (batch, kv head), then each thread's rows. */
static int64_t pack_bytes(const prompt_shape *s, int64_t item) {
    return 2 * s->batch * s->num_kv_heads * padded(s->len) * s->head_dim * item;
}
static int64_t thread_bytes(const prompt_shape *s) { return ROWS * padded(s->len) * (4 + 2) + 64; }

int64_t epdmesh_prompt_scratch(const prompt_shape *s, int bf16) {
    return pack_bytes(s, bf16 ? 2 : 4) + omp_get_max_threads() * thread_bytes(s) + 64;
}

#if VEC
/* Keys [kb·16, kb·16 + 16) of one (batch, kv head), packed: bf16 as [dim / 2][16 keys][2], fp32 as [dim][16 keys];
 * keys past `len` are zeros. Values (bf16 only; fp32 reads V where it lies) as [keys / 2][dim][2]. */
static void pack_block(const prompt_shape *s, const void *k, const void *v, void *kp, void *vp, int64_t b, int64_t h,
                       int64_t kb, const int bf16) {
    const int64_t dim = s->head_dim, lp = padded(s->len), item = bf16 ? 2 : 4;
    const int64_t slab = (b * s->num_kv_heads + h) * lp * dim; /* elements before this head's packed keys */
    for (int64_t t = 0; t < 16; ++t) {
        const int64_t j = kb * 16 + t;
        const char *row = (const char *)k + (b * s->k_batch + j * s->k_tok + h * s->k_head) * item;
        if (bf16) {
            uint32_t *dst = (uint32_t *)kp + (slab + kb * 16 * dim) / 2 + t;
            for (int64_t d2 = 0; d2 < dim / 2; ++d2) dst[d2 * 16] = j < s->len ? ((const uint32_t *)row)[d2] : 0;
        } else {
            float *dst = (float *)kp + slab + kb * 16 * dim + t;
            for (int64_t d = 0; d < dim; ++d) dst[d * 16] = j < s->len ? ((const float *)row)[d] : 0.0f;
        }
    }
    if (!bf16) return;
    for (int64_t t = 0; t < 16; t += 2) { /* tokens j, j + 1 interleaved: (v[j][d], v[j + 1][d]) as one 32-bit pair */
        const int64_t j = kb * 16 + t;
        uint32_t *dst = (uint32_t *)vp + slab / 2 + j / 2 * dim;
        const uint16_t *a = (const uint16_t *)v + b * s->v_batch + j * s->v_tok + h * s->v_head;
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512i lo = j < s->len ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d)))
                                          : _mm512_setzero_si512();
            const __m512i hi = j + 1 < s->len
                                   ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + s->v_tok + d)))
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* 16 fp32 values rounded to bf16 as torch rounds them, stored at `dst`. */
static inline void store_bf16_16(uint16_t *dst, __m512 x) {
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_16(x)), 16)));
}

/* Rows [r0, r0 + 16) of query head `h` in batch `b` (rows past n repeat the last one and are not stored). */
static inline __attribute__((always_inline)) void rows_task(const prompt_shape *s, const void *q, const void *kp,
                                                           const void *v, const void *vp, void *out, float *sc,
                                                           uint16_t *pb, int64_t b, int64_t h, int64_t r0,
                                                           const int64_t dim, const int bf16) {
    const int64_t lp = padded(s->len), off = s->len - s->n, hk = h / (s->num_heads / s->num_kv_heads);
    const int64_t item = bf16 ? 2 : 4, slab = (b * s->num_kv_heads + hk) * lp * dim;
    const int64_t rows = s->n - r0 < ROWS ? s->n - r0 : ROWS;
    const int64_t last = s->causal ? off + r0 + rows : s->len; /* keys [0, last) serve some row of the task */
    const int64_t blocks = (last + 15) / 16;
    const char *qr[ROWS];
    for (int64_t r = 0; r < ROWS; ++r)
        qr[r] = (const char *)q + (b * s->q_batch + (r0 + (r < rows ? r : rows - 1)) * s->q_tok + h * s->q_head) * item;
    const __m512 scale = _mm512_set1_ps(s->scale);
    for (int64_t kb = 0; kb < blocks; ++kb) { /* scores: 16 rows × 16 keys in registers */
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
        if (bf16) {
#if BF16
            const __m512i *kt = (const __m512i *)((const uint16_t *)kp + slab + kb * 16 * dim);
            for (int64_t d2 = 0; d2 < dim / 2; ++d2) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + d2);
                for (int r = 0; r < ROWS; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(((const int32_t *)qr[r])[d2]), kv);
            }
#endif
        } else {
            const float *kt = (const float *)kp + slab + kb * 16 * dim;
            for (int64_t d = 0; d < dim; ++d) {
                const __m512 kv = _mm512_loadu_ps(kt + d * 16);
                for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(((const float *)qr[r])[d]), kv, acc[r]);
            }
        }
        for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(sc + r * lp + kb * 16, _mm512_mul_ps(acc[r], scale));
    }
    float sums[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) { /* softmax numerators over the row's keys, zeros up to blocks · 16 */
        float *p = sc + r * lp;
        const int64_t valid = s->causal ? (off + r0 + (r < rows ? r : rows - 1) + 1) : s->len;
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < valid; t += 16) {
            const __mmask16 m = valid - t >= 16 ? 0xffff : (__mmask16)((1u << (valid - t)) - 1);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p + t));
        }
        const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int64_t t = 0; t < blocks * 16; t += 16) {
            const __mmask16 m = t >= valid ? 0 : valid - t >= 16 ? 0xffff : (__mmask16)((1u << (valid - t)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + t), most)));
            sum = _mm512_add_ps(sum, e);
            if (bf16)
                store_bf16_16(pb + r * lp + t, e);
            else
                _mm512_storeu_ps(p + t, e);
        }
        sums[r] = _mm512_reduce_add_ps(sum);
    }
    for (int64_t d = 0; d < dim; d += 16) { /* the 16 rows' sums for dims [d, d + 16), over every key */
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
        if (bf16) {
#if BF16
            const uint32_t *vt = (const uint32_t *)vp + slab / 2;
            for (int64_t j2 = 0; j2 < blocks * 8; ++j2) {
                const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + j2 * dim + d);
                for (int r = 0; r < ROWS; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(((const int32_t *)(pb + r * lp))[j2]), vv);
            }
#endif
        } else {
            const float *vr = (const float *)v + b * s->v_batch + hk * s->v_head + d;
            const int64_t keys = last < s->len ? last : s->len;
            for (int64_t j = 0; j < keys; ++j) {
                const __m512 vv = _mm512_loadu_ps(vr + j * s->v_tok);
                for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * lp + j]), vv, acc[r]);
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 o = _mm512_div_ps(acc[r], _mm512_set1_ps(sums[r]));
            const int64_t at = b * s->o_batch + (r0 + r) * s->o_tok + h * s->o_head + d;
            if (bf16)
                store_bf16_16((uint16_t *)out + at, o);
            else
                _mm512_storeu_ps((float *)out + at, o);
        }
    }
}

static int prompt(const prompt_shape *s, const void *q, const void *k, const void *v, void *out, char *scratch,
                  const int bf16) {
    if (!epdmesh_prompt_supports(bf16, s->head_dim)) return -1;
    const int64_t lp = padded(s->len), item = bf16 ? 2 : 4, kvh = s->batch * s->num_kv_heads;
    char *base = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    void *kp = base, *vp = base + pack_bytes(s, item) / 2;
    char *rows = base + pack_bytes(s, item);
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < kvh * (lp / 16); ++w)
        pack_block(s, k, v, kp, vp, w / (lp / 16) / s->num_kv_heads, w / (lp / 16) % s->num_kv_heads, w % (lp / 16),
                   bf16);
    const int64_t tasks = (s->n + ROWS - 1) / ROWS, heads = s->batch * s->num_heads;
#pragma omp parallel
    {
        float *sc = (float *)(rows + omp_get_thread_num() * thread_bytes(s));
        uint16_t *pb = (uint16_t *)(sc + ROWS * lp);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < tasks * heads; ++w) {
            const int64_t r0 = (tasks - 1 - w / heads) * ROWS, b = w % heads / s->num_heads, h = w % s->num_heads;
            if (s->head_dim == 64 && bf16)
                rows_task(s, q, kp, v, vp, out, sc, pb, b, h, r0, 64, 1);
            else if (s->head_dim == 64)
                rows_task(s, q, kp, v, vp, out, sc, pb, b, h, r0, 64, 0);
            else if (s->head_dim == 128 && bf16)
                rows_task(s, q, kp, v, vp, out, sc, pb, b, h, r0, 128, 1);
            else if (bf16)
                rows_task(s, q, kp, v, vp, out, sc, pb, b, h, r0, s->head_dim, 1);
            else
                rows_task(s, q, kp, v, vp, out, sc, pb, b, h, r0, s->head_dim, 0);
        }
    }
    return 0;
}
#endif

int epdmesh_prompt_bf16(const prompt_shape *s, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                        uint16_t *out, char *scratch) {
#if BF16
    return prompt(s, q, k, v, out, scratch, 1);
#else
    (void)s, (void)q, (void)k, (void)v, (void)out, (void)scratch;
    return -1;
#endif
}

int epdmesh_prompt_f32(const prompt_shape *s, const float *q, const float *k, const float *v, float *out,
                       char *scratch) {
#if VEC
    return prompt(s, q, k, v, out, scratch, 0);
#else
    (void)s, (void)q, (void)k, (void)v, (void)out, (void)scratch;
    return -1;
#endif
}
