/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the cache's blocks.
 *
 * The arithmetic is the torch reference's (kernels/torch_ref.py `_decode`, itself transformers' eager attention):
 * scores q·k accumulated in fp32 and rounded to the cache's dtype, then scaled in fp32; the softmax in fp32; the
 * probabilities rounded to the cache's dtype; their product with V accumulated in fp32 and rounded once. Only the
 * order of the fp32 sums differs. Where the reference gathers every sequence's blocks into contiguous copies and
 * runs two batched matmuls, this reads each K and V row once, where it lies.
 *
 * Built by kernels/cpu_paged.py with the host's compiler (-O3 -march=native -fopenmp) into the user's cache; the
 * OpenMP runtime is the one torch has loaded, so its parallel regions share torch's threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256

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

/* One pass over a sequence's cached rows of heads [h0, h1), each read once in the order it lies, the rows ahead
 * prefetched. Keys (`values` 0): each query head's score against the row, rounded as the reference rounds it. Values
 * (1): the row added into each query head's sums, weighted by its probability (`scores` by then). */
static inline __attribute__((always_inline)) void rows_pass(const decode_shape *s, const int32_t *table, int64_t len,
                                                           int64_t h0, int64_t h1, const void *cache, int64_t block,
                                                           int64_t token, int64_t head, const float *qf,
                                                           float *scores, float *acc, const int bf16,
                                                           const int values) {
    const int64_t group = s->num_heads / s->num_kv_heads, dim = s->head_dim, item = bf16 ? 2 : 4, ahead = 8;
    float row[MAX_HEAD_DIM];
    for (int64_t t = 0; t < ahead; ++t) prefetch_row(s, table, t, len, block, token, head, h0, h1, cache, item);
    for (int64_t t = 0; t < len; ++t) {
        prefetch_row(s, table, t + ahead, len, block, token, head, h0, h1, cache, item);
        const int64_t base = row_start(s, table, t, block, token);
        for (int64_t h = h0; h < h1; ++h) {
            load_f32(cache, base + h * head, dim, row, bf16);
            for (int64_t r = h * group; r < (h + 1) * group; ++r) {
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
    }
}

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
    rows_pass(s, table, len, h0, h1, kc, s->k_block, s->k_token, s->k_head, qf, scores, acc, bf16, 0);
    for (int64_t r = r0; r < r1; ++r) {
        float *p = scores + r * s->max_len, top = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) top = p[t] > top ? p[t] : top;
        for (int64_t t = 0; t < len; ++t) sum += (p[t] = expf(p[t] - top));
        for (int64_t t = 0; t < len; ++t) p[t] = bf16 ? round_bf16(p[t] / sum) : p[t] / sum;
        memset(acc + r * dim, 0, sizeof(float) * dim);
    }
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
