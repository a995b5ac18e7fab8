// What the AMX paths of the native kernels share (matmul.cc: TDPBF16PS; qmatmul.cc: TDPBSUD): the tile
// configuration's layout, the process's grant of the tile state, and the switch that turns the AMX paths off.
// Included only where the compiler targets AMX-TILE (Intel Xeon from Sapphire Rapids on).
#ifndef JAXPAGED_CPU_NATIVE_AMX_H_
#define JAXPAGED_CPU_NATIVE_AMX_H_

#include <immintrin.h>
#include <sys/syscall.h>  // arch_prctl, to be granted AMX's tile state
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace jaxpaged_native {

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process AMX's tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA);
// asked once per library (asking again is harmless). False on an older kernel or a CPU without AMX (the build
// targets this CPU, so only the first).
inline bool AmxPermitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// JAXPAGED_NATIVE_AMX=0 keeps the AVX-512 paths (read on each call: benchmarks/matmul.py and
// benchmarks/quantization.py compare the two).
inline bool AmxWanted() {
  const char* v = std::getenv("JAXPAGED_NATIVE_AMX");
  return !(v && v[0] == '0' && v[1] == '\0') && AmxPermitted();
}

}  // namespace jaxpaged_native

#endif  // JAXPAGED_CPU_NATIVE_AMX_H_
