// Interleaved rounds of a comparison with PyTorch. Each round runs ours
// once per variant (e.g. a kernel of the dense layers), then PyTorch's, so
// that the machine's drift between runs falls on both sides alike; ratios
// are then taken round by round (Rounds::speedups, round_speedups) and a
// benchmark prints their median.
//
//   bench::RoundsPlan plan;
//   plan.name = "ddp_rpc";
//   plan.rounds = FLAGS_pairs;
//   plan.variants = {"xnnpack", "aten"};
//   bench::Rounds<Figures> rounds;
//   const int rc = bench::run_rounds<Figures>(
//       plan, [&](const std::string& kernel, int round, Figures* f) { return run_ours(kernel, f); },
//       [&](int round, Figures* f) { return run_pytorch(f); }, &rounds);
//   rounds.speedups("aten", all_p50, /*higher_is_better=*/false).median();
#pragma once

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/common.h"

namespace ddprpc::benchmarks {

template <typename Figures>
struct Rounds {
  // Variant -> what each round of ours measured, in order.
  std::map<std::string, std::vector<Figures>> ours;
  // What each round of PyTorch's measured; shorter than ours' once its side
  // failed (no later round was run).
  std::vector<Figures> theirs;

  // Round i of `variant` against round i of PyTorch's, by `metric` of each
  // (rounds missing on either side, or without a figure, are left out).
  RoundSpeedups speedups(const std::string& variant,
                         const std::function<double(const Figures&)>& metric,
                         bool higher_is_better) const {
    const auto it = ours.find(variant);
    if (it == ours.end()) return {};
    std::vector<double> a, b;
    for (const Figures& f : it->second) a.push_back(metric(f));
    for (const Figures& f : theirs) b.push_back(metric(f));
    return round_speedups(a, b, higher_is_better);
  }
};

struct RoundsPlan {
  std::string name;  // of the benchmark, for the "<name>: round i of n" lines
  int rounds = 1;    // at least 1
  std::vector<std::string> variants;  // of ours, run in this order each round
  bool with_theirs = true;            // false: ours only, one round
};

// Runs the rounds into *out. ours(variant, round, &figures) returns 0, or
// the exit code that ends the whole run (returned at once); theirs(round,
// &figures) returns false when PyTorch's side failed, which ends the rounds
// (no ratio can be taken of a round without it).
template <typename Figures>
int run_rounds(const RoundsPlan& plan,
               const std::function<int(const std::string& variant, int round, Figures*)>& ours,
               const std::function<bool(int round, Figures*)>& theirs, Rounds<Figures>* out) {
  const int rounds = plan.with_theirs ? std::max(1, plan.rounds) : 1;
  for (int round = 0; round < rounds; ++round) {
    if (rounds > 1) std::fprintf(stderr, "%s: round %d of %d\n", plan.name.c_str(), round + 1, rounds);
    for (const std::string& variant : plan.variants) {
      Figures figures{};
      if (const int rc = ours(variant, round, &figures)) return rc;
      out->ours[variant].push_back(std::move(figures));
    }
    if (!plan.with_theirs) break;
    Figures figures{};
    if (!theirs(round, &figures)) break;
    out->theirs.push_back(std::move(figures));
  }
  return 0;
}

// Over the rounds, the median of `figure` where it is positive (0: no round
// has one).
template <typename Figures>
double median_over(const std::vector<Figures>& rounds,
                   const std::function<double(const Figures&)>& figure) {
  std::vector<double> v;
  for (const Figures& f : rounds) {
    const double x = figure(f);
    if (x > 0) v.push_back(x);
  }
  return v.empty() ? 0 : percentile(v, 0.5);
}

}  // namespace ddprpc::benchmarks
