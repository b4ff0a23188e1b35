/* What our AMX code shares (cpu_amx.c, cpu_prompt.c): the tile configuration's layout and Linux's grant of the
 * tiles' state. kernels/cbuild.py keys a build by it too. */
#ifndef EPDMESH_CPU_TILES_H
#define EPDMESH_CPU_TILES_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...);

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands a process the tiles' state only on request (oneDNN asks too; asking twice is harmless): 0 once it
 * has. */
static inline int tiles_request(void) {
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
}
#endif
#endif
