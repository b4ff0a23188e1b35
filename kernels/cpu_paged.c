/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the cache's blocks.
 *
 * The arithmetic is the torch reference's (kernels/torch_ref.py `_decode`, itself transformers' eager attention):
 * scores q·k accumulated in fp32 and rounded to the cache's dtype, then scaled in fp32; the softmax in fp32; the
 * probabilities rounded to the cache's dtype; their product with V accumulated in fp32 and rounded once. Only the
 * order of the fp32 sums differs. Where the reference gathers every sequence's blocks into contiguous copies and
 * runs two batched matmuls, this reads each K and V row once, where it lies.
 *
 * Where the compiler targets AVX-512 (and EPDMESH_SCALAR is not defined) the passes and the softmax run on 16 lanes
 * (`VEC`): bf16 widened exactly, the dot products as fused multiply-adds, exp as Cephes' expf (about 1 ulp, as
 * glibc's and torch's Sleef exp), the division and the rounding to bf16 as the scalar code does them; the passes
 * take 16 tokens at a time (`groups_pass`: 16 keys' dot products reduced together, the values' sums in registers).
 * Elsewhere, or for a head_dim that is not a multiple of 16, the row-at-a-time loops (`rows_pass`).
 *
 * Built by kernels/cpu_paged.py with the host's compiler (-O3 -march=native -fopenmp) into the user's cache; the
 * OpenMP runtime is the one torch has loaded, so its parallel regions share torch's threads.
 */
#include <omp.h>

#include "cpu_vec.h"

#define MAX_HEAD_DIM 256

#if VEC
/* p[0, len) → softmax(p), in fp32, rounded to bf16 if `bf16`. */
static inline void softmax16(float *p, int64_t len, const int bf16) {
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p + t));
    }
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + t), most));
        _mm512_mask_storeu_ps(p + t, m, e);
        sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = len - t >= 16 ? 0xffff : (__mmask16)((1u << (len - t)) - 1);
        __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(m, p + t), total);
        _mm512_mask_storeu_ps(p + t, m, bf16 ? round_bf16_16(x) : x);
    }
}
#endif

typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_width, max_len;
    int64_t q_seq, q_head, o_seq, o_head;                    /* strides of q and out, in elements */
    int64_t k_block, k_token, k_head, v_block, v_token, v_head; /* strides of the caches, in elements */
    float scale;
} decode_shape;

/* `dim` values of `src` from element `at` as fp32. */
static inline void load_f32(const void *src, int64_t at, int64_t dim, float *dst, const int bf16) {
    for (int64_t d = 0; d < dim; ++d)
        dst[d] = bf16 ? bf16_to_f32(((const uint16_t *)src)[at + d]) : ((const float *)src)[at + d];
}

/* Where token `t`'s row starts in a cache with these block and token strides. */
static inline int64_t row_start(const decode_shape *s, const int32_t *table, int64_t t, int64_t block, int64_t token) {
    return table[t / s->block_size] * block + (t % s->block_size) * token;
}

/* Ask for the cache lines of token `t`'s row part (heads [h0, h1)) ahead of use: the rows of a block are
 * contiguous, but blocks lie anywhere, and a cold cache otherwise serves one row at a time. */
static inline void prefetch_row(const decode_shape *s, const int32_t *table, int64_t t, int64_t len, int64_t block,
                                int64_t token, int64_t head, int64_t h0, int64_t h1, const void *cache, int64_t item) {
    if (t >= len) return;
    const char *p = (const char *)cache + (row_start(s, table, t, block, token) + h0 * head) * item;
    for (int64_t b = 0; b < (h1 - h0) * head * item; b += 64) __builtin_prefetch(p + b);
}

/* Token `t`'s row of kv head `h` (at element `at` of `cache`) against query heads [r0, r1): keys (`values` 0) give
 * each query head's score, rounded as the reference rounds it; values (1) are added into each query head's sums,
 * weighted by its probability (`scores` by then). `row`: room for one head's row in fp32. */
static inline __attribute__((always_inline)) void row_heads(const decode_shape *s, const void *cache, int64_t at,
                                                           int64_t t, int64_t r0, int64_t r1, const float *qf,
                                                           float *scores, float *acc, float *row, const int bf16,
                                                           const int values) {
    const int64_t dim = s->head_dim;
#if VEC
    if (dim % 16 == 0) {
        for (int64_t r = r0; r < r1; ++r) {
            if (values) {
                const __m512 w = _mm512_set1_ps(scores[r * s->max_len + t]);
                float *ar = acc + r * dim;
                for (int64_t d = 0; d < dim; d += 16)
                    _mm512_storeu_ps(ar + d, _mm512_fmadd_ps(w, load16(cache, at + d, bf16), _mm512_loadu_ps(ar + d)));
            } else {
                const float *qr = qf + r * dim;
                __m512 sum = _mm512_setzero_ps();
                for (int64_t d = 0; d < dim; d += 16)
                    sum = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), load16(cache, at + d, bf16), sum);
                const float dot = _mm512_reduce_add_ps(sum);
                scores[r * s->max_len + t] = (bf16 ? round_bf16(dot) : dot) * s->scale;
            }
        }
        return;
    }
#endif
    load_f32(cache, at, dim, row, bf16);
    for (int64_t r = r0; r < r1; ++r) {
        if (values) {
            const float w = scores[r * s->max_len + t];
            float *ar = acc + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ar[d] += w * row[d];
        } else {
            const float *qr = qf + r * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qr[d] * row[d];
            scores[r * s->max_len + t] = (bf16 ? round_bf16(dot) : dot) * s->scale;
        }
    }
}

/* One pass over a sequence's cached rows of heads [h0, h1), each read once in the order it lies, the rows ahead
 * prefetched: `row_heads` for every row and head. */
static inline __attribute__((always_inline)) void rows_pass(const decode_shape *s, const int32_t *table, int64_t len,
                                                           int64_t h0, int64_t h1, const void *cache, int64_t block,
                                                           int64_t token, int64_t head, const float *qf,
                                                           float *scores, float *acc, const int bf16,
                                                           const int values) {
    const int64_t group = s->num_heads / s->num_kv_heads, item = bf16 ? 2 : 4, ahead = 8;
    float row[MAX_HEAD_DIM];
    for (int64_t t = 0; t < ahead; ++t) prefetch_row(s, table, t, len, block, token, head, h0, h1, cache, item);
    for (int64_t t = 0; t < len; ++t) {
        prefetch_row(s, table, t + ahead, len, block, token, head, h0, h1, cache, item);
        const int64_t base = row_start(s, table, t, block, token);
        for (int64_t h = h0; h < h1; ++h)
            row_heads(s, cache, base + h * head, t, h * group, (h + 1) * group, qf, scores, acc, row, bf16, values);
    }
}

#if VEC
/* Lane t of the result: the sum of the 16 lanes of a[t] (a 16 × 16 transpose folded into its sums). */
static inline __m512 sums16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = a[2i], b = a[2i + 1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) /* per 128-bit lane: the lane's sums of tokens 4i … 4i + 3 */
        c[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
}

/* Keys: tokens [t0, t0 + n) (n ≤ 16, rows at `rows`) of kv head h against its query heads [r0, r1): 16 dot
 * products at once per query head, each score rounded and scaled as `row_heads` does. */
static inline __attribute__((always_inline)) void keys16(const decode_shape *s, const void *kc, const int64_t *rows,
                                                        int64_t n, int64_t h, int64_t r0, int64_t r1, int64_t dim,
                                                        const float *qf, float *scores, int64_t t0, const int bf16) {
    const __mmask16 m = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
    for (int64_t r = r0; r < r1; ++r) {
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const __m512 qd = _mm512_loadu_ps(qf + r * dim + d);
            for (int64_t t = 0; t < n; ++t)
                acc[t] = _mm512_fmadd_ps(qd, load16(kc, rows[t] + h * s->k_head + d, bf16), acc[t]);
        }
        __m512 dots = sums16(acc);
        if (bf16) dots = round_bf16_16(dots);
        _mm512_mask_storeu_ps(scores + r * s->max_len + t0, m, _mm512_mul_ps(dots, _mm512_set1_ps(s->scale)));
    }
}

/* Values: tokens [t0, t0 + n) of kv head h, weighted by each of its query heads' probabilities, into their sums. */
static inline __attribute__((always_inline)) void values16(const decode_shape *s, const void *vc, const int64_t *rows,
                                                          int64_t n, int64_t h, int64_t r0, int64_t r1, int64_t dim,
                                                          const float *scores, float *acc, int64_t t0,
                                                          const int bf16) {
    for (int64_t r = r0; r < r1; ++r) {
        __m512 sum[MAX_HEAD_DIM / 16];
        float *ar = acc + r * dim;
        for (int64_t d = 0; d < dim; d += 16) sum[d / 16] = _mm512_loadu_ps(ar + d);
        for (int64_t t = 0; t < n; ++t) {
            const __m512 w = _mm512_set1_ps(scores[r * s->max_len + t0 + t]);
            for (int64_t d = 0; d < dim; d += 16)
                sum[d / 16] = _mm512_fmadd_ps(w, load16(vc, rows[t] + h * s->v_head + d, bf16), sum[d / 16]);
        }
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(ar + d, sum[d / 16]);
    }
}

/* Both passes over a sequence's rows in groups of 16 tokens (`rows_pass` a row at a time): the keys' dot products
 * reduced 16 at once, the values' sums held in registers across a group, the next group's rows prefetched. */
static inline __attribute__((always_inline)) void groups_pass(const decode_shape *s, const int32_t *table,
                                                             int64_t len, int64_t h0, int64_t h1, const void *cache,
                                                             int64_t block, int64_t token, int64_t head,
                                                             int64_t dim, const float *qf, float *scores, float *acc,
                                                             const int bf16, const int values) {
    const int64_t group = s->num_heads / s->num_kv_heads, item = bf16 ? 2 : 4;
    int64_t rows[16];
    for (int64_t t = 0; t < 16; ++t) prefetch_row(s, table, t, len, block, token, head, h0, h1, cache, item);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        for (int64_t t = 0; t < 16; ++t) prefetch_row(s, table, t0 + 16 + t, len, block, token, head, h0, h1, cache,
                                                      item);
        for (int64_t t = 0; t < n; ++t) rows[t] = row_start(s, table, t0 + t, block, token);
        for (int64_t h = h0; h < h1; ++h) {
            if (values && n == 16)
                values16(s, cache, rows, 16, h, h * group, (h + 1) * group, dim, scores, acc, t0, bf16);
            else if (values)
                values16(s, cache, rows, n, h, h * group, (h + 1) * group, dim, scores, acc, t0, bf16);
            else if (n == 16)
                keys16(s, cache, rows, 16, h, h * group, (h + 1) * group, dim, qf, scores, t0, bf16);
            else
                keys16(s, cache, rows, n, h, h * group, (h + 1) * group, dim, qf, scores, t0, bf16);
        }
    }
}
#endif

/* p[0, len) → softmax(p) in fp32 (max, exp, sum, divide), each rounded to bf16 if `bf16`. */
static inline void softmax(float *p, int64_t len, const int bf16) {
#if VEC
    softmax16(p, len, bf16);
#else
    float top = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) top = p[t] > top ? p[t] : top;
    for (int64_t t = 0; t < len; ++t) sum += (p[t] = expf(p[t] - top));
    for (int64_t t = 0; t < len; ++t) p[t] = bf16 ? round_bf16(p[t] / sum) : p[t] / sum;
#endif
}

#if VEC
/* `groups_pass` with head_dim a constant where it is a common one, so that its loops over it unroll into registers. */
#define PASS(fn, cache, block, token, head, values)                                                                  \
    do {                                                                                                              \
        if (dim == 64)                                                                                                \
            fn(s, table, len, h0, h1, cache, block, token, head, 64, qf, scores, acc, bf16, values);                 \
        else if (dim == 128)                                                                                          \
            fn(s, table, len, h0, h1, cache, block, token, head, 128, qf, scores, acc, bf16, values);                \
        else                                                                                                          \
            fn(s, table, len, h0, h1, cache, block, token, head, dim, qf, scores, acc, bf16, values);                \
    } while (0)
#else
#define PASS(fn, cache, block, token, head, values) (void)0
#endif

/* One sequence's kv heads [h0, h1), every query head of their groups, token by token: each cached row's part for
 * these heads (heads then head_dim, contiguous) is read once, in the order it lies. `work`: the sequence's scratch,
 * scores [heads][max_len], then q and the output's sums, [heads][head_dim] each, in fp32. */
static inline __attribute__((always_inline)) void decode_heads(const decode_shape *s, int64_t seq, int64_t h0,
                                                              int64_t h1, const void *q, const void *kc,
                                                              const void *vc, const int32_t *tables,
                                                              const int32_t *seq_lens, void *out, float *work,
                                                              const int bf16) {
    const int64_t group = s->num_heads / s->num_kv_heads, dim = s->head_dim, len = seq_lens[seq];
    const int64_t r0 = h0 * group, r1 = h1 * group; /* query heads */
    const int32_t *table = tables + seq * s->table_width;
    float *scores = work, *qf = work + s->num_heads * s->max_len, *acc = qf + s->num_heads * dim;
    for (int64_t r = r0; r < r1; ++r) load_f32(q, seq * s->q_seq + r * s->q_head, dim, qf + r * dim, bf16);
#if VEC
    const int lanes = dim % 16 == 0;
#else
    const int lanes = 0;
#endif
    if (lanes)
        PASS(groups_pass, kc, s->k_block, s->k_token, s->k_head, 0);
    else
        rows_pass(s, table, len, h0, h1, kc, s->k_block, s->k_token, s->k_head, qf, scores, acc, bf16, 0);
    for (int64_t r = r0; r < r1; ++r) {
        softmax(scores + r * s->max_len, len, bf16);
        memset(acc + r * dim, 0, sizeof(float) * dim);
    }
    if (lanes)
        PASS(groups_pass, vc, s->v_block, s->v_token, s->v_head, 1);
    else
        rows_pass(s, table, len, h0, h1, vc, s->v_block, s->v_token, s->v_head, qf, scores, acc, bf16, 1);
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t at = seq * s->o_seq + r * s->o_head;
        for (int64_t d = 0; d < dim; ++d) {
            if (bf16)
                ((uint16_t *)out)[at + d] = f32_to_bf16(acc[r * dim + d]);
            else
                ((float *)out)[at + d] = acc[r * dim + d];
        }
    }
}

/* The step's new K/V rows ([sequences, kv_heads, head_dim], head_dim contiguous) into their slots, as the index_put
 * they replace: -2 if a slot lies outside the cache (nothing written then). */
typedef struct {
    int64_t k_seq, k_head, v_seq, v_head; /* strides of the new rows, in elements */
    int64_t num_blocks;
} new_rows;

static int write_rows(const decode_shape *s, const new_rows *w, const void *k, const void *v, const int64_t *blocks,
                      const int64_t *offsets, void *kc, void *vc, const int64_t item) {
    for (int64_t i = 0; i < s->num_seqs; ++i)
        if (blocks[i] < 0 || blocks[i] >= w->num_blocks || offsets[i] < 0 || offsets[i] >= s->block_size) return -2;
    const int64_t bytes = s->head_dim * item;
    /* a prompt's rows (hundreds) on every thread; a decode step's few on the calling one */
#pragma omp parallel for schedule(static) if (s->num_seqs * s->num_kv_heads * bytes >= (1 << 16))
    for (int64_t i = 0; i < s->num_seqs; ++i)
        for (int64_t h = 0; h < s->num_kv_heads; ++h) {
            memcpy((char *)kc + (blocks[i] * s->k_block + offsets[i] * s->k_token + h * s->k_head) * item,
                   (const char *)k + (i * w->k_seq + h * w->k_head) * item, bytes);
            memcpy((char *)vc + (blocks[i] * s->v_block + offsets[i] * s->v_token + h * s->v_head) * item,
                   (const char *)v + (i * w->v_seq + h * w->v_head) * item, bytes);
        }
    return 0;
}

/* A prompt's K/V rows (`num_seqs` of them) into their slots alone: what the engine's prefills write before their
 * attention. `item`: bytes of an element (2 or 4). */
int epdmesh_write_rows(const decode_shape *s, const new_rows *w, const void *k, const void *v, const int64_t *blocks,
                       const int64_t *offsets, void *kc, void *vc, const int64_t item) {
    return write_rows(s, w, k, v, blocks, offsets, kc, vc, item);
}

/* Sequences x head ranges, as many ranges per sequence as keep every thread busy. */
static int paged_decode(const decode_shape *s, const void *q, const void *kc, const void *vc, const int32_t *tables,
                        const int32_t *seq_lens, void *out, float *scratch, const int bf16) {
    if (s->head_dim > MAX_HEAD_DIM) return -1;
    const int64_t threads = omp_get_max_threads(), kv = s->num_kv_heads;
    int64_t splits = (2 * threads + s->num_seqs - 1) / s->num_seqs;
    splits = splits < 1 ? 1 : splits > kv ? kv : splits;
#pragma omp parallel for schedule(static)
    for (int64_t w = 0; w < s->num_seqs * splits; ++w) {
        const int64_t seq = w / splits, part = w % splits;
        float *work = scratch + seq * s->num_heads * (s->max_len + 2 * s->head_dim);
        if (bf16)
            decode_heads(s, seq, part * kv / splits, (part + 1) * kv / splits, q, kc, vc, tables, seq_lens, out,
                         work, 1);
        else
            decode_heads(s, seq, part * kv / splits, (part + 1) * kv / splits, q, kc, vc, tables, seq_lens, out,
                         work, 0);
    }
    return 0;
}

int epdmesh_paged_decode_bf16(const decode_shape *s, const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                              const int32_t *tables, const int32_t *seq_lens, uint16_t *out, float *scratch) {
    return paged_decode(s, q, kc, vc, tables, seq_lens, out, scratch, 1);
}

int epdmesh_paged_decode_f32(const decode_shape *s, const float *q, const float *kc, const float *vc,
                             const int32_t *tables, const int32_t *seq_lens, float *out, float *scratch) {
    return paged_decode(s, q, kc, vc, tables, seq_lens, out, scratch, 0);
}

/* The new rows written (`write_rows`), then the decode over them: one call for a layer of a decode step. */
int epdmesh_write_decode_bf16(const decode_shape *s, const new_rows *w, const uint16_t *k, const uint16_t *v,
                              const int64_t *blocks, const int64_t *offsets, const uint16_t *q, uint16_t *kc,
                              uint16_t *vc, const int32_t *tables, const int32_t *seq_lens, uint16_t *out,
                              float *scratch) {
    if (s->head_dim > MAX_HEAD_DIM) return -1;
    const int rc = write_rows(s, w, k, v, blocks, offsets, kc, vc, 2);
    return rc ? rc : paged_decode(s, q, kc, vc, tables, seq_lens, out, scratch, 1);
}

int epdmesh_write_decode_f32(const decode_shape *s, const new_rows *w, const float *k, const float *v,
                             const int64_t *blocks, const int64_t *offsets, const float *q, float *kc, float *vc,
                             const int32_t *tables, const int32_t *seq_lens, float *out, float *scratch) {
    if (s->head_dim > MAX_HEAD_DIM) return -1;
    const int rc = write_rows(s, w, k, v, blocks, offsets, kc, vc, 4);
    return rc ? rc : paged_decode(s, q, kc, vc, tables, seq_lens, out, scratch, 0);
}

/* A prompt's rotary and K/V write in one pass (bf16, AVX-512, head_dim a multiple of 32): the rows of its qkv
 * projection ([tokens][(num_heads + 2·num_kv_heads)·head_dim], row stride `qkv_stride`) → q with RoPE applied
 * ([tokens][num_heads][head_dim], contiguous), K with RoPE applied and V into their slots of a layer's caches. RoPE
 * as common/model/layers.py `apply_rotary` (transformers' x·cos + rotate_half(x)·sin): per half, x1·c − x2·s and
 * x2·c + x1·s in fp32 (products and the difference or sum each rounded to fp32, no fused multiply-add), rounded
 * once to bf16 — what inductor's fused kernel computes. cos and sin: [tokens][head_dim] bf16 (row stride
 * `cs_stride`). -1: a shape it does not take; -2: a slot outside the cache (nothing written then). */
int epdmesh_rotary_kv_bf16(const decode_shape *s, const new_rows *w, const uint16_t *qkv, int64_t qkv_stride,
                           const uint16_t *cos, const uint16_t *sin, int64_t cs_stride, const int64_t *blocks,
                           const int64_t *offsets, uint16_t *q, uint16_t *kc, uint16_t *vc) {
#if VEC
    const int64_t n = s->num_seqs, heads = s->num_heads, kv = s->num_kv_heads, dim = s->head_dim, half = dim / 2;
    if (dim % 32) return -1;
    for (int64_t i = 0; i < n; ++i)
        if (blocks[i] < 0 || blocks[i] >= w->num_blocks || offsets[i] < 0 || offsets[i] >= s->block_size) return -2;
#pragma omp parallel for schedule(static) if (n * (heads + 2 * kv) * dim >= (1 << 15))
    for (int64_t t = 0; t < n; ++t) {
        const uint16_t *row = qkv + t * qkv_stride, *c = cos + t * cs_stride, *sn = sin + t * cs_stride;
        for (int64_t h = 0; h < heads + kv; ++h) {
            const uint16_t *x = row + h * dim;
            uint16_t *o = h < heads ? q + (t * heads + h) * dim
                                    : kc + blocks[t] * s->k_block + offsets[t] * s->k_token + (h - heads) * s->k_head;
            for (int64_t j = 0; j < half; j += 16) {
                const __m512 x1 = load16(x, j, 1), x2 = load16(x, half + j, 1);
                const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(x1, load16(c, j, 1)), _mm512_mul_ps(x2, load16(sn, j, 1)));
                const __m512 hi =
                    _mm512_add_ps(_mm512_mul_ps(x2, load16(c, half + j, 1)), _mm512_mul_ps(x1, load16(sn, half + j, 1)));
                store_bf16_16(o + j, lo);
                store_bf16_16(o + half + j, hi);
            }
        }
        for (int64_t h = 0; h < kv; ++h)
            memcpy(vc + blocks[t] * s->v_block + offsets[t] * s->v_token + h * s->v_head, row + (heads + kv + h) * dim,
                   dim * 2);
    }
    return 0;
#else
    (void)s, (void)w, (void)qkv, (void)qkv_stride, (void)cos, (void)sin, (void)cs_stride, (void)blocks, (void)offsets;
    (void)q, (void)kc, (void)vc;
    return -1;
#endif
}
