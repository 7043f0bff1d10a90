// The activation planner's search: branch and bound over groups of identical
// blocks, alphas solved exactly at the leaves. See Note [Activation planner].
#include "tierflow/tiering/detail/plan_search.hpp"

#include <algorithm>
#include <numeric>
#include <array>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

namespace tierflow::tiering::detail {
namespace {

// Relative slack when comparing predicted step times (sums in different orders).
constexpr double kTimeSlack = 1e-12;
// Nodes the branch and bound may visit before it returns the best plan found.
constexpr std::uint64_t kNodeLimit = 1'000'000;
// Bounds of the search: unpriced, and priced at the root's best prices.
constexpr std::size_t kRelaxations = 2;

// A block's choice: keep (0), or a mode on a swap tier's row t: swap 1 + 3t, split 2 + 3t, recompute 3 + 3t
// (Note [Tier descriptors]: the rows are the search's only notion of a tier).
constexpr int kKeepC = 0;
constexpr int kModesPerTier = 3;
constexpr std::size_t kMaxChoices = 1 + kModesPerTier * kMaxSwapTiers;
using Counts = std::array<int, kMaxChoices>;
constexpr std::array<BlockMode, kModesPerTier> kTierModes = {BlockMode::kSwap, BlockMode::kSplit, BlockMode::kRecompute};

BlockMode choice_mode(int c) { return c == kKeepC ? BlockMode::kKeep : kTierModes[(c - 1) % kModesPerTier]; }
// The row of a choice (keep: 0, where fill_block puts a kept block).
int choice_row(int c) { return c == kKeepC ? 0 : (c - 1) / kModesPerTier; }
SwapTier choice_tier(int c) { return static_cast<SwapTier>(choice_row(c)); }
int choice_of(BlockMode mode, int row) {
  switch (mode) {
    case BlockMode::kKeep: return kKeepC;
    case BlockMode::kSwap: return 1 + kModesPerTier * row;
    case BlockMode::kSplit: return 2 + kModesPerTier * row;
    case BlockMode::kRecompute: return 3 + kModesPerTier * row;
  }
  return kKeepC;
}

// The choices of a table of `rows` swap tiers, in the two orders the search uses.
struct ChoiceOrders {
  int count = 1;
  // The order the search decides a group's counts in: a tier's split after its other choices,
  // so the split's bound knows the tier bytes those take.
  std::vector<int> search;
  // Positions inside a group: the last row first (read last in backward), kept blocks last (keep-tail).
  std::vector<int> placement;
  explicit ChoiceOrders(std::size_t rows) : count(1 + kModesPerTier * static_cast<int>(rows)) {
    search.push_back(kKeepC);
    for (int t = 0; t < static_cast<int>(rows); ++t) {
      for (BlockMode m : {BlockMode::kSwap, BlockMode::kRecompute, BlockMode::kSplit}) search.push_back(choice_of(m, t));
    }
    for (int t = static_cast<int>(rows); t-- > 0;) {
      for (BlockMode m : {BlockMode::kRecompute, BlockMode::kSplit, BlockMode::kSwap}) placement.push_back(choice_of(m, t));
    }
    placement.push_back(kKeepC);
  }
};

// A split block's time at the breakpoints of its convex piecewise-linear curve in alpha.
struct SplitCurve {
  std::vector<double> alphas;  // ascending
  std::vector<double> times;   // block time (forward + backward) at each alpha
  double best_time = kInf;     // its minimum (at a breakpoint: the curve is convex)
  double best_alpha = 0;       // where; the curve falls before it
};

SplitCurve split_curve(const BlockProfile& p, const Links& links, const TierTable& tiers, SwapTier tier) {
  SplitCurve c;
  if (p.split_bytes == 0) {
    c.alphas = {1.0};  // no bytes to trade: recompute nothing
  } else {
    c.alphas = split_breakpoints(p, links, tiers, tier);
  }
  for (double a : c.alphas) {
    c.times.push_back(block_times(p, links, tiers, BlockMode::kSplit, a, tier).total());
    if (c.times.back() < c.best_time) {
      c.best_time = c.times.back();
      c.best_alpha = a;
    }
  }
  return c;
}


struct Group {
  BlockProfile profile;
  std::vector<std::size_t> members;  // block indices, ascending
  std::uint64_t saved = 0;
  double keep_time = 0;                          // forward + backward, kept
  std::array<bool, kMaxChoices> usable{};
  std::array<double, kMaxChoices> time_lb{};        // a block's time; split: its best alpha, its tier unlimited
  std::array<std::uint64_t, kMaxChoices> base_bytes{};  // a block's tier bytes; split: at alpha 0
  std::array<SplitCurve, kMaxSwapTiers> curves;     // split, per row
  double best_nonkeep = kInf;                    // min of time_lb over usable non-keep choices
  int size() const { return static_cast<int>(members.size()); }
};

std::vector<Group> make_groups(const std::vector<BlockProfile>& blocks, const Links& links, const TierTable& tiers) {
  std::vector<Group> groups;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const Group& g) { return same_profile(g.profile, blocks[i]); });
    if (it == groups.end()) {
      groups.push_back(Group{});
      groups.back().profile = blocks[i];
      it = groups.end() - 1;
    }
    it->members.push_back(i);
  }
  const ChoiceOrders choices(tiers.size());
  for (auto& g : groups) {
    const auto& p = g.profile;
    g.saved = p.saved_bytes();
    g.keep_time = block_times(p, links, tiers, BlockMode::kKeep, 0, SwapTier::kHost).total();
    for (std::size_t t = 0; t < tiers.size(); ++t) g.curves[t] = split_curve(p, links, tiers, static_cast<SwapTier>(t));
    for (int c = 0; c < choices.count; ++c) {
      const BlockMode mode = choice_mode(c);
      const SwapTier tier = choice_tier(c);
      const TierRow& row = tiers[static_cast<std::size_t>(choice_row(c))];
      if (mode == BlockMode::kKeep) {
        g.usable[c] = true;
        g.time_lb[c] = g.keep_time;
        continue;
      }
      if (mode == BlockMode::kSplit) {
        const auto& curve = g.curves[choice_row(c)];
        g.time_lb[c] = curve.best_time;
        g.base_bytes[c] = swap_bytes_of(p, mode, p.split_bytes == 0 ? 1.0 : 0.0);
      } else {
        g.time_lb[c] = block_times(p, links, tiers, mode, 0, tier).total();
        g.base_bytes[c] = swap_bytes_of(p, mode, 0);
      }
      g.usable[c] = std::isfinite(g.time_lb[c]) && row.present &&
                    (mode != BlockMode::kSplit || p.splittable) && (mode == BlockMode::kSwap || p.replayable) &&
                    g.base_bytes[c] <= row.budget_bytes;
      if (g.usable[c]) g.best_nonkeep = std::min(g.best_nonkeep, g.time_lb[c]);
    }
  }
  return groups;
}

// The continuous part: given the choices, the split blocks' alphas under each tier's budget.
using TierDoubles = std::array<double, kMaxSwapTiers>;
struct AlphaSolution {
  std::vector<TierDoubles> alphas;  // per group, per row (a group's split blocks share it)
};

AlphaSolution solve_alphas(const std::vector<Group>& groups, const std::vector<Counts>& counts,
                           const TierDoubles& free_bytes, std::size_t rows) {
  AlphaSolution s;
  s.alphas.assign(groups.size(), TierDoubles{});
  for (std::size_t t = 0; t < rows; ++t) {
    const int choice = choice_of(BlockMode::kSplit, static_cast<int>(t));
    struct Segment {
      double slope;  // seconds per byte
      std::size_t group;
      std::size_t index;
      double bytes;  // for all the group's split blocks
    };
    std::vector<Segment> segments;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const int m = counts[g][choice];
      if (m == 0) continue;
      const auto& c = groups[g].curves[t];
      s.alphas[g][t] = c.alphas.front();
      for (std::size_t k = 0; k + 1 < c.alphas.size(); ++k) {
        const double bytes = m * (c.alphas[k + 1] - c.alphas[k]) * static_cast<double>(groups[g].profile.split_bytes);
        const double dt = m * (c.times[k + 1] - c.times[k]);
        if (bytes > 0) segments.push_back({dt / bytes, g, k, bytes});
      }
    }
    // Convex curves: a group's slopes rise with k, so taking the steepest first takes them in order.
    std::stable_sort(segments.begin(), segments.end(), [](const Segment& a, const Segment& b) {
      return std::tie(a.slope, a.group, a.index) < std::tie(b.slope, b.group, b.index);
    });
    double left = free_bytes[t];
    for (const auto& seg : segments) {
      if (seg.slope >= 0 || left <= 0) break;
      const double take = std::min(seg.bytes, left);
      const int m = counts[seg.group][choice];
      s.alphas[seg.group][t] += take / (m * static_cast<double>(groups[seg.group].profile.split_bytes));
      left -= take;
    }
  }
  return s;
}

// Branch and bound over the choices' counts, group by group and choice by choice
// (kSearchOrder); leaves solve the alphas exactly.
class Search {
 public:
  Search(std::vector<Group> groups, const Links& links, const TierTable& tiers, const Budgets& budgets)
      : groups_(std::move(groups)), links_(links), tiers_(tiers), budgets_(budgets), choices_(tiers.size()) {
    // Everything kept does not fit, so some block is not kept: its saved bytes come back while it runs,
    // and it swaps at least its smallest choice's bytes.
    std::uint64_t smallest_working = std::numeric_limits<std::uint64_t>::max();
    always_swaps_ = true;
    for (const auto& g : groups_) {
      working_floor_ = std::max(working_floor_, g.profile.transient_bytes);
      smallest_working = std::min(smallest_working, g.saved + g.profile.transient_bytes);
      for (int c = 0; c < choices_.count; ++c) {
        if (c != kKeepC && g.usable[c] && g.base_bytes[c] == 0) always_swaps_ = false;
      }
    }
    if (!groups_.empty()) working_floor_ = std::max(working_floor_, smallest_working);
    const std::size_t n = groups_.size();
    suffix_forced_bytes_.assign(n + 1, 0);
    for (std::size_t g = n; g-- > 0;) {
      const auto& gr = groups_[g];
      const std::uint64_t forced = std::isfinite(gr.best_nonkeep) ? 0 : gr.size() * gr.saved;
      suffix_forced_bytes_[g] = suffix_forced_bytes_[g + 1] + forced;
    }
    relaxations_.push_back(relax(TierDoubles{}));
    relaxations_.push_back(best_priced_relaxation());
    counts_.assign(n, Counts{});
    // Earlier groups with the same bytes (blocks that differ only in their times).
    auto shape = [](const BlockProfile& p) {
      return std::make_tuple(p.input_bytes, p.whole_bytes, p.split_bytes, p.cheap_bytes, p.transient_bytes,
                             p.splittable, p.replayable);
    };
    twins_.assign(n, {});
    for (std::size_t g = 0; g < n; ++g) {
      for (std::size_t h = 0; h < g; ++h) {
        if (shape(groups_[h].profile) == shape(groups_[g].profile) && groups_[h].usable == groups_[g].usable) {
          twins_[g].push_back(h);
        }
      }
    }
  }

  void run() {
    if (!groups_.empty()) step(0, 0, groups_[0].size(), Path{});
  }

  /// Starts from a known plan (its modes and tiers; alphas are solved again): a good first incumbent
  /// lets the bound prune from the start.
  void seed(const std::vector<BlockPlan>& plan) {
    Path path;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& gr = groups_[g];
      for (std::size_t b : gr.members) {
        int c = 0;
        auto matches = [&](int k) {
          return choice_mode(k) == plan[b].mode && (k == kKeepC || choice_tier(k) == plan[b].tier);
        };
        while (c < choices_.count && !matches(c)) ++c;
        if (c == choices_.count || !gr.usable[c]) {  // not a plan of this search
          counts_.assign(groups_.size(), Counts{});
          return;
        }
        ++counts_[g][c];
        if (c == kKeepC) {
          path.kept += gr.saved;
        } else {
          path.base[choice_row(c)] += gr.base_bytes[c];
        }
      }
    }
    bool within = true;
    for (std::size_t t = 0; t < tiers_.size(); ++t) within = within && path.base[t] <= tiers_[t].budget_bytes;
    if (within) leaf(path);
    counts_.assign(groups_.size(), Counts{});
  }

  bool found() const { return std::isfinite(best_time_); }
  bool complete() const { return nodes_ <= kNodeLimit; }
  std::uint64_t nodes() const { return nodes_; }

  /// The best assignment found, per block.
  std::vector<BlockPlan> assignment(std::size_t blocks) const {
    std::vector<BlockPlan> out(blocks);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& gr = groups_[g];
      std::size_t pos = 0;
      for (int c : choices_.placement) {
        const int m = best_counts_[g][c];
        const int t = choice_row(c);
        // Split blocks share the group's alpha to a byte: whole bytes, the remainder one byte each.
        std::uint64_t total = 0;
        if (choice_mode(c) == BlockMode::kSplit && gr.profile.split_bytes > 0 && m > 0) {
          total = static_cast<std::uint64_t>(
              std::floor(best_alphas_[g][t] * m * static_cast<double>(gr.profile.split_bytes)));
          total = std::min<std::uint64_t>(total, m * gr.profile.split_bytes);
        }
        for (int k = 0; k < m; ++k, ++pos) {
          auto& b = out[gr.members[pos]];
          b.mode = choice_mode(c);
          b.tier = choice_tier(c);
          if (b.mode != BlockMode::kSplit) continue;
          if (gr.profile.split_bytes == 0) {
            b.alpha = 1;
          } else {
            const std::uint64_t rows = total / m + (static_cast<std::uint64_t>(k) < total % m ? 1 : 0);
            b.alpha = static_cast<double>(rows) / static_cast<double>(gr.profile.split_bytes);
          }
        }
      }
    }
    return out;
  }

 private:
  // A relaxation of the remaining groups' choices: each block's cheapest non-keep choice when tier bytes
  // cost `price` seconds per byte (a Lagrangian relaxation of the rows' budgets; price 0 ignores
  // them), and keeping bounded by a knapsack over device bytes.
  struct Relaxation {
    TierDoubles price{};                // seconds per byte, per row
    std::vector<double> cost;           // per group: a block's cheapest non-keep time + price * tier bytes
    std::vector<double> suffix_cost;    // per g: sum over groups >= g (forced groups at their keep time)
    std::vector<std::size_t> by_ratio;  // groups that may choose, by keep gain per byte, descending
    std::vector<std::size_t> by_gain;   // the same by keep gain, descending
    std::vector<std::array<double, kMaxChoices>> later;  // per group and search position: the cheapest
                                                      // priced choice strictly after that position
  };

  // One block of group gr taking choice c (not keep): its least time plus `price` per byte swapped beyond
  // the choice's minimum (a split's alpha rows), with at most `free` such bytes. The split's curve is
  // convex in alpha, so the least is at a breakpoint or at the cap.
  double priced_rows_cost(const Group& gr, int c, double price, double free) const {
    if (choice_mode(c) != BlockMode::kSplit || gr.profile.split_bytes == 0) return gr.time_lb[c];
    const auto& curve = gr.curves[choice_row(c)];
    const double rows = static_cast<double>(gr.profile.split_bytes);
    const double cap = std::min(1.0, free / rows);
    double best = kInf;
    for (std::size_t k = 0; k < curve.alphas.size() && curve.alphas[k] <= cap; ++k) {
      best = std::min(best, curve.times[k] + price * curve.alphas[k] * rows);
    }
    if (cap < 1) {
      best = std::min(best, block_times(gr.profile, links_, tiers_, BlockMode::kSplit, cap, choice_tier(c)).total() +
                                price * cap * rows);
    }
    return best;
  }

  Relaxation relax(const TierDoubles& price) const {
    Relaxation r;
    r.price = price;
    const std::size_t n = groups_.size();
    r.cost.assign(n, kInf);
    r.suffix_cost.assign(n + 1, 0);
    r.later.assign(n, {});
    for (std::size_t g = 0; g < n; ++g) {
      const auto& gr = groups_[g];
      std::array<double, kMaxChoices> choice_cost;
      choice_cost.fill(kInf);
      for (int c = 0; c < choices_.count; ++c) {
        if (c == kKeepC || !gr.usable[c]) continue;
        const double price = r.price[choice_row(c)];
        choice_cost[c] = price * static_cast<double>(gr.base_bytes[c]) + priced_rows_cost(gr, c, price, kInf);
        r.cost[g] = std::min(r.cost[g], choice_cost[c]);
      }
      double m = kInf;
      for (int i = choices_.count; i-- > 0;) {
        r.later[g][i] = m;
        m = std::min(m, choice_cost[choices_.search[i]]);
      }
    }
    for (std::size_t g = n; g-- > 0;) {
      const bool forced = !std::isfinite(r.cost[g]);
      r.suffix_cost[g] = r.suffix_cost[g + 1] + groups_[g].size() * (forced ? groups_[g].keep_time : r.cost[g]);
      if (!forced) r.by_ratio.push_back(g);
    }
    r.by_gain = r.by_ratio;
    auto gain = [&](std::size_t g) { return r.cost[g] - groups_[g].keep_time; };
    auto ratio = [&](std::size_t g) {  // zero-byte blocks first
      return groups_[g].saved > 0 ? gain(g) / static_cast<double>(groups_[g].saved) : kInf;
    };
    std::sort(r.by_ratio.begin(), r.by_ratio.end(), [&](std::size_t a, std::size_t b) { return ratio(a) > ratio(b); });
    std::sort(r.by_gain.begin(), r.by_gain.end(), [&](std::size_t a, std::size_t b) { return gain(a) > gain(b); });
    return r;
  }

  // The prices whose relaxation bounds the whole search best: row by row in order, each over the
  // prices at which some block's cheapest choice changes (the relaxation's breakpoints).
  Relaxation best_priced_relaxation() const {
    std::array<std::vector<double>, kMaxSwapTiers> prices;
    for (const auto& gr : groups_) {
      for (std::size_t t = 0; t < tiers_.size(); ++t) {
        std::vector<std::pair<double, double>> points;  // (bytes, seconds)
        for (int c = 0; c < choices_.count; ++c) {
          if (c == kKeepC || !gr.usable[c] || choice_row(c) != static_cast<int>(t)) continue;
          if (choice_mode(c) == BlockMode::kSplit) {
            const auto& curve = gr.curves[t];
            for (std::size_t k = 0; k < curve.alphas.size(); ++k) {
              points.emplace_back(static_cast<double>(gr.base_bytes[c]) +
                                      curve.alphas[k] * static_cast<double>(gr.profile.split_bytes),
                                  curve.times[k]);
            }
          } else {
            points.emplace_back(static_cast<double>(gr.base_bytes[c]), gr.time_lb[c]);
          }
        }
        for (const auto& a : points) {
          for (const auto& b : points) {
            if (a.first < b.first && a.second > b.second) {
              prices[t].push_back((a.second - b.second) / (b.first - a.first));
            }
          }
        }
      }
    }
    Relaxation best = relax(TierDoubles{});
    double best_bound = root_bound(best);
    for (std::size_t t = 0; t < tiers_.size(); ++t) {
      for (double price : prices[t]) {
        TierDoubles priced = best.price;  // the earlier rows' best prices, the later rows' still 0
        priced[t] = price;
        Relaxation r = relax(priced);
        const double bound = root_bound(r);
        if (bound > best_bound) {
          best_bound = bound;
          best = std::move(r);
        }
      }
    }
    return best;
  }

  double root_bound(const Relaxation& r) const { return remaining_bound(r, 0, Path{}); }

  // Upper bound on the time saved by keeping blocks of groups >= g within `capacity` device bytes:
  // the smaller of the fractional knapsack and the best gains of as many blocks as could fit.
  double keep_gain_bound(const Relaxation& r, std::size_t g, double capacity) const {
    double dantzig = 0, left = capacity;
    for (std::size_t i : r.by_ratio) {
      if (i < g) continue;
      const auto& gr = groups_[i];
      const double gain = r.cost[i] - gr.keep_time;
      if (gain <= 0) continue;
      const double bytes = static_cast<double>(gr.saved) * gr.size();
      if (bytes <= left) {
        dantzig += gain * gr.size();
        left -= bytes;
      } else {
        dantzig += gain * gr.size() * (left / bytes);
        break;
      }
    }
    double min_saved = kInf, top = 0;
    for (std::size_t i : r.by_gain) {
      if (i < g) continue;
      const auto& gr = groups_[i];
      if (gr.saved == 0) {
        top += std::max(0.0, r.cost[i] - gr.keep_time) * gr.size();
      } else {
        min_saved = std::min(min_saved, static_cast<double>(gr.saved));
      }
    }
    double slots = std::isfinite(min_saved) ? std::floor(capacity / min_saved) : 0;
    for (std::size_t i : r.by_gain) {
      if (i < g || slots <= 0) continue;
      const auto& gr = groups_[i];
      if (gr.saved == 0) continue;
      const double take = std::min(slots, static_cast<double>(gr.size()));
      top += std::max(0.0, r.cost[i] - gr.keep_time) * take;
      slots -= take;
    }
    return std::min(dantzig, top);
  }

  // What the choices made so far imply.
  struct Path {
    std::array<double, kRelaxations> time_lb{};  // lower bound on their time, per relaxation (priced)
    std::uint64_t kept = 0;                // device bytes kept
    std::array<std::uint64_t, kMaxSwapTiers> base{};  // tier bytes per row at the least (split alphas 0)
    std::uint64_t working = 0;             // largest working set so far
    bool swapped = false;                  // something is swapped
  };

  // Device bytes the path needs already, with the floors that every plan here pays.
  std::uint64_t device_used(const Path& p) const {
    return budgets_.fixed_device_bytes + p.kept + std::max(p.working, working_floor_) +
           detail::window_bytes(budgets_.prefetch_bytes,
                                std::accumulate(p.base.begin(), p.base.end(), std::uint64_t{0}));
  }

  // Lower bound on the time of groups >= g given the path so far, under relaxation r: their priced
  // costs, less the keep gains that fit, less the price of the tier bytes the path leaves free.
  double remaining_bound(const Relaxation& r, std::size_t g, const Path& p) const {
    const double used = static_cast<double>(device_used(p)) + static_cast<double>(suffix_forced_bytes_[g]);
    const double capacity = static_cast<double>(budgets_.device_bytes) - used;
    if (capacity < 0) return kInf;
    double unpriced = 0;
    for (std::size_t t = 0; t < tiers_.size(); ++t) {
      unpriced += r.price[t] * static_cast<double>(tiers_[t].budget_bytes - p.base[t]);
    }
    if (g == groups_.size()) return -unpriced;
    return r.suffix_cost[g] - keep_gain_bound(r, g, capacity) - unpriced;
  }

  bool prune(double bound) const {
    if (!(bound < kInf)) return true;  // infeasible (or no bound)
    return std::isfinite(best_time_) && bound >= best_time_ - kTimeSlack * best_time_;
  }

  // Time of one block of `gr` on choice c at split alpha `alpha`.
  double choice_time(const Group& gr, int c, double alpha) const {
    if (choice_mode(c) != BlockMode::kSplit) return gr.time_lb[c];
    return block_times(gr.profile, links_, tiers_, BlockMode::kSplit, alpha, choice_tier(c)).total();
  }

  // Symmetry: blocks with the same bytes can trade choices (and alphas) without changing any memory
  // figure, so an optimal plan has no trade that saves time. Whether a block of group g on choice c
  // and a block of an earlier twin group on another choice would save by trading, whatever the
  // split alpha involved (the time difference is piecewise linear in it: checked at the breakpoints).
  bool exchange_improves(std::size_t g, int c) const {
    const auto& gr = groups_[g];
    for (std::size_t h : twins_[g]) {
      const auto& hr = groups_[h];
      for (int a = 0; a < choices_.count; ++a) {
        if (a == c || counts_[h][a] == 0) continue;
        const bool split_a = choice_mode(a) == BlockMode::kSplit, split_c = choice_mode(c) == BlockMode::kSplit;
        if (split_a && split_c) continue;
        const int t = choice_row(split_a ? a : c);
        std::vector<double> alphas = {0.0};
        if (split_a || split_c) {
          alphas = hr.curves[t].alphas;
          alphas.insert(alphas.end(), gr.curves[t].alphas.begin(), gr.curves[t].alphas.end());
        }
        bool always = true;
        for (double alpha : alphas) {
          // now: h on a, g on c; traded: h on c, g on a (the split alpha goes with the split choice)
          const double now = choice_time(hr, a, alpha) + choice_time(gr, c, alpha);
          const double traded = choice_time(hr, c, alpha) + choice_time(gr, a, alpha);
          if (!(traded < now - kTimeSlack * now)) {
            always = false;
            break;
          }
        }
        if (always) return true;
      }
    }
    return false;
  }

  // Decides how many of group g's `left` undecided blocks take the choice at search position i.
  void step(std::size_t g, int i, int left, const Path& path) {
    if (++nodes_ > kNodeLimit) return;
    if (i == choices_.count) {
      if (g + 1 == groups_.size()) {
        leaf(path);
      } else {
        step(g + 1, 0, groups_[g + 1].size(), path);
      }
      return;
    }
    const auto& gr = groups_[g];
    const int c = choices_.search[i];
    const int t = choice_row(c);
    const std::uint64_t tier_budget = tiers_[static_cast<std::size_t>(t)].budget_bytes;
    const bool last = i == choices_.count - 1;
    const int most = gr.usable[c] ? left : 0;
    const int least = last ? left : 0;
    if (least > most) return;
    // Keep and split try the most blocks first (the first dive is then a good plan), the others the fewest.
    const bool descending = c == kKeepC || choice_mode(c) == BlockMode::kSplit;
    for (int n = 0; n <= most - least; ++n) {
      const int k = descending ? most - n : least + n;
      const int rest = left - k;
      if (rest > 0 && !std::isfinite(relaxations_[0].later[g][i])) continue;
      Path next = path;
      if (k > 0 && c == kKeepC) {
        next.kept += k * gr.saved;
        next.working = std::max(next.working, gr.profile.transient_bytes);
      } else if (k > 0) {
        next.base[t] += k * gr.base_bytes[c];
        if (next.base[t] > tier_budget) continue;
        next.working = std::max(next.working, gr.saved + gr.profile.transient_bytes);
        next.swapped = next.swapped || gr.base_bytes[c] > 0;
      }
      // Split rows of the decided blocks and every undecided block share the tier bytes left: each
      // relaxation prices them (or, unpriced, lets each have them all).
      const double free = c == kKeepC ? 0.0 : static_cast<double>(tier_budget - next.base[t]);
      double bound = -kInf;
      for (std::size_t r = 0; r < kRelaxations; ++r) {
        const auto& rel = relaxations_[r];
        if (k > 0) {
          next.time_lb[r] += c == kKeepC ? k * gr.keep_time : k * priced_rows_cost(gr, c, rel.price[t], free);
        }
        bound = std::max(bound, next.time_lb[r] + (rest > 0 ? rest * rel.later[g][i] : 0.0) +
                                    remaining_bound(rel, g + 1, next));
      }
      if (prune(bound) || (k > 0 && exchange_improves(g, c))) continue;
      counts_[g][c] = k;
      step(g, i + 1, rest, next);
      counts_[g][c] = 0;
      if (nodes_ > kNodeLimit) return;
    }
  }

  void leaf(const Path& path) {
    const std::uint64_t kept = path.kept;
    const auto& base = path.base;
    TierDoubles free_bytes{};
    for (std::size_t t = 0; t < tiers_.size(); ++t) {
      free_bytes[t] = static_cast<double>(tiers_[t].budget_bytes - base[t]);
    }
    auto alphas = solve_alphas(groups_, counts_, free_bytes, tiers_.size());
    double time = 0;
    std::uint64_t working = 0;
    std::uint64_t swapped = 0;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const auto& gr = groups_[g];
      const auto& cnt = counts_[g];
      if (cnt[kKeepC] > 0) working = std::max(working, gr.profile.transient_bytes);
      if (cnt[kKeepC] < gr.size()) working = std::max(working, gr.saved + gr.profile.transient_bytes);
      for (int c = 0; c < choices_.count; ++c) {
        if (cnt[c] == 0) continue;
        const double alpha = choice_mode(c) == BlockMode::kSplit ? alphas.alphas[g][choice_row(c)] : 0.0;
        time += cnt[c] * block_times(gr.profile, links_, tiers_, choice_mode(c), alpha, choice_tier(c)).total();
        if (c != kKeepC) swapped += cnt[c] * swap_bytes_of(gr.profile, choice_mode(c), alpha);
      }
    }
    const std::uint64_t peak =
        budgets_.fixed_device_bytes + kept + working + detail::window_bytes(budgets_.prefetch_bytes, swapped);
    if (peak > budgets_.device_bytes || !(time < best_time_)) return;
    best_time_ = time;
    best_counts_ = counts_;
    best_alphas_ = alphas.alphas;
  }

  std::vector<Group> groups_;
  Links links_;
  TierTable tiers_;
  Budgets budgets_;
  ChoiceOrders choices_;
  std::uint64_t working_floor_ = 0;                 // the working set of every plan here is at least this
  bool always_swaps_ = false;                       // every plan here swaps something: the prefetch window counts
  std::vector<std::uint64_t> suffix_forced_bytes_;  // per g: bytes of groups >= g that must be kept
  std::vector<Relaxation> relaxations_;             // unpriced, and priced at the root's best prices
  std::vector<Counts> counts_;
  std::vector<std::vector<std::size_t>> twins_;     // per group: earlier groups with the same bytes
  std::uint64_t nodes_ = 0;
  double best_time_ = kInf;
  std::vector<Counts> best_counts_;
  std::vector<TierDoubles> best_alphas_;
};

}  // namespace

SearchOutcome search_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets) {
  const TierTable tiers = swap_tiers(links, budgets);
  Search search(make_groups(blocks, links, tiers), links, tiers, budgets);
  // Layers of one shape whose measured times differ (noise) group only once averaged: the averaged
  // plan is found fast and seeds the exact search.
  const auto averaged = average_same_shape_blocks(blocks);
  bool differ = false;
  for (std::size_t i = 0; i < blocks.size() && !differ; ++i) differ = !same_profile(blocks[i], averaged[i]);
  if (differ) {
    Search coarse(make_groups(averaged, links, tiers), links, tiers, budgets);
    coarse.run();
    if (coarse.found()) search.seed(coarse.assignment(blocks.size()));
  }
  search.run();
  SearchOutcome out;
  out.found = search.found();
  out.complete = search.complete();
  if (out.found) out.assignment = search.assignment(blocks.size());
  return out;
}

}  // namespace tierflow::tiering::detail
