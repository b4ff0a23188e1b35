/* Prompt attention on the CPU: every query row of a prompt (or its last n rows) against the prompt's K/V, causal
 * (aligned bottom-right) or not (the vision tower), with GQA.
 *
 * The arithmetic is that of torch's fused CPU kernel (SDPA's flash attention) with one block of keys: the scores q·k
 * accumulated in fp32 and scaled in fp32; the softmax's exponentials in fp32, their sum in fp32; for bf16, the
 * exponentials rounded to bf16 before their product with V, accumulated in fp32, multiplied by the reciprocal of
 * the sum and rounded once. Only the order of the fp32 sums differs, and the rounding to bf16 is the hardware's
 * conversion (to nearest even as torch rounds, but subnormals flushed to zero). The scale must be positive: a row's
 * largest score is taken before it is scaled. SDPA runs ~50–110 GFLOP/s on these shapes (head_dim 64, 128–1024
 * tokens) where the cores do ~500 a core: it works a row block at a time through generic GEMM calls.
 *
 * A call takes a step's prompts at once, each sequence's queries rows of q one after another and its keys read where
 * they lie — a paged cache's blocks (a block table per sequence), or one tensor (one block a sequence). A task is 16
 * query rows of one head. Keys are packed first, once per sequence and kv head, in the order the dot-product
 * instruction reads them: 16 keys × pairs of dims (bf16, VDPBF16PS: 16 scores a row from one key load and one
 * broadcast of the row's pair of q values) or 16 keys × 1 dim (fp32, FMA); values in pairs of tokens (bf16) or as
 * rows (fp32). The 16
 * rows' scores stay in registers over a block of 16 keys; their products with V in registers over all keys.
 *
 * On a CPU with AMX (bf16, head_dim a multiple of 32) the two products run on the tile unit instead
 * (`rows_task_amx`): the same packed keys and values are its tiles' second operands — 16 keys × 32 dims a tile for
 * the scores, 32 keys × 16 dims for the values — the 16 rows' scores go through memory for the softmax, and the same
 * arithmetic holds (fp32 scores and sums, bf16 probabilities). For head_dim ≤ 64 the query's tiles stay loaded
 * (read in place where the task has all 16 rows) and four blocks of 16 keys run at once: four independent sums, so
 * that the unit is not waiting on one. The 16 rows' maxima and sums are reduced together (`max16_rows`,
 * `add16_rows`: 15 shuffle steps, not 16 separate reductions' ~64 in chains the core cannot overlap). Tasks go to
 * the threads round-robin, largest first (`schedule(static, 1)`: OpenMP's dynamic dispatch costs more than a small
 * task's imbalance, bench/README.md). On a Xeon VDPBF16PS runs at a fifth of a Zen 5's
 * rate (independent ones: 104 against 525 GFLOP/s a core), and the vector loops at 92–159 GFLOP/s on two cores,
 * below SDPA (whose products are oneDNN's, on the tiles).
 *
 * AVX-512 only (bf16 also needs AVX512_BF16): `epdmesh_prompt_supports` says whether this build computes a dtype
 * and head_dim; elsewhere the caller keeps SDPA.
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_vec.h"

#define ROWS 16
#define MAX_DIM 256

/* Sequence i's query rows are [starts[i], starts[i + 1]) of q and out, counted from starts[0] (a step's offsets
 * into all its tokens serve as they are); its keys, lens[i] of them, the last of which belong to those rows
 * (causal: row r of n sees keys up to lens[i] − n + r), lie at row j:
 * tables[i · table_width + j / block_size] · block + (j % block_size) · token (+ head · kv head). */
typedef struct {
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, causal, block_size, table_width;
    int64_t threads; /* set by epdmesh_prompt_scratch: the threads its size allows, which the call then uses */
    int64_t q_tok, q_head, o_tok, o_head;                       /* strides of q and out, in elements */
    int64_t k_block, k_token, k_head, v_block, v_token, v_head; /* strides of K and V, in elements */
    float scale;
} prompt_shape;

#if VEC && defined(__AVX512BF16__)
#define BF16 1
#else
#define BF16 0
#endif

#if BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX 1
#include "cpu_tiles.h"
#else
#define AMX 0
#endif

/* Whether bf16 prompts of head_dim % 32 == 0 run on the tiles: asked for (`want`), compiled for, and granted by Linux
 * (cpu_tiles.h). */
static int tiles = 0;

int epdmesh_prompt_tiles(int want) {
#if AMX
    tiles = want && tiles_request() == 0;
#else
    (void)want;
#endif
    return tiles;
}

int epdmesh_prompt_supports(int bf16, int64_t head_dim) {
    return (bf16 ? BF16 : VEC) && head_dim % 16 == 0 && head_dim <= MAX_DIM;
}

/* Keys padded to a multiple of 32, zeros past the sequence's: the tiles take the values 32 keys at a time. */
static inline int64_t padded(int64_t len) { return (len + 31) / 32 * 32; }

/* The 32 bits at `p` (a pair of bf16), wherever `p` lies. */
static inline uint32_t bits32(const void *p) {
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return u;
}

/* Elements of one sequence's packed keys (or values): every kv head's, keys padded to a multiple of 16. */
static int64_t pack_elements(const prompt_shape *s, int64_t len) { return s->num_kv_heads * padded(len) * s->head_dim; }

/* A thread's rows: their scores (fp32), probabilities (bf16) and query rows, copied together — in the prompt they lie
 * heads × head_dim apart (8 KiB for 32 × 128 in bf16: 16 rows in one set of the L1 cache), and one base address
 * serves all 16 in the inner loops. */
static int64_t thread_bytes(int64_t longest) { return ROWS * padded(longest) * (4 + 2) + ROWS * MAX_DIM * 4 + 64; }

/* Bytes of scratch a call needs: the packed K and V of every sequence, then each thread's rows. */
int64_t epdmesh_prompt_scratch(prompt_shape *s, const int32_t *lens, int bf16) {
    int64_t pack = 0, longest = 0;
    for (int64_t i = 0; i < s->num_seqs; ++i) {
        pack += 2 * pack_elements(s, lens[i]) * (bf16 ? 2 : 4);
        longest = lens[i] > longest ? lens[i] : longest;
    }
    s->threads = omp_get_max_threads();
    return pack + s->threads * thread_bytes(longest) + 64;
}

#if VEC
/* 16 fp32 rounded to bf16 by the hardware's conversion (to nearest even; subnormals flushed to zero) and stored. */
static inline void round16(uint16_t *dst, __m512 f) {
#if BF16
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(f));
#else
    store_bf16_16(dst, f); /* (not reached: bf16 runs where BF16) */
#endif
}

typedef struct {
    const prompt_shape *s;
    const int32_t *starts, *lens, *tables;
    const int64_t *packs; /* where each sequence's packed keys start (its values: as far into the values' half) */
    void *kp, *vp;
} prompt_call;

/* Where key j of sequence i lies (kv head 0), in elements of K (`value` 0) or V (1). */
static inline int64_t key_row(const prompt_call *c, int64_t i, int64_t j, const int value) {
    const prompt_shape *s = c->s;
    const int64_t block = c->tables[i * s->table_width + j / s->block_size], at = j % s->block_size;
    return value ? block * s->v_block + at * s->v_token : block * s->k_block + at * s->k_token;
}

/* Keys [kb·16, kb·16 + 16) of sequence i, kv head h, packed: bf16 as [dim / 2][16 keys][2], fp32 as [dim][16 keys];
 * their values as [keys / 2][dim][2] (bf16) or [keys][dim] (fp32); keys past the sequence's are zeros. */
/* r[i][j] → r[j][i] for 16 rows of 16 32-bit lanes: pairs of rows interleaved by 32 then 64 bits (a 4 × 4
 * transpose within each 128-bit lane), then the lanes of every fourth row transposed 4 × 4. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c], lane L: rows i..i+3 at column 4L + c */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

static void pack_block(const prompt_call *c, const void *k, const void *v, int64_t i, int64_t h, int64_t kb,
                       const int bf16) {
    const prompt_shape *s = c->s;
    const int64_t dim = s->head_dim, len = c->lens[i], item = bf16 ? 2 : 4;
    const int64_t slab = c->packs[i] + h * padded(len) * dim; /* elements before this head's packed keys */
    int64_t at[16][2]; /* where each of the 16 keys and values lies (a block of a multiple of 16 holds all 16) */
    for (int64_t t = 0; t < 16; ++t)
        for (int value = 0; value < 2; ++value)
            at[t][value] = kb * 16 + t >= len ? 0 /* (past the sequence: not read, nor its table) */
                           : s->block_size % 16 == 0 && t > 0 ? at[0][value] + t * (value ? s->v_token : s->k_token)
                                                              : key_row(c, i, kb * 16 + t, value);
    for (int64_t t = 0; t < 16; ++t) {
        const int64_t j = kb * 16 + t;
        const char *krow = j < len ? (const char *)k + (at[t][0] + h * s->k_head) * item : NULL;
        const char *vrow = j < len ? (const char *)v + (at[t][1] + h * s->v_head) * item : NULL;
        if (bf16) {
            uint32_t *dst = (uint32_t *)c->kp + (slab + kb * 16 * dim) / 2 + t;
            for (int64_t d2 = dim / 32 * 16; d2 < dim / 2; ++d2) dst[d2 * 16] = krow ? bits32(krow + 4 * d2) : 0;
            if (t & 1) continue;
            /* values of tokens j, j + 1 interleaved: (v[j][d], v[j + 1][d]) as one 32-bit pair */
            const uint16_t *next = j + 1 < len ? (const uint16_t *)v + at[t + 1][1] + h * s->v_head : NULL;
            uint32_t *vdst = (uint32_t *)c->vp + slab / 2 + j / 2 * dim;
            for (int64_t d = 0; d < dim; d += 16) {
                const __m512i lo = vrow ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)vrow + d)))
                                        : _mm512_setzero_si512();
                const __m512i hi = next ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(next + d)))
                                        : _mm512_setzero_si512();
                _mm512_storeu_si512(vdst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        } else {
            float *dst = (float *)c->kp + slab + kb * 16 * dim + t;
            for (int64_t d = 0; d < dim; ++d) dst[d * 16] = krow ? ((const float *)krow)[d] : 0.0f;
            float *vdst = (float *)c->vp + slab + j * dim;
            for (int64_t d = 0; d < dim; ++d) vdst[d] = vrow ? ((const float *)vrow)[d] : 0.0f;
        }
    }
    if (bf16) /* the keys' pairs of dims 16 at a time: a 16 × 16 transpose of 32-bit pairs (the rest above) */
        for (int64_t ch = 0; ch < dim / 32; ++ch) {
            __m512i r[16];
            for (int64_t t = 0; t < 16; ++t)
                r[t] = kb * 16 + t < len ? _mm512_loadu_si512((const char *)k + (at[t][0] + h * s->k_head) * 2 + ch * 64)
                                         : _mm512_setzero_si512();
            transpose16(r);
            uint32_t *dst = (uint32_t *)c->kp + (slab + kb * 16 * dim) / 2 + ch * 256;
            for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 16, r[p]);
        }
}

/* Rows [r0, r0 + 16) of sequence i's queries, query head `h` (rows past its last repeat it and are not stored). */
static inline __attribute__((always_inline)) void rows_task(const prompt_call *c, const void *q, void *out, float *sc,
                                                           uint16_t *pb, char *qb, int64_t i, int64_t h, int64_t r0,
                                                           const int64_t dim, const int bf16) {
    const prompt_shape *s = c->s;
    const int64_t len = c->lens[i], first = c->starts[i] - c->starts[0], n = c->starts[i + 1] - c->starts[i];
    const int64_t lp = padded(len);
    const int64_t off = len - n, hk = h / (s->num_heads / s->num_kv_heads), item = bf16 ? 2 : 4;
    const int64_t slab = c->packs[i] + hk * lp * dim;
    const int64_t rows = n - r0 < ROWS ? n - r0 : ROWS;
    const int64_t last = s->causal ? off + r0 + rows : len; /* keys [0, last) serve some row of the task */
    const int64_t blocks = (last + 15) / 16;
    const int64_t row = dim * item; /* bytes of a query row in `qb`, where the 16 rows are copied (thread_bytes) */
    for (int64_t r = 0; r < ROWS; ++r)
        memcpy(qb + r * row, (const char *)q + ((first + r0 + (r < rows ? r : rows - 1)) * s->q_tok + h * s->q_head) * item,
               row);
    const __m512 scale = _mm512_set1_ps(s->scale);
    for (int64_t kb = 0; kb < blocks; ++kb) { /* scores: 16 rows × 16 keys in registers */
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
        if (bf16) {
#if BF16
            const __m512i *kt = (const __m512i *)((const uint16_t *)c->kp + slab + kb * 16 * dim);
            for (int64_t d2 = 0; d2 < dim / 2; ++d2) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + d2);
                for (int r = 0; r < ROWS; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)bits32(qb + r * row + 4 * d2)), kv);
            }
#endif
        } else {
            const float *kt = (const float *)c->kp + slab + kb * 16 * dim;
            for (int64_t d = 0; d < dim; ++d) {
                const __m512 kv = _mm512_loadu_ps(kt + d * 16);
                for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(((const float *)(qb + r * row))[d]), kv, acc[r]);
            }
        }
        for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(sc + r * lp + kb * 16, _mm512_mul_ps(acc[r], scale));
    }
    float sums[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) { /* softmax numerators over the row's keys, zeros up to blocks · 16 */
        float *p = sc + r * lp;
        const int64_t valid = s->causal ? (off + r0 + (r < rows ? r : rows - 1) + 1) : len;
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < valid; t += 16) {
            const __mmask16 m = valid - t >= 16 ? 0xffff : (__mmask16)((1u << (valid - t)) - 1);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p + t));
        }
        const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        int64_t t = 0;
        for (; t < valid; t += 16) { /* (past the row's keys, zeros: no exponentials) */
            const __mmask16 m = valid - t >= 16 ? 0xffff : (__mmask16)((1u << (valid - t)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + t), most)));
            sum = _mm512_add_ps(sum, e);
            if (bf16)
                round16(pb + r * lp + t, e);
            else
                _mm512_storeu_ps(p + t, e);
        }
        for (; t < blocks * 16; t += 16)
            if (bf16)
                _mm256_storeu_si256((__m256i *)(pb + r * lp + t), _mm256_setzero_si256());
            else
                _mm512_storeu_ps(p + t, _mm512_setzero_ps());
        sums[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    for (int64_t d = 0; d < dim; d += 16) { /* the 16 rows' sums for dims [d, d + 16), over every key */
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
        if (bf16) {
#if BF16
            const uint32_t *vt = (const uint32_t *)c->vp + slab / 2;
            for (int64_t j2 = 0; j2 < blocks * 8; ++j2) {
                const __m512bh vv = (__m512bh)_mm512_loadu_si512(vt + j2 * dim + d);
                for (int r = 0; r < ROWS; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(((const int32_t *)(pb + r * lp))[j2]), vv);
            }
#endif
        } else {
            const float *vt = (const float *)c->vp + slab + d;
            for (int64_t j = 0; j < blocks * 16; ++j) {
                const __m512 vv = _mm512_loadu_ps(vt + j * dim);
                for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * lp + j]), vv, acc[r]);
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            const __m512 o = _mm512_mul_ps(acc[r], _mm512_set1_ps(sums[r]));
            const int64_t at = (first + r0 + r) * s->o_tok + h * s->o_head + d;
            if (bf16)
                round16((uint16_t *)out + at, o);
            else
                _mm512_storeu_ps((float *)out + at, o);
        }
    }
}

#if AMX
/* out lane r = op over the 16 lanes of v[r], for 16 vectors at once: halves, quarters, pairs, then single lanes
 * folded together (15 steps where 16 separate reductions take ~64), the lanes then put back in row order. */
#define REDUCE16(name, op)                                                                                            \
    static inline __m512 name(__m512 v[16]) {                                                                         \
        __m512 w[8], x[4], y[2];                                                                                      \
        for (int r = 0; r < 8; ++r)                                                                                   \
            w[r] = op(_mm512_shuffle_f32x4(v[r], v[r + 8], 0x44), _mm512_shuffle_f32x4(v[r], v[r + 8], 0xee));        \
        for (int r = 0; r < 4; ++r)                                                                                   \
            x[r] = op(_mm512_shuffle_f32x4(w[r], w[r + 4], 0x88), _mm512_shuffle_f32x4(w[r], w[r + 4], 0xdd));        \
        for (int r = 0; r < 2; ++r)                                                                                   \
            y[r] = op(_mm512_shuffle_ps(x[r], x[r + 2], 0x44), _mm512_shuffle_ps(x[r], x[r + 2], 0xee));              \
        const __m512 z = op(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));                \
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), z);     \
    }
REDUCE16(max16_rows, _mm512_max_ps)
REDUCE16(add16_rows, _mm512_add_ps)

/* rows_task's bf16 work on the tiles, every tile 16 rows × 64 bytes: 0-3 sums, 2 and 4 the queries' and
 * probabilities' tiles, 5-7 keys' and values'. Scores two blocks of 16 keys at a time (the second of zeros where the
 * padding holds it), stored for the softmax, then scaled there as rows_task scales them; the products with V 32 keys
 * (a tile of probabilities) × up to 64 dims (four sums) at a time. */
static inline __attribute__((always_inline)) void rows_task_amx(const prompt_call *c, const void *q, void *out,
                                                               float *sc, uint16_t *pb, char *qb, int64_t i,
                                                               int64_t h, int64_t r0, const int64_t dim) {
    const prompt_shape *s = c->s;
    const int64_t len = c->lens[i], first = c->starts[i] - c->starts[0], n = c->starts[i + 1] - c->starts[i];
    const int64_t lp = padded(len);
    const int64_t off = len - n, hk = h / (s->num_heads / s->num_kv_heads);
    const int64_t slab = c->packs[i] + hk * lp * dim;
    const int64_t rows = n - r0 < ROWS ? n - r0 : ROWS;
    const int64_t last = s->causal ? off + r0 + rows : len;
    const int64_t keys = (last + 31) / 32 * 32; /* scores and probabilities computed: whole tiles of 32 keys */
    /* the 16 query rows: read in place (a whole task's rows) or copied, the last repeated past the task's */
    const uint16_t *qa = (const uint16_t *)q + (first + r0) * s->q_tok + h * s->q_head;
    int64_t qs = s->q_tok * 2;
    if (rows < ROWS) {
        for (int64_t r = 0; r < ROWS; ++r)
            memcpy(qb + r * dim * 2, qa + (r < rows ? r : rows - 1) * s->q_tok, dim * 2);
        qa = (const uint16_t *)qb, qs = dim * 2;
    }
    const uint16_t *kt = (const uint16_t *)c->kp + slab, *vt = (const uint16_t *)c->vp + slab;
    int64_t kb = 0;
    if (dim <= 64) { /* the query's one or two tiles held (4, 5); four blocks of 16 keys at a time, four sums */
        _tile_loadd(4, qa, qs);
        if (dim > 32) _tile_loadd(5, qa + 32, qs);
        for (; kb + 4 <= keys / 16; kb += 4) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
#define KEYS4(qt, k0)                                                                                                 \
    do {                                                                                                              \
        _tile_loadd(6, k0, 64);                                                                                       \
        _tile_dpbf16ps(0, qt, 6);                                                                                     \
        _tile_loadd(7, (k0) + 16 * dim, 64);                                                                          \
        _tile_dpbf16ps(1, qt, 7);                                                                                     \
        _tile_loadd(6, (k0) + 32 * dim, 64);                                                                          \
        _tile_dpbf16ps(2, qt, 6);                                                                                     \
        _tile_loadd(7, (k0) + 48 * dim, 64);                                                                          \
        _tile_dpbf16ps(3, qt, 7);                                                                                     \
    } while (0)
            KEYS4(4, kt + kb * 16 * dim);
            if (dim > 32) KEYS4(5, kt + kb * 16 * dim + 512);
#undef KEYS4
            _tile_stored(0, sc + kb * 16, lp * 4);
            _tile_stored(1, sc + kb * 16 + 16, lp * 4);
            _tile_stored(2, sc + kb * 16 + 32, lp * 4);
            _tile_stored(3, sc + kb * 16 + 48, lp * 4);
        }
    }
    for (; kb < keys / 16; kb += 2) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t d = 0; d < dim / 32; ++d) {
            _tile_loadd(2, qa + d * 32, qs);
            _tile_loadd(6, kt + kb * 16 * dim + d * 512, 64);
            _tile_dpbf16ps(0, 2, 6);
            _tile_loadd(7, kt + (kb + 1) * 16 * dim + d * 512, 64);
            _tile_dpbf16ps(1, 2, 7);
        }
        _tile_stored(0, sc + kb * 16, lp * 4);
        _tile_stored(1, sc + kb * 16 + 16, lp * 4);
    }
    const __m512 scale = _mm512_set1_ps(s->scale);
    __m512 part[ROWS];
    int64_t valid[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) { /* rows_task's softmax, each score scaled as read; zeros up to `keys` */
        const float *p = sc + r * lp;
        valid[r] = s->causal ? (off + r0 + (r < rows ? r : rows - 1) + 1) : len;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < valid[r]; t += 16) {
            const __mmask16 m = valid[r] - t >= 16 ? 0xffff : (__mmask16)((1u << (valid[r] - t)) - 1);
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p + t));
        }
        part[r] = top;
    }
    float most[ROWS], inv[ROWS];
    _mm512_storeu_ps(most, _mm512_mul_ps(max16_rows(part), scale));
    for (int64_t r = 0; r < ROWS; ++r) {
        const float *p = sc + r * lp;
        const __m512 top = _mm512_set1_ps(most[r]);
        __m512 sum = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t < valid[r]; t += 16) { /* (past a row's keys, zeros: no exponentials) */
            const __mmask16 m = valid[r] - t >= 16 ? 0xffff : (__mmask16)((1u << (valid[r] - t)) - 1);
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p + t), scale);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(x, top)));
            sum = _mm512_add_ps(sum, e);
            round16(pb + r * lp + t, e);
        }
        for (; t < keys; t += 16) _mm256_storeu_si256((__m256i *)(pb + r * lp + t), _mm256_setzero_si256());
        part[r] = sum;
    }
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), add16_rows(part)));
    float o[ROWS * 64];
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int64_t nd = dim - d0 < 64 ? (dim - d0) / 16 : 4; /* sums of 16 dims each */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = 0; j < keys; j += 32) {
            const uint16_t *v0 = vt + j * dim + d0 * 2; /* key pair j / 2: dim pairs of (v[j][d], v[j + 1][d]) */
            _tile_loadd(4, pb + j, lp * 2);
            _tile_loadd(5, v0, dim * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) {
                _tile_loadd(6, v0 + 32, dim * 4);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nd > 2) {
                _tile_loadd(7, v0 + 64, dim * 4);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (nd > 3) {
                _tile_loadd(5, v0 + 96, dim * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o, 256);
        if (nd > 1) _tile_stored(1, o + 16, 256);
        if (nd > 2) _tile_stored(2, o + 32, 256);
        if (nd > 3) _tile_stored(3, o + 48, 256);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t d = 0; d < nd * 16; d += 16)
                round16((uint16_t *)out + (first + r0 + r) * s->o_tok + h * s->o_head + d0 + d,
                        _mm512_mul_ps(_mm512_loadu_ps(o + r * 64 + d), _mm512_set1_ps(inv[r])));
    }
}
#endif

typedef struct {
    int64_t seq, r0, keys; /* a task's sequence, first row, and the keys it reads (its work) */
} task;

static int most_keys_first(const void *a, const void *b) {
    const int64_t x = ((const task *)a)->keys, y = ((const task *)b)->keys;
    return (x < y) - (x > y);
}

static int prompt(const prompt_shape *s, const int32_t *starts, const int32_t *lens, const int32_t *tables,
                  const void *q, const void *k, const void *v, void *out, char *scratch, const int bf16) {
    if (!epdmesh_prompt_supports(bf16, s->head_dim)) return -1;
    if (!(s->scale > 0)) return -3;
    for (int64_t i = 0; i < s->num_seqs; ++i) /* rows in order, never more than the keys they end */
        if (starts[i + 1] < starts[i] || starts[i + 1] - starts[i] > lens[i] || lens[i] < 0) return -2;
    const int64_t item = bf16 ? 2 : 4, seqs = s->num_seqs, kvh = s->num_kv_heads;
    int64_t *packs = malloc(sizeof(int64_t) * (seqs + 1)), *blocks = malloc(sizeof(int64_t) * (seqs + 1));
    int64_t tasks = 0, longest = 0;
    packs[0] = blocks[0] = 0;
    for (int64_t i = 0; i < seqs; ++i) {
        packs[i + 1] = packs[i] + pack_elements(s, lens[i]);
        blocks[i + 1] = blocks[i] + kvh * (padded(lens[i]) / 16);
        tasks += (starts[i + 1] - starts[i] + ROWS - 1) / ROWS;
        longest = lens[i] > longest ? lens[i] : longest;
    }
    task *order = malloc(sizeof(task) * (tasks ? tasks : 1));
    for (int64_t i = 0, t = 0; i < seqs; ++i) {
        const int64_t n = starts[i + 1] - starts[i];
        for (int64_t r0 = 0; r0 < n; r0 += ROWS)
            order[t++] = (task){i, r0, s->causal ? lens[i] - n + (n - r0 < ROWS ? n : r0 + ROWS) : lens[i]};
    }
    qsort(order, tasks, sizeof(task), most_keys_first);
    char *base = (char *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    const prompt_call c = {s, starts, lens, tables, packs, base, base + packs[seqs] * item};
    char *rows = base + 2 * packs[seqs] * item;
#pragma omp parallel num_threads(s->threads)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < blocks[seqs]; ++w) { /* (sequence, kv head, block of 16 keys) */
            int64_t i = 0;
            while (blocks[i + 1] <= w) ++i;
            const int64_t per_head = padded(lens[i]) / 16, at = w - blocks[i];
            pack_block(&c, k, v, i, at / per_head, at % per_head, bf16);
        }
        float *sc = (float *)(rows + omp_get_thread_num() * thread_bytes(longest));
        uint16_t *pb = (uint16_t *)(sc + ROWS * padded(longest));
        char *qb = (char *)(pb + ROWS * padded(longest));
#if AMX
        const int amx = tiles && bf16 && s->head_dim % 32 == 0;
        if (amx) {
            tile_config cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
            _tile_loadconfig(&cfg);
        }
#endif
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < tasks * s->num_heads; ++w) {
            const task t = order[w / s->num_heads];
            const int64_t h = w % s->num_heads;
#if AMX
            if (amx && s->head_dim == 64)
                rows_task_amx(&c, q, out, sc, pb, qb, t.seq, h, t.r0, 64);
            else if (amx && s->head_dim == 128)
                rows_task_amx(&c, q, out, sc, pb, qb, t.seq, h, t.r0, 128);
            else if (amx)
                rows_task_amx(&c, q, out, sc, pb, qb, t.seq, h, t.r0, s->head_dim);
            else
#endif
            if (s->head_dim == 64 && bf16)
                rows_task(&c, q, out, sc, pb, qb, t.seq, h, t.r0, 64, 1);
            else if (s->head_dim == 64)
                rows_task(&c, q, out, sc, pb, qb, t.seq, h, t.r0, 64, 0);
            else if (s->head_dim == 128 && bf16)
                rows_task(&c, q, out, sc, pb, qb, t.seq, h, t.r0, 128, 1);
            else if (bf16)
                rows_task(&c, q, out, sc, pb, qb, t.seq, h, t.r0, s->head_dim, 1);
            else
                rows_task(&c, q, out, sc, pb, qb, t.seq, h, t.r0, s->head_dim, 0);
        }
#if AMX
        if (amx) _tile_release();
#endif
    }
    free(order);
    free(blocks);
    free(packs);
    return 0;
}
#endif

int epdmesh_prompt_bf16(const prompt_shape *s, const int32_t *starts, const int32_t *lens, const int32_t *tables,
                        const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, char *scratch) {
#if BF16
    return prompt(s, starts, lens, tables, q, k, v, out, scratch, 1);
#else
    (void)s, (void)starts, (void)lens, (void)tables, (void)q, (void)k, (void)v, (void)out, (void)scratch;
    return -1;
#endif
}

int epdmesh_prompt_f32(const prompt_shape *s, const int32_t *starts, const int32_t *lens, const int32_t *tables,
                       const float *q, const float *k, const float *v, float *out, char *scratch) {
#if VEC
    return prompt(s, starts, lens, tables, q, k, v, out, scratch, 0);
#else
    (void)s, (void)starts, (void)lens, (void)tables, (void)q, (void)k, (void)v, (void)out, (void)scratch;
    return -1;
#endif
}
