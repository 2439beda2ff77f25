#pragma once
// bf16 GEMM on AVX512-BF16 or AMX tiles, on weights packed into k-pair panels of 32 columns.
#include "amx.h"
#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ps {

// x [M, K] bf16 (rows may be strided), packed [P, K/2, 32, 2] bf16, bias [N] bf16 or empty, out [M, N] bf16 or
// fp32, contiguous; on AMX tiles where gemm_bf16_amx() and use_amx. Raises where built without AVX512-BF16.
void gemm_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out, bool use_amx = true);
// Whether this build has the AVX512-BF16 kernel.
bool gemm_bf16_built();
// Whether gemm_bf16 runs on AMX tiles (built with them, and the kernel granted this process the tile state).
bool gemm_bf16_amx();

// Runs unit(m0, m1, j, next) over every (block of rows [m0, m1), panel j) of a GEMM on the pool's threads: blocks of
// rows first (a block's activations stay in L2 while its panels run), near-equal blocks of whole `granule`s of rows
// (so that units cost alike for the chunking), at most `block` rows each. next: the panel this thread runs next
// (to prefetch while j runs), or -1. begin() and end() run once on each thread that works.
template <typename Unit, typename Begin, typename End>
void run_units(int64_t M, int64_t P, int64_t granule, int64_t block, Unit unit, Begin begin, End end) {
  const int64_t blocks = (M + block - 1) / block, mb = ((M + blocks - 1) / blocks + granule - 1) / granule * granule;
  const int64_t units = (M + mb - 1) / mb * P, threads = std::min<int64_t>(kernel_threads(), units);
  ChunkQueue queue(units, threads);
  run_parallel(threads, [&] {
    begin();
    for (auto cur = queue.claim(); cur.first < units;) {
      // The next chunk is claimed now, so that its first panel can stream in while this chunk's last one runs.
      const auto next = queue.claim();
      for (int64_t u = cur.first; u < cur.second; ++u) {
        const int64_t v = u + 1 < cur.second ? u + 1 : next.first;
        unit(u / P * mb, std::min(M, u / P * mb + mb), u % P, v < units ? v % P : int64_t(-1));
      }
      cur = next;
    }
    end();
  });
}

// What row tile t of `tiles` over a panel prefetches of the thread's next panel (pf, lines_all cache lines; or null):
// an equal share each, so that the memory streams while every tile runs (with the first tile fetching it all, a
// second one, running from L2, left the memory idle).
struct PrefetchShare {
  const bf16_t* from;
  int64_t lines;
  PrefetchShare(const void* pf, int64_t lines_all, int64_t t, int64_t tiles)
      : from(pf == nullptr
                 ? nullptr
                 : reinterpret_cast<const bf16_t*>(static_cast<const char*>(pf) + t * lines_all / tiles * 64)),
        lines((t + 1) * lines_all / tiles - t * lines_all / tiles) {}
};

// `lines` cache lines from `from` (or none: null) prefetched into L2 evenly over a loop of `steps` iterations:
// step() once an iteration (a PrefetchShare's lines over a tile's k loop).
struct SpreadPrefetch {
  const char* next;
  int64_t lines, steps, due = 0;
  SpreadPrefetch(const void* from, int64_t lines, int64_t steps)
      : next(static_cast<const char*>(from)), lines(from == nullptr ? 0 : lines), steps(steps) {}
  inline void step() {
    for (due += lines; due >= steps; due -= steps, next += 64) __builtin_prefetch(next, 0, 2);  // prefetcht1
  }
};

// Rows of a block in tiles of mr, a remainder above mr split into two near-equal tiles (13 rows of 12: 7 + 6, not
// 12 + 1: a one-row tile runs on two dependency chains, latency-bound).
inline int64_t next_rows(int64_t left, int64_t mr) {
  if (left <= mr) return left;
  if (left < 2 * mr) return (left + 1) / 2;
  return mr;
}

// Runs tile(m, rows, share) over the row tiles of [m0, m1) (next_rows of mr), each with its PrefetchShare of the
// thread's next panel (pf, lines_all cache lines; or null).
template <typename Tile>
void row_tiles(int64_t m0, int64_t m1, int64_t mr, const void* pf, int64_t lines_all, Tile tile) {
  int64_t tiles = 0;
  for (int64_t m = m0; m < m1; m += next_rows(m1 - m, mr)) ++tiles;
  for (int64_t m = m0, t = 0; m < m1; ++t) {
    const int64_t rows = next_rows(m1 - m, mr);
    tile(m, rows, PrefetchShare(pf, lines_all, t, tiles));
    m += rows;
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The k loop of a vdpbf16ps row tile: a0[r], a1[r] (columns 0-15, 16-31) += the dot products of row r < MR of x
// (bf16, rows ldx apart) with a 32-column panel in k-pair layout [K2][32][2], k pair by k pair; with Prefetch,
// pf_lines cache lines from pf into L2 alongside, spread evenly over the k loop. Row r is read at
// base[r / 5] + (r % 5) x ldx, offsets an x86 address forms from two strides (ldx, 3 ldx): 12 rows take 3 base
// registers, not 12 row pointers, which outnumbered the general registers, so the compiler kept some in vector
// registers and moved them back every k pair.
template <int MR, bool Prefetch>
inline void dp_accumulate_rows(__m512* a0, __m512* a1, const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t K2,
                               const bf16_t* pf, int64_t pf_lines) {
  constexpr int NB = (MR + 4) / 5;
  const int64_t ld = ldx * int64_t(sizeof(bf16_t)), ld3 = 3 * ld;
  const char* base[NB];
  for (int i = 0; i < NB; ++i) base[i] = reinterpret_cast<const char*>(x) + 5 * i * ld;
  const char* wp = reinterpret_cast<const char*>(w);
  SpreadPrefetch spread(pf, pf_lines, K2);
  for (int64_t kk = 0; kk < K2; ++kk) {
    if constexpr (Prefetch) spread.step();
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 64);
    wp += 128;
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const char* b = base[r / 5];
      const int o = r % 5;
      const char* row = o == 0 ? b : o == 1 ? b + ld : o == 2 ? b + 2 * ld : o == 3 ? b + ld3 : b + 4 * ld;
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(row));
      a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);
    }
    for (int i = 0; i < NB; ++i) base[i] += 4;
  }
}

// Shared by the bf16 GEMM and the int8 one's widened panels; pf null: no prefetch.
template <int MR>
inline void dp_accumulate(__m512* a0, __m512* a1, const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t K2,
                          const bf16_t* pf, int64_t pf_lines) {
  if (pf != nullptr) dp_accumulate_rows<MR, true>(a0, a1, x, ldx, w, K2, pf, pf_lines);
  else dp_accumulate_rows<MR, false>(a0, a1, x, ldx, w, K2, nullptr, 0);
}
#endif

}  // namespace ps
