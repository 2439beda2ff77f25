#pragma once
// AMX bf16 tiles over k-pair panels, shared by the bf16 GEMM and the int8 one's widened panels.
//
// tdpbf16ps multiplies a tile of 16 rows x 32 k (A) by one of 16 k pairs x 16 columns in k-pair layout (B) into
// 16 x 16 fp32 (C). A panel's [K/2, 32, 2] rows are two B tiles side by side (columns 0-15, 16-31, 128 bytes
// apart), so the AVX512-BF16 kernels' panels serve as they are. Tiles: C 0-3 (two row groups x two column halves),
// A 4-5, B 6-7. Each output is summed in k order, 32 k a step, whatever tile its row lands in.
#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>

namespace ps {

constexpr int64_t kAmxK = 32, kAmxR = 16, kAmxN = 32;

// Every tile 16 rows of 64 bytes; fewer than 16 rows in all (decode) get short A and C tiles, whose multiplies take
// fewer cycles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t M) {
    for (int t = 0; t < 8; ++t) { rows[t] = kAmxR; colsb[t] = 64; }
    if (M < kAmxR) rows[0] = rows[1] = rows[4] = uint8_t(M);
  }
};

// Rows per block of a GEMM on AMX (bf16 activations): 256, or 128 where that makes a block's activations fit in
// 1.5 MiB of a 2 MiB L2 (each panel is then read twice as often; where even 128 rows do not fit, fewer rows only cost
// more panel reads).
inline int64_t amx_block_rows(int64_t K) {
  const int64_t fit = (int64_t(3) << 19) / (K * int64_t(sizeof(bf16_t)));
  return fit < 256 && fit >= 128 ? 128 : 256;
}

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per
// process; refused where the CPU or kernel lacks it.
inline bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Rows of x a tile reads: rows below `direct` in place, the others from a zero-padded copy of K rounded up to
// whole k steps (tiles read 16 rows of 32 k; where K is a whole number of k steps only the last partial group is
// copied, and nothing where there are fewer than 16 rows: their tiles are configured that short).
struct TileRows {
  const bf16_t* x;
  int64_t ldx, direct, Kp;
  std::vector<bf16_t> pad;
  TileRows(const bf16_t* x_, int64_t ldx_, int64_t M, int64_t K) : x(x_), ldx(ldx_) {
    Kp = (K + kAmxK - 1) / kAmxK * kAmxK;
    direct = K == Kp ? (M < kAmxR ? M : M / kAmxR * kAmxR) : 0;
    const int64_t Mp = (M + kAmxR - 1) / kAmxR * kAmxR;
    pad.assign((Mp - direct) * Kp, 0);
    for (int64_t m = direct; m < M; ++m) std::memcpy(&pad[(m - direct) * Kp], x + m * ldx, K * sizeof(bf16_t));
  }
  const bf16_t* row(int64_t m) const { return m < direct ? x + m * ldx : &pad[(m - direct) * Kp]; }
  int64_t stride(int64_t m) const { return (m < direct ? ldx : Kp) * int64_t(sizeof(bf16_t)); }
};

// One panel [K/2, 32, 2] as B tiles: k steps of 16 pairs in place, the last one (where K is not whole k steps)
// copied with zeros after it. amx_rows takes any type with its `steps` and `step(t)`.
struct PanelSteps {
  const bf16_t* p;
  int64_t steps, whole;
  alignas(64) bf16_t tail[kAmxR][2 * kAmxN];
  PanelSteps(const bf16_t* p_, int64_t K) : p(p_), steps((K + kAmxK - 1) / kAmxK), whole(K / kAmxK) {
    if (steps > whole) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, p + whole * kAmxR * 2 * kAmxN, (K - whole * kAmxK) * kAmxN * sizeof(bf16_t));
    }
  }
  const bf16_t* step(int64_t t) const { return t < whole ? p + t * kAmxR * 2 * kAmxN : &tail[0][0]; }
};

// c[r][0:32] = init + sum_k x[m + r][k] * panel[k][0:32] for the rows r < 32 that exist (m a multiple of 16; two A
// tiles where rows > 16), init a row of 32 fp32 (or null: zeros). pf: bytes to prefetch into L2 alongside (a
// panel's worth), or null. Needs the tile config loaded on this thread. Rows: TileRows, or any type with its
// `row(m)` and `stride(m)`.
template <typename Rows, typename Steps>
inline void amx_rows(const Rows& a, const Steps& b, int64_t m, int64_t rows, const float* init,
                     float (*c)[kAmxN], const bf16_t* pf) {
  const bool two = rows > kAmxR;
  if (init != nullptr) {
    _tile_loadd(0, init, 0); _tile_loadd(1, init + 16, 0);
    if (two) { _tile_loadd(2, init, 0); _tile_loadd(3, init + 16, 0); }
  } else {
    _tile_zero(0); _tile_zero(1);
    if (two) { _tile_zero(2); _tile_zero(3); }
  }
  const bf16_t* a0 = a.row(m);
  const bf16_t* a1 = two ? a.row(m + kAmxR) : nullptr;
  const int64_t s0 = a.stride(m), s1 = two ? a.stride(m + kAmxR) : 0, sb = 2 * kAmxN * sizeof(bf16_t);
  for (int64_t t = 0; t < b.steps; ++t) {
    if (pf != nullptr) {
      const char* q = reinterpret_cast<const char*>(pf + t * kAmxR * 2 * kAmxN);
      for (int64_t i = 0; i < kAmxR * sb; i += 64) _mm_prefetch(q + i, _MM_HINT_T1);
    }
    const bf16_t* w = b.step(t);
    _tile_loadd(6, w, sb);
    _tile_loadd(7, w + kAmxN, sb);
    _tile_loadd(4, a0 + t * kAmxK, s0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + t * kAmxK, s1);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t sc = kAmxN * sizeof(float);
  _tile_stored(0, &c[0][0], sc);
  _tile_stored(1, &c[0][16], sc);
  if (two) { _tile_stored(2, &c[kAmxR][0], sc); _tile_stored(3, &c[kAmxR][16], sc); }
}

}  // namespace ps
#endif
