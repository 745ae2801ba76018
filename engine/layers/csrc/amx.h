// What the AMX kernels share (amx_linear.cpp, attention.cpp): whether the compiler can build
// them, the tiles' configuration and the process's permission to use them.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HOTSWAP_AMX 1
#include <immintrin.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))

namespace hotswap {

// LDTILECFG's 64 bytes: palette 1, each tile's rows and bytes a row.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a thread the AMX tile state only once the process asks for it (oneDNN asks too;
// asking again is harmless); false where the CPU has no AMX.
bool amx_permitted();

}  // namespace hotswap
#endif
