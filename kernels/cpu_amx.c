/* bf16 products on Intel AMX, y [M, N] = x [M, K] · Wᵀ: a decode step's linears (a few rows), a prompt's (many rows,
 * below), and a SwiGLU's gate and up products with its activation (both).
 *
 * oneDNN's product at these row counts reads its packed weights at ~15 GB/s on a 2-core Xeon (AMX), where a plain
 * stream of the same bytes reads at ~36 (at 17–32 rows ~8): a decode step is bound by reading every weight once.
 * This reads them as AMX tiles laid out in the order it uses them: `tiles` [N/16][K/32][16 pairs of k][16 n][2]
 * bf16, so that each 16-column block is one contiguous stream (kernels/cpu_amx.py `pack`). Up to 16 rows, four
 * blocks at a time share the input's tile: per 32 of K, one tile of x (M rows × 32) and four of weights (16 pairs ×
 * 16 columns × 2), four TDPBF16PS into four fp32 tiles of M × 16, then each rounded to bf16 (to nearest even, as
 * torch rounds). More rows: `slabs`, below.
 *
 * The arithmetic is the tile unit's, the unit oneDNN's products use on these hosts: each output is the fp32 sum
 * along K in chunks of 32, in order, rounded once — bit-identical to oneDNN's at the same row count up to 32 rows
 * (tests); beyond, oneDNN splits its sums otherwise and the two differ within bf16's rounding. Where the compiler
 * does not target AMX, `epdmesh_amx_linear`, `epdmesh_amx_swiglu_rows`, `epdmesh_amx_gemm` and `epdmesh_swiglu`
 * return -3.
 *
 * A prompt's products (`epdmesh_amx_gemm`, hundreds of rows) are bound by the tile loads, not the reads from memory:
 * the tile unit computes at ~6 TFLOP/s on two cores of these Xeons when its operands come from L1, ~2 from L2 (the
 * rate oneDNN's products reach, 2026-12-07). There the input is first copied into tiles too (each 16 rows × 32 of K
 * one contiguous 1 KiB, as the weights), the weights of two column blocks (K ≤ 512: 32 KiB) stay in L1 while the
 * rows' tiles stream past them (loaded with the non-temporal hint, so that they do not evict the weights), longer
 * K runs in parts whose fp32 sums wait in a per-thread buffer, and the rows run in blocks of ≤ 1 MiB of input so
 * that a block stays in L2 for every column block. Each finished 32 × 32 block is rounded by the hardware's
 * conversion (to nearest even, as oneDNN's) and written a whole line a row with non-temporal stores, spread over
 * the next block's loop (reading the tile's fp32 right after storing it stalls). A prompt's qkv projection can take
 * its RoPE and K/V write the same way (`epdmesh_amx_qkv_rope`): a head's groups run in order on one thread, its
 * first half's blocks kept (rounded) until its second half's finish, then both rotated into q or K's slot.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_tiles.h"
#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
int epdmesh_amx_init(void) { return tiles_request(); }

/* 16 fp32 → bf16, to nearest even; a NaN stays a quiet NaN (as f32_to_bf16 in cpu_paged.c). */
static inline __m256i to_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i even = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), even, nan));
}

#ifndef PF
#define PF 4
#endif
#define AHEAD(p)                                                                                                      \
    do {                                                                                                              \
        const char *a_ = (const char *)(p);                                                                           \
        for (int l_ = 0; l_ < 1024; l_ += 64) _mm_prefetch(a_ + l_, _MM_HINT_T0);                                     \
    } while (0)

/* Tile t (fp32, up to 16 × 16) rounded into y's rows [m0, m0 + 16) ∩ [0, M) and columns [n0, n0 + 16). */
#define STORE(t, m0, n0)                                                                                             \
    do {                                                                                                              \
        _tile_stored(t, out, 64);                                                                                     \
        for (int64_t m = (m0); m < M && m < (m0) + 16; ++m)                                                          \
            _mm256_storeu_si256((__m256i *)(y + m * ys + (n0)), to_bf16(_mm512_loadu_ps(out + (m - (m0)) * 16))); \
    } while (0)

/* More than 16 rows: slabs of 16 rows, two slabs by two column blocks at a time — two tiles of x, two of weights,
 * four sums — so that each weight tile read serves 32 rows; a group of two column blocks runs all its slabs while
 * its weights are in L1/L2, the next chunks of its two weight streams prefetched. A last slab of fewer rows runs
 * under a second tile configuration. */
static int slabs(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N, uint16_t *y,
                 int64_t ys) {
    const int64_t rows = (M + 15) / 16 * 16, blocks = N / 16, groups = (blocks + 1) / 2, chunks = K / 32;
    const int64_t tail = M - (rows - 16), last = (rows - 1) / 32 * 32; /* the last slab's rows; its pair's m0 */
#pragma omp parallel
    {
        tile_config full, part;
        memset(&full, 0, sizeof full);
        full.palette = 1;
        for (int t = 0; t < 8; ++t) full.rows[t] = 16, full.colsb[t] = 64; /* 0-3 sums, 4-5 x, 6-7 weights */
        part = full;
        if (rows / 16 % 2) /* the last slab alone: sums 0, 1 and x 4 */
            part.rows[0] = part.rows[1] = part.rows[4] = (uint8_t)tail;
        else /* the second of a pair: sums 2, 3 and x 5 */
            part.rows[2] = part.rows[3] = part.rows[5] = (uint8_t)tail;
        const tile_config *now = &full;
        _tile_loadconfig(now);
        float out[16 * 16];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t b0 = 2 * g, two = blocks - b0 > 1;
            const uint16_t *w0 = tiles + b0 * 16 * K, *w1 = w0 + 16 * K;
            for (int64_t m0 = 0; m0 < rows; m0 += 32) {
                const uint16_t *x0 = x + m0 * xs, *x1 = x0 + 16 * xs;
                const int pair = m0 + 16 < rows;
                const tile_config *want = m0 == last && tail < 16 ? &part : &full;
                if (want != now) _tile_loadconfig(now = want);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                if (pair && two) {
                    for (int64_t c = 0; c < chunks; ++c) {
                        if (m0 == 0) { /* the first pair reads the weights from memory */
                            AHEAD(w0 + (c + PF) * 512);
                            AHEAD(w1 + (c + PF) * 512);
                        }
                        _tile_loadd(4, x0 + c * 32, xs * 2);
                        _tile_loadd(6, w0 + c * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_loadd(5, x1 + c * 32, xs * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_loadd(7, w1 + c * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                } else { /* the last slab alone, or the last column block alone */
                    for (int64_t c = 0; c < chunks; ++c) {
                        _tile_loadd(4, x0 + c * 32, xs * 2);
                        _tile_loadd(6, w0 + c * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (pair) {
                            _tile_loadd(5, x1 + c * 32, xs * 2);
                            _tile_dpbf16ps(2, 5, 6);
                        }
                        if (two) {
                            _tile_loadd(7, w1 + c * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                    }
                }
                STORE(0, m0, b0 * 16);
                if (two) STORE(1, m0, b0 * 16 + 16);
                if (pair) STORE(2, m0 + 16, b0 * 16);
                if (pair && two) STORE(3, m0 + 16, b0 * 16 + 16);
            }
        }
        _tile_release();
    }
    return 0;
}

/* x [M][K] (row stride xs), tiles as above, y [M][N] (row stride ys), in elements. -1: a shape it does not take. */
int epdmesh_amx_linear(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                       uint16_t *y, int64_t ys) {
    if (M < 1 || N % 16 || K % 32) return -1;
    if (M > 16) return slabs(x, M, xs, K, tiles, N, y, ys);
    const int64_t blocks = N / 16, groups = (blocks + 3) / 4, chunks = K / 32;
#pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 5; ++t) cfg.rows[t] = (uint8_t)M, cfg.colsb[t] = 64; /* 0-3: sums (M × 16 fp32); 4: x */
        for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;         /* weights: 16 pairs × 16 × 2 */
        _tile_loadconfig(&cfg);
        float out[16 * 16];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t b0 = 4 * g, nb = blocks - b0 < 4 ? blocks - b0 : 4;
            const uint16_t *w = tiles + b0 * 16 * K;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            if (nb == 4) {
                for (int64_t c = 0; c < chunks; ++c) {
                    _tile_loadd(4, x + c * 32, xs * 2);
                    _tile_loadd(5, w + c * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, w + 16 * K + c * 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(7, w + 32 * K + c * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, w + 48 * K + c * 512, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            } else { /* the last 1-3 blocks of N */
                for (int64_t c = 0; c < chunks; ++c) {
                    _tile_loadd(4, x + c * 32, xs * 2);
                    _tile_loadd(5, w + c * 512, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nb > 1) {
                        _tile_loadd(6, w + 16 * K + c * 512, 64);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                    if (nb > 2) {
                        _tile_loadd(7, w + 32 * K + c * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                    }
                }
            }
            STORE(0, 0, b0 * 16);
            if (nb > 1) STORE(1, 0, b0 * 16 + 16);
            if (nb > 2) STORE(2, 0, b0 * 16 + 32);
            if (nb > 3) STORE(3, 0, b0 * 16 + 48);
        }
        _tile_release();
    }
    return 0;
}


static inline __m512 silu_times(__m512 g, __m512 u);

/* A decode step's SwiGLU (≤ 16 rows): the gate's and the up's products of `tiles` packed from [2N, K] (the gate's N
 * rows, then the up's) and silu(gate) · up [M][N] in one call, as `epdmesh_amx_gemm`'s SwiGLU computes it: per group
 * two output blocks, four weight tiles (the gate's two, the up's same two) sharing the input's tile. -1: a shape it
 * does not take (M > 16, N % 16, K % 32). */
int epdmesh_amx_swiglu_rows(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                            uint16_t *y, int64_t ys) {
    if (M < 1 || M > 16 || N % 16 || K % 32) return -1;
    const int64_t blocks = N / 16, groups = (blocks + 1) / 2, chunks = K / 32, up = blocks * 16 * K;
#pragma omp parallel
    {
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 5; ++t) cfg.rows[t] = (uint8_t)M, cfg.colsb[t] = 64; /* 0-1 gate, 2-3 up sums; 4: x */
        for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        __asm__ volatile("" : : "r"(&cfg) : "memory");
        _tile_loadconfig(&cfg);
        float out[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t b0 = 2 * g, two = blocks - b0 > 1;
            const uint16_t *w = tiles + b0 * 16 * K;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < chunks; ++c) {
                _tile_loadd(4, x + c * 32, xs * 2);
                _tile_loadd(5, w + c * 512, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, w + up + c * 512, 64);
                _tile_dpbf16ps(2, 4, 6);
                if (two) {
                    _tile_loadd(7, w + 16 * K + c * 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(5, w + up + 16 * K + c * 512, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, out[0], 64);
            _tile_stored(2, out[2], 64);
            if (two) {
                _tile_stored(1, out[1], 64);
                _tile_stored(3, out[3], 64);
            }
            for (int64_t m = 0; m < M; ++m)
                for (int64_t b = 0; b <= two; ++b) {
                    const __m512 gate = round_bf16_16(_mm512_load_ps(out[b] + m * 16));
                    const __m512 upv = round_bf16_16(_mm512_load_ps(out[2 + b] + m * 16));
                    _mm256_storeu_si256((__m256i *)(y + m * ys + (b0 + b) * 16), to_bf16(silu_times(gate, upv)));
                }
        }
        _tile_release();
    }
    return 0;
}

/* ---- a prompt's products ---- */
#define GEMM_KC 16              /* chunks of 32 of K a pass at most: two column blocks' weights, 32 KiB, in L1 */
#define GEMM_BLOCK (1024 * 1024) /* bytes of packed input a block of rows at most (a core's L2 is 2 MiB) */

/* Bytes of scratch `epdmesh_amx_gemm` (and `epdmesh_amx_qkv_rope`) needs for M rows of K: the input as tiles, then
 * each thread's fp32 sums and its kept halves (SwiGLU's half lines; a rotary's first halves, head_dim ≤ 128). */
int64_t epdmesh_amx_gemm_scratch(int64_t M, int64_t K) {
    const int64_t pairs = (M + 31) / 32;
    return pairs * 32 * K * 2 + (int64_t)omp_get_max_threads() * pairs * 1024 * (4 + 4) + 64;
}

/* Rows of slabs [s0, s1) of x (16 rows each) into `ap`: per slab, K/32 tiles of 16 rows × 32, zeros past row M. */
static void pack_rows(const uint16_t *x, int64_t M, int64_t xs, int64_t K, uint16_t *ap, int64_t s0, int64_t s1) {
    const int64_t chunks = K / 32;
    for (int64_t s = s0; s < s1; ++s)
        for (int64_t r = 0; r < 16; ++r) {
            const int64_t m = s * 16 + r;
            uint16_t *d = ap + (s * chunks * 16 + r) * 32;
            for (int64_t c = 0; c < chunks; ++c)
                _mm512_store_si512(d + c * 512, m < M ? _mm512_loadu_si512(x + m * xs + c * 32) : _mm512_setzero_si512());
        }
}

/* gate / (1 + exp(-gate)) · up, in fp32: silu(gate) · up as inductor's fused code computes it. */
static inline __m512 silu_times(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.0f))), u);
}

enum { PLAIN, FIRST_HALF, SECOND_HALF, SECOND_HALF_KEPT, LONE_HALF, ROPE_FIRST, ROPE_SECOND, ROPE_WHOLE, ROPE_V };
/* (what a finished block's rows become) */

/* Where `epdmesh_amx_qkv_rope` puts a qkv projection's outputs: RoPE applied to q's and k's heads, q into `q`
 * ([M][heads][dim]), K and V into their slots of a layer's caches (blocks[m] · block + offsets[m] · token + head ·
 * kv head, in elements), as `epdmesh_rotary_kv_bf16` (cpu_paged.c) puts them from the projection's rows. */
typedef struct {
    int64_t heads, kv_heads, dim;
    const uint16_t *cos, *sin; /* [M][dim] bf16, row stride cs_stride */
    int64_t cs_stride;
    const int64_t *blocks, *offsets;
    uint16_t *q, *kc, *vc;
    int64_t k_block, k_token, k_head, v_block, v_token, v_head;
} rope_out;
enum { GEMM_SWIGLU = 1, GEMM_PACKED_IN = 2, GEMM_PACKED_OUT = 4 }; /* epdmesh_amx_gemm's flags */

/* Row r (0-31) of a finished block q (four fp32 tiles: rows 0-15 × the two column blocks, rows 16-31 × the two).
 * PLAIN: a 32 × 32 block of the product, the row one line of 32 bf16, rounded by the hardware's conversion and
 * written around the cache. Otherwise the two column blocks are 16 columns of a SwiGLU's gate and the same 16 of
 * its up projection: each rounded to bf16 (the products' outputs), then silu(gate) · up in fp32, rounded once as
 * torch rounds (software: the hardware's conversion flushes subnormals) — 16 bf16, half a line: FIRST_HALF keeps
 * them in `half` (the thread's buffer) until SECOND_HALF, the next 16 columns' block, writes the whole line around
 * the cache (half lines written so were slower than through the cache); LONE_HALF (where N is not a multiple of 32
 * and rows do not start on a line) writes its half line through the cache. */
static inline void block_row(uint16_t *y, float (*q)[256], int64_t r, int kind, uint16_t *half) {
    const int64_t h = r >> 4, i = (r & 15) * 16;
    if (kind == PLAIN) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(q[2 * h + 1] + i), _mm512_load_ps(q[2 * h] + i));
        _mm512_stream_si512((void *)y, (__m512i)v);
        return;
    }
    const __m512 g = round_bf16_16(_mm512_load_ps(q[2 * h] + i)), u = round_bf16_16(_mm512_load_ps(q[2 * h + 1] + i));
    const __m256i v = to_bf16(silu_times(g, u));
    if (kind == FIRST_HALF)
        _mm256_store_si256((__m256i *)(half + r * 16), v);
    else if (kind == SECOND_HALF || kind == SECOND_HALF_KEPT) {
        const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(half + r * 16))), v, 1);
        if (kind == SECOND_HALF)
            _mm512_stream_si512((void *)y, line);
        else /* the next product's input, read soon: through the cache */
            _mm512_store_si512((void *)y, line);
    }
    else
        _mm256_storeu_si256((__m256i *)y, v);
}

/* Row r (0-31) of a finished block q of a qkv projection (32 columns: group g of its head hh, `j` = g's place in
 * the head) as `epdmesh_amx_qkv_rope` writes it, for row m. The products rounded to bf16 as `block_row` rounds them
 * (the hardware's conversion), then as cpu_paged.c's `epdmesh_rotary_kv_bf16`: per half, x1·c − x2·s and x2·c +
 * x1·s in fp32 (no fused multiply-add), rounded once (software, as torch). ROPE_FIRST keeps the rounded group (a
 * head's first half) in `kept`; ROPE_SECOND, its second half's group, writes both halves' results; ROPE_WHOLE (head_dim
 * 32: both halves in the group) writes them at once; ROPE_V writes the rounded values into V's slot. */
static inline void rope_row(const rope_out *ro, float (*q)[256], int64_t r, int64_t m, int kind, int64_t hh,
                            int64_t j, uint16_t *kept) {
    const int64_t h = r >> 4, i = (r & 15) * 16;
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(q[2 * h + 1] + i), _mm512_load_ps(q[2 * h] + i));
    if (kind == ROPE_FIRST) {
        _mm512_store_si512((void *)(kept + r * 32), (__m512i)v);
        return;
    }
    if (kind == ROPE_V) {
        const int64_t head = hh - ro->heads - ro->kv_heads;
        _mm512_storeu_si512((void *)(ro->vc + ro->blocks[m] * ro->v_block + ro->offsets[m] * ro->v_token +
                                     head * ro->v_head + j * 32), (__m512i)v);
        return;
    }
    const int64_t half = ro->dim / 2; /* the pair's columns in each half from c0 */
    const int64_t c0 = kind == ROPE_WHOLE ? 0 : (j - ro->dim / 64) * 32;
    uint16_t *out = hh < ro->heads ? ro->q + (m * ro->heads + hh) * ro->dim
                                   : ro->kc + ro->blocks[m] * ro->k_block + ro->offsets[m] * ro->k_token +
                                         (hh - ro->heads) * ro->k_head;
    const uint16_t *c = ro->cos + m * ro->cs_stride, *sn = ro->sin + m * ro->cs_stride;
    uint16_t x2[32] __attribute__((aligned(64)));
    _mm512_store_si512((void *)x2, (__m512i)v);
    const uint16_t *x1 = kind == ROPE_WHOLE ? x2 : kept + r * 32, *x2h = kind == ROPE_WHOLE ? x2 + 16 : x2;
    for (int64_t t = 0; t < (kind == ROPE_WHOLE ? 16 : 32); t += 16) {
        const __m512 a = load16(x1, t, 1), b = load16(x2h, t, 1);
        const int64_t at = c0 + t, up = half + c0 + t;
        const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, load16(c, at, 1)), _mm512_mul_ps(b, load16(sn, at, 1)));
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, load16(c, up, 1)), _mm512_mul_ps(a, load16(sn, up, 1)));
        store_bf16_16(out + c0 + t, lo);
        store_bf16_16(out + half + c0 + t, hi);
    }
}

/* x [M][K] (row stride xs), tiles as above, y [M][N] (row stride ys, 64-byte aligned rows), in elements; scratch of
 * `epdmesh_amx_gemm_scratch` bytes, 64-byte aligned. -1: a shape it does not take (N % 32, K % 32); -2: too little
 * scratch. `swiglu`: the tiles are a SwiGLU's gate and up projections stacked ([2N, K]: the gate's N rows, then the
 * up's), and y is silu(gate) · up [M][N] (N a multiple of 16): a group is the gate's and the up's same 16 columns.
 * `flags`: GEMM_SWIGLU for that; GEMM_PACKED_OUT (with it, N a multiple of 32) writes y as the next product's copy of
 * its input into tiles ([ceil(M/32)·2 slabs][N/32][16][32], through the cache; rows past M left as they were), and
 * GEMM_PACKED_IN takes x so (64-byte aligned, xs unused): a SwiGLU MLP's two products with no [M][N] between. */
static int gemm(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N, uint16_t *y,
                int64_t ys, void *scratch, int64_t scratch_bytes, int flags, const rope_out *ro) {
    const int swiglu = flags & GEMM_SWIGLU, packed_in = flags & GEMM_PACKED_IN, packed_out = flags & GEMM_PACKED_OUT;
    if (M < 1 || N % (swiglu ? 16 : 32) || K % 32 || ys % (swiglu ? 16 : 32) || ((uintptr_t)y | (uintptr_t)scratch) % 64)
        return -1;
    if ((packed_out && (!swiglu || N % 32)) || (packed_in && (uintptr_t)x % 64)) return -1;
    if (scratch_bytes < epdmesh_amx_gemm_scratch(M, K)) return -2;
    const int64_t pairs = (M + 31) / 32, groups = N / (swiglu ? 16 : 32), chunks = K / 32, tsz = chunks * 512;
    const int64_t width = swiglu ? 16 : 32, second = swiglu ? N / 16 * tsz : tsz; /* a group's columns; w1 - w0 */
    const int64_t parts = (chunks + GEMM_KC - 1) / GEMM_KC, kc = (chunks + parts - 1) / parts;
    int64_t per = GEMM_BLOCK / (K * 2 * 32); /* pairs of rows a block */
    per = per < 1 ? 1 : per;
    const int64_t blocks = (pairs + per - 1) / per;
    per = (pairs + blocks - 1) / blocks;
    uint16_t *ap = packed_in ? (uint16_t *)x : scratch;
    float *spill = (float *)((uint16_t *)scratch + pairs * 32 * K);
    uint16_t *halves = (uint16_t *)(spill + (int64_t)omp_get_max_threads() * pairs * 1024);
    /* row m's line from column pn: in y's rows, or (GEMM_PACKED_OUT) where the next product's copy of its input into
     * tiles would put it — slab m / 16, chunk pn / 32, row m % 16 */
#define DST(m)                                                                                                    \
    (packed_out ? y + (((m) / 16 * (N / 32) + pn / 32) * 16 + (m) % 16) * 32 : y + (m) * ys + pn)
    const int second_kind = packed_out ? SECOND_HALF_KEPT : SECOND_HALF;
#define DONE_ROW(qq, r)                                                                                           \
    (ro ? rope_row(ro, qq, r, pm + (r), kind, ph_head, ph_j, ph) : block_row(DST(pm + (r)), qq, r, kind, ph))
    /* the work shared out: plain, a group of 32 columns; SwiGLU, two groups of 16 (one line); a rotary, a head's
     * groups (its first half's kept until its second half's finish) */
    const int64_t per_unit = ro ? ro->dim / 32 : swiglu ? 2 : 1, units = (groups + per_unit - 1) / per_unit;
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num(), share = (2 * pairs + threads - 1) / threads;
        const int64_t s0 = me * share, s1 = s0 + share < 2 * pairs ? s0 + share : 2 * pairs;
        if (s0 < s1 && !packed_in) pack_rows(x, M, xs, K, ap, s0, s1);
        float *sums = spill + me * pairs * 1024;
        uint16_t *half = halves + me * pairs * 2048;
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* 0-3 sums, 4-5 rows, 6-7 weights */
        __asm__ volatile("" : : "r"(&cfg) : "memory"); /* gcc 12 has dropped the stores above before ldtilecfg */
        _tile_loadconfig(&cfg);
        float ready[2][4][256] __attribute__((aligned(64))); /* the last block's sums, and the one before */
        int64_t pm = -1, pn = 0, ph_head = 0, ph_j = 0; /* the block whose rows are still to write (-1: none), its
                                                           kind and half line; a rotary's head and group in it */
        int cur = 0, kind = PLAIN;
        uint16_t *ph = half;
#pragma omp barrier
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t p0 = b * per, p1 = p0 + per < pairs ? p0 + per : pairs;
#pragma omp for schedule(static) nowait
            for (int64_t unit = 0; unit < units; ++unit)
            for (int64_t g = per_unit * unit; g < per_unit * (unit + 1) && g < groups; ++g) {
                const uint16_t *w0 = tiles + (swiglu ? g : 2 * g) * tsz, *w1 = w0 + second;
                const int64_t gj = ro ? g % per_unit : 0, gh = ro ? g / per_unit : 0; /* a rotary's group, head */
                const int done_kind = ro      ? (gh >= ro->heads + ro->kv_heads ? ROPE_V
                                                 : per_unit == 1               ? ROPE_WHOLE
                                                 : gj < per_unit / 2           ? ROPE_FIRST
                                                                               : ROPE_SECOND)
                                      : !swiglu ? PLAIN
                                      : N % 32  ? LONE_HALF /* rows not whole lines */
                                      : g % 2   ? second_kind
                                                : FIRST_HALF;
                for (int64_t part = 0; part < parts; ++part) {
                    const int64_t c0 = part * kc, c1 = c0 + kc < chunks ? c0 + kc : chunks, last = part + 1 == parts;
                    for (int64_t p = p0; p < p1; ++p) {
                        const uint16_t *a0 = ap + 2 * p * tsz, *a1 = a0 + tsz;
                        float *kept = sums + p * 1024;
                        if (part == 0) {
                            _tile_zero(0);
                            _tile_zero(1);
                            _tile_zero(2);
                            _tile_zero(3);
                        } else {
                            _tile_loadd(0, kept, 64);
                            _tile_loadd(1, kept + 256, 64);
                            _tile_loadd(2, kept + 512, 64);
                            _tile_loadd(3, kept + 768, 64);
                        }
                        float(*q)[256] = ready[cur ^ 1];
                        int64_t r = 0; /* rows of block pm written */
                        for (int64_t c = c0; c < c1; ++c) {
                            if (p == p0) { /* the first pair reads the weights from memory */
                                AHEAD(w0 + (c + PF) * 512);
                                AHEAD(w1 + (c + PF) * 512);
                            }
                            _tile_stream_loadd(4, a0 + c * 512, 64);
                            _tile_loadd(6, w0 + c * 512, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_stream_loadd(5, a1 + c * 512, 64);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_loadd(7, w1 + c * 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_dpbf16ps(3, 5, 7);
                            if (pm >= 0 && r < 32) { /* a row of the previous block while these run */
                                if (pm + r < M) DONE_ROW(q, r);
                                ++r;
                            }
                        }
                        if (pm >= 0) {
                            for (; r < 32; ++r)
                                if (pm + r < M) DONE_ROW(q, r);
                            pm = -1;
                        }
                        if (!last) {
                            _tile_stored(0, kept, 64);
                            _tile_stored(1, kept + 256, 64);
                            _tile_stored(2, kept + 512, 64);
                            _tile_stored(3, kept + 768, 64);
                        } else {
                            _tile_stored(0, ready[cur][0], 64);
                            _tile_stored(1, ready[cur][1], 64);
                            _tile_stored(2, ready[cur][2], 64);
                            _tile_stored(3, ready[cur][3], 64);
                            pm = 32 * p, cur ^= 1, kind = done_kind;
                            pn = kind == second_kind ? width * (g - 1) : width * g; /* a line from its start */
                            ph = ro ? half + ((p - p0) * 2 + gj % (per_unit / 2 ? per_unit / 2 : 1)) * 1024
                                    : half + (p - p0) * 512;
                            ph_head = gh, ph_j = gj;
                        }
                    }
                }
            }
        }
        if (pm >= 0)
            for (int64_t r = 0; r < 32; ++r)
                if (pm + r < M) DONE_ROW(ready[cur ^ 1], r);
        _tile_release();
    }
    _mm_sfence(); /* the non-temporal stores visible before the caller reads y */
    return 0;
#undef DONE_ROW
#undef DST
}

int epdmesh_amx_gemm(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                     uint16_t *y, int64_t ys, void *scratch, int64_t scratch_bytes, int flags) {
    return gemm(x, M, xs, K, tiles, N, y, ys, scratch, scratch_bytes, flags, NULL);
}

/* A prompt's qkv projection with its RoPE and K/V write (`rope_out`): `epdmesh_amx_gemm`'s product of x [M][K] and
 * the projection's tiles (N = (heads + 2 · kv_heads) · dim: q's columns, k's, v's), each head's outputs written
 * where `epdmesh_rotary_kv_bf16` writes them from the product's rows — the same bits, with no [M][N] between. -1: a
 * shape it does not take (dim 32, 64 or 128, N as the heads make it); -2: a slot outside the cache
 * (`num_blocks`: the caches' blocks), nothing written then; -3: no AMX in this build. */
int epdmesh_amx_qkv_rope(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                         const rope_out *ro, int64_t num_blocks, int64_t block_size, void *scratch,
                         int64_t scratch_bytes) {
    if ((ro->dim != 32 && ro->dim != 64 && ro->dim != 128) || N != (ro->heads + 2 * ro->kv_heads) * ro->dim)
        return -1;
    for (int64_t m = 0; m < M; ++m)
        if (ro->blocks[m] < 0 || ro->blocks[m] >= num_blocks || ro->offsets[m] < 0 || ro->offsets[m] >= block_size)
            return -2;
    static uint16_t none[32] __attribute__((aligned(64))); /* y: unused (every row goes through `ro`) */
    return gemm(x, M, xs, K, tiles, N, none, 32, scratch, scratch_bytes, 0, ro);
}

/* silu(gate) · up of products already rounded (`epdmesh_amx_linear`'s [M][2N]: the gate's N columns, then the
 * up's) into y [M][N], as the gemm's epilogue computes it; N a multiple of 16. For a decode step's few rows. */
int epdmesh_swiglu(const uint16_t *gu, int64_t M, int64_t gs, int64_t N, uint16_t *y, int64_t ys) {
    if (N % 16) return -1;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < N; i += 16) {
            const __m512 g = load16(gu + m * gs, i, 1), u = load16(gu + m * gs, N + i, 1);
            _mm256_storeu_si256((__m256i *)(y + m * ys + i), to_bf16(silu_times(g, u)));
        }
    return 0;
}

#else
int epdmesh_amx_init(void) { return -3; }

int epdmesh_amx_linear(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                       uint16_t *y, int64_t ys) {
    (void)x, (void)M, (void)xs, (void)K, (void)tiles, (void)N, (void)y, (void)ys;
    return -3;
}

int64_t epdmesh_amx_gemm_scratch(int64_t M, int64_t K) {
    (void)M, (void)K;
    return 0;
}

int epdmesh_amx_swiglu_rows(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                            uint16_t *y, int64_t ys) {
    (void)x, (void)M, (void)xs, (void)K, (void)tiles, (void)N, (void)y, (void)ys;
    return -3;
}

int epdmesh_amx_gemm(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                     uint16_t *y, int64_t ys, void *scratch, int64_t scratch_bytes, int flags) {
    (void)x, (void)M, (void)xs, (void)K, (void)tiles, (void)N, (void)y, (void)ys, (void)scratch, (void)scratch_bytes;
    (void)flags;
    return -3;
}

int epdmesh_amx_qkv_rope(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                         const void *ro, int64_t num_blocks, int64_t block_size, void *scratch,
                         int64_t scratch_bytes) {
    (void)x, (void)M, (void)xs, (void)K, (void)tiles, (void)N, (void)ro, (void)num_blocks, (void)block_size;
    (void)scratch, (void)scratch_bytes;
    return -3;
}

int epdmesh_swiglu(const uint16_t *gu, int64_t M, int64_t gs, int64_t N, uint16_t *y, int64_t ys) {
    (void)gu, (void)M, (void)gs, (void)N, (void)y, (void)ys;
    return -3;
}
#endif

/* ---- hosts with AVX512-BF16 and no AMX (the EPYCs): a decode step's products on the vector units ----
 * The same packed weights (`tiles`: per 16 columns, K in pairs, each pair of the 16 columns one 64-byte line), read
 * once a step: per pair of k, one line of weights for each of four column blocks and one broadcast of each row's
 * pair of x, VDPBF16PS into fp32 sums (four rows × four blocks, sixteen registers), K in order, rounded once. oneDNN's
 * product reads its packed layout at 15–20 GB/s here where the host streams ~30 (a Zen 4, 2026-12-07); its sums
 * are these, bit for bit, up to 8 rows (beyond, oneDNN blocks K otherwise at some shapes: a rare last-bit step;
 * tests). -3: not compiled for AVX512-BF16; -1: a shape it does not take. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define VB 4 /* column blocks of 16 a pass */
#define VR 4 /* rows a pass */
/* One pass: rows [m0, m0 + mr) × column blocks [b0, b0 + nb) over every pair of k. Inlined with constant nb and mr
 * for a whole pass (the compiler unrolls it), with the counts left over for the last blocks of N or the last rows. */
static inline __attribute__((always_inline)) void vec_pass(const uint16_t *x, int64_t xs, int64_t K,
                                                           const uint16_t *w, uint16_t *y, int64_t ys, int64_t m0,
                                                           int64_t b0, const int nb, const int mr) {
    __m512 acc[VR][VB];
    for (int i = 0; i < VR; ++i)
        for (int j = 0; j < VB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; ++p) {
        __m512bh wv[VB];
        for (int j = 0; j < nb; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * 16 * K + p * 32);
        for (int i = 0; i < mr; ++i) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + (m0 + i) * xs + 2 * p));
            for (int j = 0; j < nb; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nb; ++j) store_bf16_16(y + (m0 + i) * ys + (b0 + j) * 16, acc[i][j]);
}

int epdmesh_vec_linear(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                       uint16_t *y, int64_t ys) {
    if (M < 1 || N % 16 || K % 32) return -1;
    const int64_t blocks = N / 16, groups = (blocks + VB - 1) / VB;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t b0 = g * VB;
        const int nb = blocks - b0 < VB ? (int)(blocks - b0) : VB;
        const uint16_t *w = tiles + b0 * 16 * K;
        for (int64_t m0 = 0; m0 < M; m0 += VR) {
            const int mr = M - m0 < VR ? (int)(M - m0) : VR;
            if (nb == VB && mr == VR)
                vec_pass(x, xs, K, w, y, ys, m0, b0, VB, VR);
            else
                vec_pass(x, xs, K, w, y, ys, m0, b0, nb, mr);
        }
    }
    return 0;
}
#else
int epdmesh_vec_linear(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                       uint16_t *y, int64_t ys) {
    (void)x, (void)M, (void)xs, (void)K, (void)tiles, (void)N, (void)y, (void)ys;
    return -3;
}
#endif
