// The plan of the drivers' kernel calls (plan.h), and its cache.
#include "views/plan.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

namespace dilated_attention {
namespace views {

namespace {

// The longest runs [i, j) of vals whose consecutive differences are equal.
std::vector<std::pair<int64_t, int64_t>> runs(const std::vector<int64_t>& vals) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t n = (int64_t)vals.size();
  int64_t i = 0;
  while (i < n) {
    int64_t j = i + 1;
    if (j < n) {
      const int64_t d = vals[j] - vals[i];
      while (j < n && vals[j] - vals[j - 1] == d) ++j;
    }
    out.emplace_back(i, j);
    i = j;
  }
  return out;
}

// The step of an evenly stepping list (1 for a single value).
int64_t step(const std::vector<int64_t>& vals) {
  return vals.size() > 1 ? vals[1] - vals[0] : 1;
}

// The number of positions o, o + r, ... below L.
int64_t count_from(int64_t o, int64_t L, int64_t r) {
  return o < L ? (L - o + r - 1) / r : 0;
}

// r < Hq: one call per phase o (heads o::r), split where the key/value heads do not step evenly.
void phase_calls(const Part& part, int64_t r, int64_t Hq, int64_t G, bool native_gqa,
                 std::vector<Call>* calls) {
  for (int64_t o = 0; o < r; ++o) {
    const int64_t m = count_from(o, part.length, r);
    std::vector<int64_t> qh, kvh;
    for (int64_t h = o; h < Hq; h += r) qh.push_back(h);
    if (m == 0 || qh.empty()) continue;
    for (int64_t h : qh) kvh.push_back(h / G);
    const std::set<int64_t> uset(kvh.begin(), kvh.end());
    const std::vector<int64_t> uniq(uset.begin(), uset.end());
    const int64_t nq = (int64_t)qh.size(), nu = (int64_t)uniq.size();
    const int64_t g = nq / nu;
    bool grouped = native_gqa && g > 1 && nq == g * nu && runs(uniq).size() == 1;
    for (int64_t j = 0; grouped && j < nq; ++j) grouped = kvh[j] == uniq[j / g];
    if (grouped) {
      calls->push_back({part, r, m, {o, 0, o, r, nq}, {o, 0, uniq[0], step(uniq), nu}, g});
      continue;
    }
    for (const auto& ij : runs(kvh)) {
      const int64_t i = ij.first, n = ij.second - ij.first;
      const std::vector<int64_t> sub(kvh.begin() + i, kvh.begin() + ij.second);
      Strided kv{o, 0, sub[0], step(sub), n};
      if (n > 1 && sub[1] == sub[0]) {
        kv = Strided{o, 0, sub[0], 0, n};
        if (native_gqa) {  // one key/value head read by every query head of the run
          calls->push_back({part, r, m, {o, 0, qh[i], r, n}, {o, 0, sub[0], 1, 1}, n});
          continue;
        }
      }
      calls->push_back({part, r, m, {o, 0, qh[i], r, n}, kv, 1});
    }
  }
}

// Head h reads phase h mod r: heads i, i + G, ... (key/value heads 0, 1, ...: no grouped-query
// attention in the kernel) in one call, split where the phase wraps or a head's number of rows
// changes.
void diagonal_calls(const Part& part, int64_t r, int64_t Hq, int64_t G, std::vector<Call>* calls) {
  for (int64_t i = 0; i < G; ++i) {
    std::vector<int64_t> heads, ms;
    for (int64_t h = i; h < Hq; h += G) {
      const int64_t m = count_from(h % r, part.length, r);
      if (m > 0) {
        heads.push_back(h);
        ms.push_back(m);
      }
    }
    const int64_t nh = (int64_t)heads.size();
    int64_t a = 0;
    while (a < nh) {
      int64_t b = a + 1;
      while (b < nh && ms[b] == ms[a] && heads[b] == heads[b - 1] + G && heads[b] % r == heads[b - 1] % r + G)
        ++b;
      const int64_t n = b - a, h0 = heads[a], o = h0 % r;
      calls->push_back({part, r, ms[a], {o, G, h0, G, n}, {o, G, h0 / G, 1, n}, 1});
      a = b;
    }
  }
}

// The parts of a branch of segment length w: per sequence of n > 0 positions, its n / L segments
// of L = min(w, n) positions, and its shorter last segment when n % L != 0.
std::vector<Part> parts_of(at::IntArrayRef lengths, int64_t w) {
  std::vector<Part> parts;
  int64_t start = 0;
  for (const int64_t n : lengths) {
    if (n > 0) {
      const int64_t L = std::min(w, n), full = n / L;
      parts.push_back({start, full, L});
      if (n - full * L) parts.push_back({start + full * L, 1, n - full * L});
    }
    start += n;
  }
  return parts;
}

// The calls of branch (w, r) for Hq query and Hkv key/value heads.
std::vector<Call> branch_calls(at::IntArrayRef lengths, int64_t w, int64_t r, int64_t Hq, int64_t Hkv,
                               bool native_gqa) {
  const int64_t G = Hq / Hkv;
  std::vector<Call> calls;
  for (const Part& part : parts_of(lengths, w)) {
    // r >= Hq: every head its own phase, the heads in G calls or so (a call per phase would
    // take one head); r < Hq: a call per phase, or the heads along their phases where that
    // takes fewer calls (r = 8 and 12 heads: 2 calls, not 8)
    std::vector<Call> phases, diagonal;
    if (Hq > 1) diagonal_calls(part, r, Hq, G, &diagonal);
    if (Hq == 1 || r < Hq) phase_calls(part, r, Hq, G, native_gqa, &phases);
    const bool diag = Hq > 1 && (r >= Hq || diagonal.size() < phases.size());
    const std::vector<Call>& chosen = diag ? diagonal : phases;
    calls.insert(calls.end(), chosen.begin(), chosen.end());
  }
  return calls;
}

// What a branch's calls cost a driver: its driver calls for one batch entry, and how many of them
// gather their rows (a copy each of q, k and v, and a launch).
std::pair<size_t, int64_t> driver_cost(const std::vector<Call>& calls, int64_t N) {
  const std::vector<DriverCall> made = driver_calls(calls, 1, N);
  int64_t gathered = 0;
  for (const DriverCall& d : made) gathered += d.gathers(1);
  return {made.size(), gathered};
}

// The plan, computed (plan_branches caches it). With repeat_kv a branch of grouped-query heads is
// planned for k and v repeated to Hq heads (Hkv = Hq) where that makes fewer driver calls, or as
// many and fewer of them gathered; and, once some branch reads the repeated k and v (the driver
// then makes them anyway), every branch where that costs no more: its calls then need no repeat of
// their own (on CUDA, a move a run).
std::shared_ptr<const Plan> make_plan(at::IntArrayRef lengths, int64_t Hq, int64_t Hkv,
                                      at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                                      bool native_gqa, bool repeat_kv) {
  auto plan = std::make_shared<Plan>();
  int64_t N = 0;
  for (const int64_t n : lengths) N += n;
  std::vector<std::vector<Call>> each;  // per branch, its plan on repeated k and v
  std::vector<bool> ties;               // per branch, whether that plan costs as much as its own
  for (size_t b = 0; b < segment_lengths.size(); ++b) {
    const int64_t w = segment_lengths[b], r = dilation_rates[b];
    plan->branches.push_back(branch_calls(lengths, w, r, Hq, Hkv, native_gqa));
    plan->repeated.push_back(false);
    if (!repeat_kv || Hkv == Hq) continue;
    each.push_back(branch_calls(lengths, w, r, Hq, Hq, native_gqa));
    const auto own = driver_cost(plan->branches[b], N), repeated = driver_cost(each[b], N);
    plan->repeated[b] = repeated < own;
    ties.push_back(repeated == own);
  }
  const bool made = plan->any_repeated();
  for (size_t b = 0; b < each.size(); ++b)
    if (plan->repeated[b] || (made && ties[b])) {
      plan->repeated[b] = true;
      plan->branches[b] = std::move(each[b]);
    }
  return plan;
}

// Every argument the plan's rule needs, or c10::ValueError naming the one that is not.
void check_plan_arguments(at::IntArrayRef lengths, int64_t Hq, int64_t Hkv, at::IntArrayRef segment_lengths,
                          at::IntArrayRef dilation_rates) {
  for (size_t i = 0; i < lengths.size(); ++i)
    TORCH_CHECK_VALUE(lengths[i] >= 0, "dilated_attention plan: sequence lengths must be >= 0, got lengths[",
                      i, "] = ", lengths[i]);
  TORCH_CHECK_VALUE(Hq >= 1 && Hkv >= 1 && Hq % Hkv == 0,
                    "dilated_attention plan: Hq must be a positive multiple of Hkv >= 1, got Hq = ", Hq,
                    ", Hkv = ", Hkv);
  TORCH_CHECK_VALUE(segment_lengths.size() == dilation_rates.size(),
                    "dilated_attention plan: segment_lengths and dilation_rates must have one entry per "
                    "branch, got ",
                    segment_lengths, " and ", dilation_rates);
  for (size_t b = 0; b < segment_lengths.size(); ++b)
    TORCH_CHECK_VALUE(segment_lengths[b] >= 1 && dilation_rates[b] >= 1, "dilated_attention plan: branch ", b,
                      " must have w >= 1 and r >= 1, got w = ", segment_lengths[b],
                      ", r = ", dilation_rates[b]);
}

// The cache: plans per key, and its counts (under lock).
constexpr int64_t kMaxPlans = 256;  // a bounded cache: geometries rarely change
struct Cache {
  std::mutex lock;
  std::map<std::vector<int64_t>, std::shared_ptr<const Plan>> plans;
  int64_t hits = 0, misses = 0;
};

Cache& cache() {
  static Cache c;
  return c;
}

}  // namespace

std::shared_ptr<const Plan> plan_branches(at::IntArrayRef lengths, int64_t Hq, int64_t Hkv,
                                          at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                                          bool native_gqa, bool repeat_kv) {
  check_plan_arguments(lengths, Hq, Hkv, segment_lengths, dilation_rates);
  repeat_kv = repeat_kv && Hkv < Hq;  // nothing to repeat: the plan every driver shares
  std::vector<int64_t> key = {Hq,
                              Hkv,
                              (int64_t)native_gqa,
                              (int64_t)repeat_kv,
                              (int64_t)segment_lengths.size(),
                              (int64_t)lengths.size()};
  key.insert(key.end(), segment_lengths.begin(), segment_lengths.end());
  key.insert(key.end(), dilation_rates.begin(), dilation_rates.end());
  key.insert(key.end(), lengths.begin(), lengths.end());
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> guard(c.lock);
    auto it = c.plans.find(key);
    if (it != c.plans.end()) {
      ++c.hits;
      return it->second;
    }
  }
  auto plan = make_plan(lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa, repeat_kv);
  std::lock_guard<std::mutex> guard(c.lock);
  ++c.misses;
  if ((int64_t)c.plans.size() >= kMaxPlans) c.plans.clear();
  c.plans.emplace(std::move(key), plan);
  return plan;
}

namespace {

// Whether call d, which folds, extends the driver call r as its next index: r folds too, over the
// same segments, with the same shape of call, and phases and heads that step as r's.
bool extends(const DriverCall& r, const Call& d) {
  const Call& c = r.c;
  auto same = [](const Strided& x, const Strided& y) { return x.n == y.n && x.dp == y.dp && x.dc == y.dc; };
  if (r.b >= 0 || d.part.rows != c.part.rows || d.part.start != c.part.start ||
      d.part.length != c.part.length || d.r != c.r || d.m != c.m || d.g != c.g || !same(d.q, c.q) ||
      !same(d.kv, c.kv))
    return false;
  const int64_t dp = d.q.p0 - c.q.p0, dq = d.q.c0 - c.q.c0, dkv = d.kv.c0 - c.kv.c0;
  if (d.kv.p0 - c.kv.p0 != dp) return false;
  // the index's stride dp sN + dq sH must be positive for q and for k, v (a later phase, or the
  // same phase and later heads): no negative stride, and no two calls writing one gradient row
  if (!(dp > 0 || (dp == 0 && dq > 0 && dkv > 0))) return false;
  if (r.count == 1) return true;
  return dp == r.count * r.step_p && dq == r.count * r.step_q && dkv == r.count * r.step_kv;
}

// The key/value rows of a driver call of a branch: per plan call it runs, (part start, phase, head)
// of each of its heads (a part's segments and a phase's rows follow from those, the branch's r
// being one).
using KvRows = std::set<std::tuple<int64_t, int64_t, int64_t>>;

KvRows kv_rows(const DriverCall& d) {
  KvRows rows;
  const Strided& kv = d.c.kv;
  for (int64_t i = 0; i < d.count; ++i)
    for (int64_t t = 0; t < kv.n; ++t)
      rows.emplace(d.c.part.start, kv.p0 + i * d.step_p + t * kv.dp, kv.c0 + i * d.step_kv + t * kv.dc);
  return rows;
}

bool meet(const KvRows& a, const KvRows& b) {
  for (const auto& x : a)
    if (b.count(x)) return true;
  return false;
}

// Sets adds_first on the calls whose key/value rows meet those of a call since the last one set: the
// rows pending per batch entry (a call of batch entry b meets those of b and of every batch entry,
// b < 0; one of every batch entry meets all), kept as unions, so that the pass is linear in the calls.
void mark_shared_kv_rows(std::vector<DriverCall>* made) {
  // calls whose key/value rows are their query rows (every query head its own key/value head) share
  // none: no two calls of a branch share a query row
  auto own = [](const DriverCall& d) {
    const Strided &q = d.c.q, &kv = d.c.kv;
    return d.c.g == 1 && q.p0 == kv.p0 && q.dp == kv.dp && q.c0 == kv.c0 && q.dc == kv.dc && q.n == kv.n &&
           d.step_q == d.step_kv;
  };
  if (std::all_of(made->begin(), made->end(), own)) return;
  std::map<int64_t, KvRows> pending;  // per batch entry; -1: every batch entry
  for (DriverCall& d : *made) {
    const KvRows mine = kv_rows(d);
    if (d.b >= 0) {
      for (const int64_t e : {d.b, int64_t{-1}}) {
        const auto it = pending.find(e);
        d.adds_first = d.adds_first || (it != pending.end() && meet(mine, it->second));
      }
    } else {
      for (const auto& [e, rows] : pending) d.adds_first = d.adds_first || meet(mine, rows);
    }
    if (d.adds_first) pending.clear();
    pending[d.b].insert(mine.begin(), mine.end());
  }
}

}  // namespace

std::vector<DriverCall> driver_calls(const std::vector<Call>& calls, int64_t B, int64_t N) {
  std::vector<DriverCall> out;
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& c = calls[i];
    if (!folds(c, B, N)) {
      for (int64_t b = 0; b < B; ++b) out.push_back({c, (int64_t)i, b});
    } else if (!out.empty() && extends(out.back(), c)) {
      DriverCall& r = out.back();
      if (r.count == 1) {
        r.step_p = c.q.p0 - r.c.q.p0;
        r.step_q = c.q.c0 - r.c.q.c0;
        r.step_kv = c.kv.c0 - r.c.kv.c0;
      }
      ++r.count;
    } else {
      out.push_back({c, (int64_t)i, -1});
    }
  }
  mark_shared_kv_rows(&out);
  return out;
}

PlanCacheInfo plan_cache_info() {
  Cache& c = cache();
  std::lock_guard<std::mutex> guard(c.lock);
  return {c.hits, c.misses, (int64_t)c.plans.size(), kMaxPlans};
}

void plan_cache_clear() {
  Cache& c = cache();
  std::lock_guard<std::mutex> guard(c.lock);
  c.plans.clear();
  c.hits = c.misses = 0;
}

}  // namespace views
}  // namespace dilated_attention
