/* The row dtypes the plugin's C kernels take, and bf16 <-> fp32 as torch converts
 * (cpu_build.py hashes this header into every kernel's build key). */

#ifndef DEEPINFER_BF16_H
#define DEEPINFER_BF16_H

#include <stdint.h>
#include <string.h>

/* A row dtype as the Python side passes it (kernels/cpu_build.py: ROW_DTYPES). */
enum dtype { F32 = 0, BF16 = 1 };

/* The fp32 value of bf16 bits (exact). */
static inline float from_bf16(uint16_t bits) {
    uint32_t w = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* bf16 bits of f, rounded to nearest even as torch rounds; a NaN stays a NaN (0x7FC0, as
 * torch's scalar conversion writes it; its AVX2 path writes 0xFFFF). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded; /* a select: loops
                                                                            vectorize */
}

#endif
