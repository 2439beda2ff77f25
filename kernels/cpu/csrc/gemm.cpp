// fp32 GEMM for CPU linears, y = x @ w.T (+ bias), on weights packed once into 16-column panels.
//
// A panel holds 16 output features as [K, 16], so a row tile reads its weights as one contiguous stream. On AVX2 a
// 6 x 16 register tile (12 accumulators of 8 lanes, AVX2's 16 registers) broadcasts six activations per step of k
// against two weight vectors. On AVX-512 a 12 x 32 tile spans two panels (24 accumulators of 16 lanes, of its 32
// registers): each broadcast activation serves two weight vectors, so the tile is bound by its FMAs, not by its
// loads (a one-panel 12 x 16 tile needed a load per FMA; a 6 x 64 tile over four panels was no faster). There the
// activations are first packed into [k, 12] tiles. Threads split the panels
// (in pairs on AVX-512); each walks its panels in order and, for each block of k (256, or 128 for a pair), runs
// every row tile of the block while that panel slice (16 KiB) sits in L1. Rows go in blocks of 192 so the
// activation slice stays in L2. On AVX2 CPUs it beats oneDNN's prepacked linear at decode batch sizes and matches it
// from 256 rows. Each output is summed in k order whatever tile its row lands in, so a row's result is bitwise the
// same in any batch.

#include "gemm.h"
#include "gemm_tile.h"

#include <array>
#include <type_traits>
#include <utility>
#include <vector>

namespace ps {

constexpr int64_t kMC = 192;

#ifdef __AVX512F__
constexpr int64_t kWMR = 12, kWNP = 2, kWKC = 128;

// The two-panel tile: y[r][i*16 : i*16 + ncols[i]] (+)= sum_k x[k][r] * p[i*K*16 + k*16 : +16] for rows r < MR and
// panels i < NP (NP 1 for an odd last panel), x a packed activation tile [kc, 12]. As gemm_tile, lane for lane: the
// same sums in the same order.
template <int MR, int NP>
inline void gemm_tile_wide(const float* x, const float* p, int64_t pstride, int64_t kc, float* y, int64_t ldy,
                           const int64_t* ncols, bool accumulate, const float* bias, const float* next) {
  f32x16 a[NP][MR];
  for (int i = 0; i < NP; ++i) {
    f32x16 b = {};
    if (bias != nullptr) {
      float t[kNR] = {};
      std::memcpy(t, bias + i * kNR, ncols[i] * sizeof(float));
      b = load16(t);
    }
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + i * kNR;
      if (!accumulate) { a[i][r] = b; continue; }
      if (ncols[i] == kNR) { a[i][r] = load16(yr); continue; }
      float t[kNR] = {};
      std::memcpy(t, yr, ncols[i] * sizeof(float));
      a[i][r] = load16(t);
    }
  }
  // Two copies of the loop, with and without the prefetch: a test of `next` in the loop cost a branch per k.
  // The prefetch goes to L2 (T1): into L1 it evicted the slice the other tiles of this block still read.
  const auto steps = [&](auto prefetch) {
    for (int64_t k = 0; k < kc; ++k) {
      f32x16 w[NP];
      for (int i = 0; i < NP; ++i) {
        if constexpr (decltype(prefetch)::value) __builtin_prefetch(next + i * pstride + k * kNR, 0, 2);
        w[i] = load16(p + i * pstride + k * kNR);
      }
#pragma GCC unroll 12
      for (int r = 0; r < MR; ++r) {
        const f32x16 xv = (f32x16)_mm512_set1_ps(x[k * kWMR + r]);  // one load-broadcast (0 + x cost an add)
        for (int i = 0; i < NP; ++i) a[i][r] += xv * w[i];
      }
    }
  };
  if (next != nullptr) steps(std::true_type{}); else steps(std::false_type{});
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + i * kNR;
      if (ncols[i] == kNR) { store16(yr, a[i][r]); continue; }
      float t[kNR];
      store16(t, a[i][r]);
      std::memcpy(yr, t, ncols[i] * sizeof(float));
    }
}

using WideTileFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, const int64_t*, bool,
                            const float*, const float*);
template <int NP, size_t... MR>
constexpr std::array<WideTileFn, sizeof...(MR) + 1> wide_tiles(std::index_sequence<MR...>) {
  return {nullptr, gemm_tile_wide<MR + 1, NP>...};
}
template <size_t... NP>
constexpr std::array<std::array<WideTileFn, kWMR + 1>, sizeof...(NP)> all_wide_tiles(std::index_sequence<NP...>) {
  return {wide_tiles<NP + 1>(std::make_index_sequence<kWMR>())...};
}
constexpr auto kWideTiles = all_wide_tiles(std::make_index_sequence<kWNP>());
#endif

// x [M, K] (rows may be strided), packed [P, K, 16], bias [N] or empty, out [M, N] contiguous.
void gemm_packed(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && out.dim() == 2 && packed.size(2) == kNR);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat &&
              out.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous() && out.is_contiguous());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), N = out.size(1);
  TORCH_CHECK(packed.size(1) == K && out.size(0) == M && N <= P * kNR && N > (P - 1) * kNR);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == torch::kFloat));
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
#ifdef __AVX512F__
  // Each block of rows is first packed as tiles [k block][row tile][kc][12], so a tile's broadcasts read one
  // contiguous stream at fixed offsets (from 12 strided rows, the compiler ran out of registers for their pointers).
  const int64_t groups = (P + kWNP - 1) / kWNP, kblocks = (K + kWKC - 1) / kWKC;
  thread_local std::vector<float> packed_x;
  for (int64_t m0 = 0; m0 < M; m0 += kMC) {
    const int64_t m1 = std::min(M, m0 + kMC), tiles = (m1 - m0 + kWMR - 1) / kWMR;
    packed_x.resize(kblocks * tiles * kWMR * kWKC);
    float* ax = packed_x.data();
    const auto tile_at = [&](int64_t kb, int64_t t) { return ax + (kb * tiles + t) * kWMR * kWKC; };
    parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t m = m0 + t * kWMR, mr = std::min(kWMR, m1 - m);
        for (int64_t kb = 0; kb < kblocks; ++kb) {
          const int64_t k0 = kb * kWKC, kc = std::min(kWKC, K - k0);
          float* dst = tile_at(kb, t);
          for (int64_t r = 0; r < mr; ++r) {
            const float* src = xp + (m + r) * ldx + k0;
            for (int64_t k = 0; k < kc; ++k) dst[k * kWMR + r] = src[k];
          }
        }
      }
    });
    parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t j = kWNP * g, np = std::min<int64_t>(kWNP, P - j), n0 = j * kNR;
        int64_t ncols[kWNP] = {};
        for (int64_t i = 0; i < np; ++i) ncols[i] = std::min(kNR, N - n0 - i * kNR);
        for (int64_t kb = 0; kb < kblocks; ++kb) {
          const int64_t k0 = kb * kWKC, kc = std::min(kWKC, K - k0);
          const float* p = pp + (j * K + k0) * kNR;
          const float* b = (k0 == 0 && bp != nullptr) ? bp + n0 : nullptr;
          // As below: the first tile of a shared slice fetches the next one (the next k block, else the next group).
          const float* next = k0 + kWKC < K ? p + kWKC * kNR : g + 1 < end ? pp + (j + kWNP) * K * kNR : nullptr;
          if (tiles == 1) next = nullptr;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t m = m0 + t * kWMR, mr = std::min(kWMR, m1 - m);
            kWideTiles[np - 1][mr](tile_at(kb, t), p, K * kNR, kc, yp + m * N + n0, N, ncols, k0 > 0, b,
                                   t == 0 ? next : nullptr);
          }
        }
      }
    });
  }
#else
  for (int64_t m0 = 0; m0 < M; m0 += kMC) {
    const int64_t m1 = std::min(M, m0 + kMC);
    parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const int64_t n0 = j * kNR, ncols = std::min(kNR, N - n0);
        for (int64_t k0 = 0; k0 < K; k0 += kKC) {
          const int64_t kc = std::min(kKC, K - k0);
          const float* p = pp + (j * K + k0) * kNR;
          const float* b = (k0 == 0 && bp != nullptr) ? bp + n0 : nullptr;
          // Where several tiles share this slice, the first also fetches the next one (the hardware prefetcher
          // stops at each 4 KiB page; the slice is 16 KiB): the next k block, else this thread's next panel.
          const float* next = k0 + kKC < K ? p + kKC * kNR : j + 1 < end ? pp + (j + 1) * K * kNR : nullptr;
          if (m1 - m0 <= kMR) next = nullptr;  // (a prefetch past the end of the tensor is harmless: never faults)
          for (int64_t m = m0; m < m1; m += kMR) {
            const int64_t mr = std::min(kMR, m1 - m);
            kTiles[mr](xp + m * ldx + k0, ldx, p, kc, yp + m * N + n0, N, ncols, k0 > 0, b, m == m0 ? next : nullptr);
          }
        }
      }
    });
  }
#endif
}

}  // namespace ps
