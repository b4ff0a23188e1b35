/* bf16 products of a few rows on Intel AMX: y [M, N] = x [M, K] · Wᵀ, for a decode step's linears.
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
 * does not target AMX, `epdmesh_amx_linear` returns -3.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_tiles.h"

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

#else
int epdmesh_amx_init(void) { return -3; }

int epdmesh_amx_linear(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *tiles, int64_t N,
                       uint16_t *y, int64_t ys) {
    (void)x, (void)M, (void)xs, (void)K, (void)tiles, (void)N, (void)y, (void)ys;
    return -3;
}
#endif
