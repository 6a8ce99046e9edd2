// Intel AMX tiles for the native kernels that use them (cpu_w8a8_amx.cpp, cpu_kquants_a8_amx.cpp):
// whether this build and CPU have them, and the tile configuration a kernel loads before its first
// tile instruction. KILN_AMX is defined where the compiler has the AMX intrinsics (GCC 11 / clang 12)
// in an AVX-512 build on x86-64 Linux; elsewhere the library is built without the AMX kernels and
// amx_int8_usable() is false.
#pragma once

#include <cstdint>

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define KILN_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kiln_cpu {

// AMX-TILE and AMX-INT8 on this CPU, and the kernel hands this process the tile state (Linux gives it
// only once asked: ARCH_REQ_XCOMP_PERM, XTILEDATA). Asked once per process.
inline bool amx_int8_usable() {
#ifdef KILN_AMX
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

#ifdef KILN_AMX

// The 64-byte operand of LDTILECFG (palette 1): each tile register's rows and bytes a row
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& config) {
  // GCC 12 does not see _tile_loadconfig read its operand and drops the stores that filled it: keep them
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

#endif  // KILN_AMX

}  // namespace kiln_cpu
