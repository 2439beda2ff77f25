// Random sampling of one token per row, fused: temperature, softmax, min-p, top-k / top-p and the inverse-CDF draw,
// one row per task on the kernels' pool.
//
// torch_ref.sample_rows is the definition: softmax(logits / t); min-p zeroes p < min_p * max p; top-k and top-p cut
// the tokens in order of p descending, ties by token id: a token stays while the mass of the kept tokens before it
// is below top_p times their total; the draw is the first token (in id order) whose cumulative kept mass exceeds u
// times the total, cumulated in fp64. Only candidates are ordered: top-k's k by a heap, top-p's by a radix sort of
// the tokens whose bit patterns hold the mass asked (where torch sorts all [B, V] probabilities: hundreds of ms a
// step at B = 128, V = 32k). Logits that are -inf (a grammar's or min_tokens' bans) or far below the row's max
// weigh exactly 0.

#include "sampling.h"

#include <algorithm>

namespace ps {
namespace {

constexpr float kUnderflow = -87.f;  // exp16v's floor: below it a token weighs 0

// ids sorted by p descending, ties by id ascending: a stable LSD radix sort of the ids (given ascending) on the
// complement of p's bits (positive floats order as their bits).
void sort_by_p(const float* p, std::vector<int32_t>& ids, std::vector<int32_t>& tmp) {
  constexpr int kBits = 11, kBuckets = 1 << kBits;
  tmp.resize(ids.size());
  auto key = [p](int32_t i) { uint32_t b; std::memcpy(&b, &p[i], 4); return ~b; };
  for (int shift = 0; shift < 32; shift += kBits) {
    int64_t count[kBuckets + 1] = {};
    for (int32_t i : ids) ++count[((key(i) >> shift) & (kBuckets - 1)) + 1];
    for (int b = 0; b < kBuckets; ++b) count[b + 1] += count[b];
    for (int32_t i : ids) tmp[count[(key(i) >> shift) & (kBuckets - 1)]++] = i;
    ids.swap(tmp);
  }
}

// Tokens holding at least top_p of the mass of p, by p's bits above the 19th (its exponent and 4 mantissa bits):
// all of the highest patterns down to the one where the mass reaches 1.001 x top_p of the total, and one more (the
// caller falls back to every token where fp32 rounding still falls short).
void top_p_candidates(const float* p, int64_t V, float top_p, std::vector<int32_t>& ids) {
  constexpr int kShift = 19, kBuckets = 1 << (31 - kShift);
  thread_local std::vector<double> mass;
  mass.assign(kBuckets, 0.0);
  double total = 0.0;
  for (int64_t t = 0; t < V; ++t) {
    uint32_t bits; std::memcpy(&bits, &p[t], 4);
    mass[bits >> kShift] += p[t];
    total += p[t];
  }
  const double want = std::min(total, 1.001 * double(top_p) * total);
  double acc = 0.0;
  int b = kBuckets - 1;
  for (; b > 0 && acc < want; --b) acc += mass[b];
  const uint32_t floor = uint32_t(std::max(b, 1)) << kShift;  // p = +0 (bits 0) is never a candidate
  for (int64_t t = 0; t < V; ++t) {
    uint32_t bits; std::memcpy(&bits, &p[t], 4);
    if (bits >= floor) ids.push_back(int32_t(t));
  }
}

// The drawn token of one row (`greedy` where no token has weight: every logit -inf or NaN); p: a scratch row of V
// floats.
int64_t sample_row(const float* x, int64_t V, float temp, int64_t top_k, float top_p, float min_p, double u,
                   int64_t greedy, float* p, std::vector<int32_t>& ids, std::vector<int32_t>& tmp) {
  // Softmax of x / temp, as torch: exp(v - max), then times 1 / sum. max(x / temp) = max(x) / temp: dividing by a
  // positive number keeps the order, rounding included.
  f32x16 max16 = f32x16{} - INFINITY;
  int64_t t = 0;
  for (; t + 16 <= V; t += 16) {
    const f32x16 v = load16(x + t);
    max16 = v > max16 ? v : max16;
  }
  float m = -INFINITY;
  for (int i = 0; i < 16; ++i) m = std::max(m, max16[i]);
  for (; t < V; ++t) m = std::max(m, x[t]);
  if (!(m > -INFINITY)) return greedy;
  m /= temp;
  f32x16 sum16 = {};
  t = 0;
  for (; t + 16 <= V; t += 16) {
    const f32x16 d = load16(x + t) / temp - m;
    const f32x16 e = d >= kUnderflow ? exp16v(d) : f32x16{};
    store16(p + t, e);
    sum16 += e;
  }
  float sum = hsum16(sum16);
  for (; t < V; ++t) {
    const float d = x[t] / temp - m;
    p[t] = d >= kUnderflow ? std::exp(d) : 0.f;
    sum += p[t];
  }
  if (!(sum > 0.f) || !std::isfinite(sum)) return greedy;
  const float inv = 1.f / sum;
  f32x16 pmax16 = {};
  for (t = 0; t + 16 <= V; t += 16) {
    const f32x16 v = load16(p + t) * inv;
    store16(p + t, v);
    pmax16 = v > pmax16 ? v : pmax16;
  }
  float pmax = 0.f;
  for (int i = 0; i < 16; ++i) pmax = std::max(pmax, pmax16[i]);
  for (; t < V; ++t) pmax = std::max(pmax, p[t] *= inv);
  if (min_p > 0.f) {
    const float floor = min_p * pmax;
    for (t = 0; t + 16 <= V; t += 16) {
      const f32x16 v = load16(p + t);
      store16(p + t, v < floor ? f32x16{} : v);
    }
    for (; t < V; ++t) if (p[t] < floor) p[t] = 0.f;
  }
  const bool cut_k = top_k > 0 && top_k < V, cut_p = top_p < 1.f;
  if (cut_k || cut_p) {
    auto before = [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
    ids.clear();
    if (cut_k) {  // the k first: a heap of the best so far with the worst on top, then sorted
      for (t = 0; t < V; ++t) {
        if (p[t] <= 0.f) continue;
        if (int64_t(ids.size()) < top_k) {
          ids.push_back(int32_t(t));
          std::push_heap(ids.begin(), ids.end(), before);
        } else if (before(int32_t(t), ids.front())) {
          std::pop_heap(ids.begin(), ids.end(), before);
          ids.back() = int32_t(t);
          std::push_heap(ids.begin(), ids.end(), before);
        }
      }
      std::sort_heap(ids.begin(), ids.end(), before);
    } else {  // every candidate that top-p may need: those of p's top bit patterns holding the mass asked
      top_p_candidates(p, V, top_p, ids);
      sort_by_p(p, ids, tmp);
    }
    size_t keep = ids.size();
    if (cut_p) {
      float total = 0.f;
      if (cut_k) for (int32_t i : ids) total += p[i];
      else for (t = 0; t < V; ++t) total += p[t];
      const float limit = top_p * total;
      // How many of ids (in order) top-p keeps, and whether their mass reached the limit.
      auto kept = [&](size_t n, bool* reached) {
        float mass = 0.f;
        size_t i = 0;
        for (; i < n && mass < limit; ++i) mass += p[ids[i]];
        *reached = mass >= limit;
        return i;
      };
      bool reached = false;
      keep = kept(keep, &reached);
      if (!reached && !cut_k && keep > 0) {  // fp32 rounding fell short of the candidates: every token with mass
        ids.clear();
        for (t = 0; t < V; ++t) if (p[t] > 0.f) ids.push_back(int32_t(t));
        sort_by_p(p, ids, tmp);
        keep = kept(ids.size(), &reached);
      }
    }
    // Every token after the last one kept (in the order above) weighs 0.
    const int32_t last_kept = keep > 0 ? ids[keep - 1] : -1;
    for (t = 0; t < V; ++t)
      if (p[t] > 0.f && (last_kept < 0 || before(last_kept, int32_t(t)))) p[t] = 0.f;
  }
  // The draw: the first token whose fp64 cumulative mass exceeds u x total, found by 16-token blocks' sums (the
  // sums' order differs from one running sum only by fp64 rounding).
  thread_local std::vector<double> block;
  const int64_t nb = (V + 15) / 16;
  block.resize(nb);
  double total = 0.0;
  typedef double f64x8 __attribute__((vector_size(64)));
  for (int64_t b = 0; b < nb; ++b) {
    double s = 0.0;
    if (b * 16 + 16 <= V) {
      const f32x8 lo = load8(p + b * 16), hi = load8(p + b * 16 + 8);
      const f64x8 v = __builtin_convertvector(lo, f64x8) + __builtin_convertvector(hi, f64x8);
      s = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    } else {
      for (int64_t i = b * 16; i < V; ++i) s += p[i];
    }
    block[b] = s;
    total += s;
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t b = 0;
  for (; b < nb - 1 && acc + block[b] <= target; ++b) acc += block[b];
  int64_t last = -1;
  for (t = b * 16; t < V; ++t) {
    if (p[t] <= 0.f) continue;
    last = t;
    acc += p[t];
    if (acc > target) return t;
  }
  if (last >= 0) return last;  // rounding left the target at the total: the last token with mass
  for (t = V - 1; t > 0 && p[t] <= 0.f; --t) {}
  return t;
}

}  // namespace

void sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                 torch::Tensor min_p, torch::Tensor uniform, torch::Tensor greedy, torch::Tensor out) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1);
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "sample_rows: rows of 1 to 2^31 - 1 values");
  auto check = [B](const torch::Tensor& x, c10::ScalarType dtype, bool optional) {
    TORCH_CHECK((optional && x.numel() == 0) ||
                (x.dim() == 1 && x.size(0) == B && x.is_contiguous() && x.scalar_type() == dtype));
  };
  check(temperature, torch::kFloat, false);
  check(top_k, torch::kLong, true);
  check(top_p, torch::kFloat, true);
  check(min_p, torch::kFloat, true);
  check(uniform, torch::kDouble, false);
  check(greedy, torch::kLong, false);
  check(out, torch::kLong, false);
  const float* xp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* kp = top_k.numel() ? top_k.data_ptr<int64_t>() : nullptr;
  const float* pp = top_p.numel() ? top_p.data_ptr<float>() : nullptr;
  const float* mp = min_p.numel() ? min_p.data_ptr<float>() : nullptr;
  const double* up = uniform.data_ptr<double>();
  const int64_t* gp = greedy.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t xs = logits.stride(0);
  parallel_for(0, B, 1, [=](int64_t begin, int64_t end) {
    thread_local std::vector<float> p;
    thread_local std::vector<int32_t> ids, tmp;
    p.resize(V);
    for (int64_t r = begin; r < end; ++r)
      op[r] = tp[r] > 0.f ? sample_row(xp + r * xs, V, tp[r], kp ? kp[r] : 0, pp ? pp[r] : 1.f, mp ? mp[r] : 0.f,
                                       up[r], gp[r], p.data(), ids, tmp)
                          : gp[r];
  });
}

}  // namespace ps
