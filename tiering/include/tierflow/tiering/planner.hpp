// The activation planner: per repeated block (a transformer layer), keep its
// saved activations on the device, swap them to host or NVMe, recompute them,
// or split their token rows between swap and recompute (MEMO), chosen from
// measured costs. Torch-free; bindings/ adapts autograd to the plan.
//
// Note [Activation planner]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The model (what evaluate_plan computes; plan_activations finds its optimum).
//
// Per block, MEMO's per-layer pipeline: the block's swap-out overlaps its own
// forward and its swap-in overlaps its own backward. The link also carries
// the optimizer's traffic when it is offloaded: the block's weights coming
// back during its forward (upload_bytes, host->device) and its gradients
// going down during its backward (download_bytes, device->host). Each phase
// takes the longest of its compute and its copies, each direction at its own
// speed and both together within the link's shared limit (Links.duplex; 0:
// none):
//   forward  = max(forward_seconds / c,
//                  s / write_bw, up / h2d, (s + up) / duplex)
//   backward = max((backward_seconds + recompute_seconds) / c,
//                  s / (read_bw * k), down / (d2h * k), (s + down) / (duplex * k))
// with s = swap_bytes, up/down = upload/download_bytes, write/read_bw d2h/h2d
// for the host tier and min(PCIe, NVMe) of that direction for the NVMe tier
// (the host staging is pipelined and not counted; an NVMe block shares the
// PCIe limit with the optimizer's traffic), c = Links.
// compute_share_during_copies in a phase that copies anything (else 1: the
// device computes slower beside concurrent copies, a measured factor), and
// k = Links.copy_share_during_cpu_step in backward when download_bytes > 0
// (the CPU optimizer steps the gradients as they land, and its kernel takes
// host memory bandwidth from the copies), else 1. Per mode
//   mode       swap_bytes                        recompute_seconds
//   keep       0                                 0
//   swap       saved_bytes()                     0
//   split(a)   input + whole + a * split         (1-a) * split_recompute + cheap_recompute
//   recompute  input                             forward_seconds
// (a * split rounded to a byte in swap_bytes; the times take it exact).
// The step (activations' part) is the sum over blocks. With no optimizer
// traffic and both shares 1 this is MEMO's max(compute, transfer) per phase.
// Each phase is a max of functions linear in s, so a split block's time is
// convex and piecewise linear in alpha; its breakpoints are where two of
// those lines cross (detail::split_breakpoints).
//
// Device peak = fixed_device_bytes + the saved bytes of every kept block + the
// largest working set of one block (transient_bytes, plus saved_bytes() for a
// block that is not kept: its rows come back or are recomputed before its
// backward) + the prefetch window: prefetch_bytes, or every byte the blocks
// swap when that is less (no more can be in flight ahead of a backward; a
// small model's blocks swap less than a 256 KiB window, and counting it whole
// refused plans 3% short of the budget, issue 41). Counting every
// kept byte at once is conservative: with keep-tail the kept blocks are the
// last ones, so their bytes are gone by the time an earlier block's backward
// rebuilds its working set.
// Host (NVMe) usage = the sum of swap_bytes of the blocks on that tier; both
// must fit their budgets. (The swap tiers are rows of a TierTable, and the
// model and the search read a row's path bandwidths and room, never its name:
// Note [Tier descriptors] in tier_table.hpp.) NVMe is never faster than host in this model, so
// an optimal plan uses it only where host memory is short (ties go to host).
//
// Optimization (exact for the model). Keeping is the fastest option of every
// block, so when everything fits everything is kept. Otherwise the choice is:
// which blocks to keep (a knapsack over device bytes), and for the others a
// mode and tier (a choice per block) and, for split blocks, an alpha. For a
// fixed choice of modes and tiers, a split block's time is convex and
// piecewise linear in its swapped bytes (a max of linear functions per
// phase), so the alphas under one tier's budget are a fractional knapsack:
// taking segments in order of time saved per byte is exact, and identical
// blocks get equal alphas (to a byte). The discrete choices are searched by
// branch and bound over groups of identical blocks: a group's children are
// the counts of its blocks per choice (N identical layers cost O(N^6) leaves
// at worst, a few thousand nodes in practice). The bound of the blocks not
// yet decided is the larger of two relaxations: each block at its best choice
// with host and NVMe unlimited, or priced per byte (a Lagrangian relaxation of
// the two budgets, prices chosen once at the root); both less an upper bound on
// what keeping saves within the device bytes left (the smaller of the
// fractional knapsack and the best gains of as many blocks as fit). Blocks
// with the same bytes but different times (measured layers) can trade their
// choices without changing any memory figure, so a partial plan where such a
// trade would save time, whatever the split alpha, is cut; and such layers are
// first planned with their times averaged (average_same_shape_blocks: they
// group, so that is fast), which seeds the exact search with a near-optimal
// plan. A search that exceeds its node limit (1M, about half a second)
// returns the best plan found and says so (Plan::proven_optimal = false): that
// happens with many distinct profiles and a host too small for all of them.
// Among equally good plans, the kept blocks of a group are its last ones
// (backward needs them first; SSDTrain's keep-tail), and an alpha grows only
// while swapping more saves time. tests/cpp/test_planner.cpp checks the search
// against brute force over modes, tiers and an alpha grid.
//
// Assumptions: compute and transfers of different blocks do not overlap (a
// slow swap-out delays the next block); bandwidths and times are those of the
// profile; the recompute of a split block's rows costs in proportion to them.
//
// Parameters (Budgets::params other than kResident; Note [Parameter residency]
// says how they move). A block's parameters are resident (Tier::kGpu, on the
// device the whole step) or fetched from the host or NVMe tier: then its
// parameter_bytes P cross host->device once in forward and once in backward,
// on the link the optimizer's uploads and backward's swap-ins use:
//   forward  adds  (up + P) / h2d  in place of up / h2d,
//                  P / nvme_read (parameters on NVMe), (s + up + P) / duplex
//   backward adds  (s + P) / (h2d * k),  P / (nvme_read * k) (on NVMe; with
//                  (s + P) / (nvme_read * k) when the swap is on NVMe too),
//                  (s + down + P) / (duplex * k)
// and a phase that fetches computes at c. The rest unit (embeddings, final
// norm, head: Budgets::rest_parameter_bytes), fetched, adds
// 2 * rest / read bandwidth of its tier (no compute to hide behind).
// Device peak adds the resident units' parameters (blocks and rest) and the
// parameter window: the two largest fetched units' parameters (the running
// one and the one prefetched; conservative for unequal blocks). Fetched
// parameters count against their tier's budget (host or NVMe) beside the
// swapped activations; fixed_device_bytes then excludes every parameter the
// units hold. With P = 0 every term is the one above, so with parameters
// resident (the default) the plans are those of activations alone.
// Search: for every count of fetched blocks per group of identical profiles
// (the earliest of a group are fetched) and the rest unit resident or
// fetched, the activation search runs with the resident parameters and the
// window in the fixed bytes and the fetched ones out of their tier's budget;
// the fastest wins (ties: fewer fetched). Exact for the model while the
// counts give at most kMaxParamChoices combinations; beyond, blocks of one
// shape are grouped with their times averaged, and then the k largest blocks
// are fetched for every k (Plan::proven_optimal = false, unless the plan
// keeps and holds everything: no plan is faster). The per-unit fetches and
// releases that carry a plan out are tiering::ParamSchedule's (Note
// [Parameter residency]; its window: Plan::param_prefetch_bytes).
//
// Outside the blocks (Budgets::outside_saved_bytes O: what the model saves
// outside its blocks, the head's logits above all). They are kept on the
// device (the peak adds O: they live from the forward to the backward, beside
// everything else) or swapped to the host whole (the host's usage adds O, the
// step adds O / d2h + O / h2d: saved at the end of the forward and needed at
// the start of the backward, they have no compute to hide behind). Swapped,
// they are still on the device where they are made and where they come back,
// beside every kept block, when no block's working set is: the peak adds
// O - min(O, T), T the largest block's transient bytes (every working set
// holds at least T, so the peak is at least fixed + kept + O). The search
// runs once for each choice, that addition in the fixed bytes (and O out of
// the host's budget when swapped), and the faster plan wins (ties: kept). forced_plan keeps them with kKeep and
// swaps them otherwise, as TIERFLOW_OFFLOAD_ACTIVATIONS=recompute does.
// A third choice when an NVMe tier is present with room for O: swapped whole
// to NVMe through the host (the staged pipeline, chunk by chunk): the NVMe
// tier's usage adds O, the step adds O / min(d2h, nvme_write) + O /
// min(h2d, nvme_read) (the path's slowest links, as a block's swap to NVMe),
// the device peak as swapped to the host; O out of the NVMe budget in the
// search. Ties go to the earlier choice (kept, host, NVMe), so it wins only
// when it is faster or the only one that fits (a host budget the blocks
// need). The model-level hook carries it out (PackTarget::kOutsideNvme).
// Their way goes through pinned host staging of each tensor whole (Note
// [Staged pipeline]: the pipeline stages a saved tensor's storage in one
// block of the pool, on its way down and again on its way back; without room
// it waits for the transfers in flight, and with none left the tensor stays
// on the device, past the device budget, or its read raises), one at a time
// at the least: the host's usage adds the largest of them
// (Budgets::outside_largest_bytes, Plan::outside_staging_bytes), beside the
// blocks' swapped bytes (they come back at the start of backward, when every
// swapped block is on the host), and the search takes it out of the host's
// budget: a host budget below it refuses the choice. Unknown (0, a profile
// from before it was measured), nothing is counted. The blocks' own swaps to
// NVMe stage the same way and are not counted (pipelined, above).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/tier.hpp"
#include "tierflow/tiering/tier_table.hpp"

namespace tierflow::tiering {

/// Measured (or estimated) costs of one repeated block (e.g. a transformer layer), forward order.
struct BlockProfile {
  double forward_seconds = 0;          ///< the block's forward compute
  double backward_seconds = 0;         ///< its backward compute, recompute excluded
  std::uint64_t input_bytes = 0;       ///< the block's input: swapped whole unless the block is kept
  std::uint64_t whole_bytes = 0;       ///< saved bytes swapped whole (attention output + softmax statistics); never recomputed by a split
  std::uint64_t split_bytes = 0;       ///< saved bytes of row-wise matmul outputs: a fraction alpha of their token rows is swapped, the rest recomputed
  double split_recompute_seconds = 0;  ///< time to recompute ALL rows of split_bytes (alpha=0)
  std::uint64_t cheap_bytes = 0;       ///< the other saved bytes (norms, pointwise, dropout masks): recomputed whenever the block is not kept/swapped whole
  double cheap_recompute_seconds = 0;  ///< time to recompute them
  bool splittable = true;              ///< false: no exact token split exists for this block (only keep / swap / recompute)
  bool replayable = true;              ///< false: its forward may not run again in backward (only keep / swap; Note [Replay side effects])
  std::uint64_t transient_bytes = 0;   ///< device bytes the block needs while it runs (workspace, its own recomputed tensors beyond saved bytes)
  std::uint64_t upload_bytes = 0;      ///< host->device bytes beside its swap during its forward (its weights back from the CPU optimizer)
  std::uint64_t download_bytes = 0;    ///< device->host bytes beside its swap during its backward (its gradients to the CPU optimizer)
  std::uint64_t parameter_bytes = 0;   ///< its 16-bit parameters (read only when Budgets::params is not kResident)
  /// Derived, leave 0: the parameter bytes fetched host->device in each phase and their tier. The planner
  /// sets them from BlockPlan::params (Note [Activation planner], Parameters).
  std::uint64_t fetch_bytes = 0;
  Tier fetch_tier = Tier::kHost;
  /// Every byte the block saves for backward.
  std::uint64_t saved_bytes() const noexcept { return input_bytes + whole_bytes + split_bytes + cheap_bytes; }
};

/// Link bandwidths, bytes per second.
struct Links {
  double d2h = 0, h2d = 0, duplex = 0;   ///< device->host, host->device alone, and both at once (sum; 0: no shared limit)
  double nvme_write = 0, nvme_read = 0;  ///< host<->NVMe (0: no NVMe tier)
  double compute_share_during_copies = 1;  ///< device compute speed left while copies run, in (0, 1]
  double copy_share_during_cpu_step = 1;   ///< link speed left beside the CPU optimizer's kernel, in (0, 1]
};

/// Whether blocks' parameters may leave the device between uses (TIERFLOW_OFFLOAD_PARAMS).
enum class ParamPolicy : std::uint8_t {
  kResident,  ///< none: every parameter stays; they are in fixed_device_bytes and parameter_bytes is ignored
  kAuto,      ///< auto: per unit, resident or fetched, whichever gives the faster plan within budgets
  kFetchAll,  ///< host|nvme: every unit (each block and the rest) is fetched
};

/// Memory the plan may use, bytes. With params other than kResident, fixed_device_bytes excludes the
/// parameters of the blocks and of the rest unit: the plan counts them.
struct Budgets {
  std::uint64_t device_bytes = 0;        ///< TIERFLOW_GPU_MEMORY resolved to bytes
  std::uint64_t fixed_device_bytes = 0;  ///< what the rest of training needs on the device: params, grads, optimizer states, workspace
  std::uint64_t host_bytes = 0;          ///< host bytes available for swapped activations (and fetched parameters)
  std::uint64_t nvme_bytes = 0;          ///< NVMe bytes available (0: none)
  std::uint64_t prefetch_bytes = 0;      ///< in-flight window of the swap engine, counted on the device
  ParamPolicy params = ParamPolicy::kResident;  ///< whether block parameters may be fetched
  Tier param_tier = Tier::kHost;         ///< where fetched parameters live between uses (kHost or kNvme)
  std::uint64_t rest_parameter_bytes = 0;  ///< parameters outside the blocks (embeddings, final norm, head)
  /// Saved tensors outside the blocks per step (the head's logits, the embeddings' output): kept on the device
  /// or swapped whole to the host or NVMe, the plan's choice (Note [Activation planner], Outside the blocks).
  std::uint64_t outside_saved_bytes = 0;
  /// The largest single one of them (its storage's bytes; auto: SavedTensorStats::policy_largest_bytes): the host
  /// staging of their way to NVMe (Note [Activation planner], Outside the blocks). 0: unknown, not counted.
  std::uint64_t outside_largest_bytes = 0;
  /// Swap tiers after host and NVMe, each a row with its links and room (none from the configuration; Note
  /// [Tier descriptors] sketches a remote host's). swap_tiers puts them in the table the search iterates.
  std::vector<TierRow> further_swap_tiers;
};

/// The swap tiers of `links` and `budgets` as rows (Note [Tier descriptors]): host (the device's link, d2h/h2d;
/// host_bytes; always present), NVMe (through the host, nvme_write/nvme_read; nvme_bytes; present with a budget
/// and both rates), then Budgets::further_swap_tiers (present with a budget and both rates). config_error for
/// more than kMaxSwapTiers rows or a row whose `via` is not an earlier row.
TierTable swap_tiers(const Links& links, const Budgets& budgets);

/// What happens to a block's saved bytes. swap = every saved byte swapped, nothing recomputed;
/// split = MEMO; recompute = only the input swapped, the whole block recomputed.
enum class BlockMode : std::uint8_t { kKeep, kSwap, kSplit, kRecompute };
/// Where swapped bytes go: the index of a row of swap_tiers' table (Note [Tier descriptors]); kHost and kNvme
/// are the rows the configuration builds, a further row i is static_cast<SwapTier>(i).
enum class SwapTier : std::uint8_t { kHost, kNvme };

/// The decision and the predictions for one block.
struct BlockPlan {
  BlockMode mode = BlockMode::kKeep;
  double alpha = 0;                            ///< kSplit: fraction of split_bytes' rows swapped
  SwapTier tier = SwapTier::kHost;
  double keep = 1, swap = 0, recompute = 0;    ///< fractions of saved_bytes(); sum to 1
  std::uint64_t swap_bytes = 0;                ///< bytes sent to the tier per step
  double forward_seconds = 0, backward_seconds = 0;  ///< predicted, transfers and recompute included
  Tier params = Tier::kGpu;                    ///< where its parameters live between uses (kGpu: resident)
};

/// A plan for every block, with its predictions.
struct Plan {
  std::vector<BlockPlan> blocks;
  std::uint64_t predicted_device_peak_bytes = 0;
  double predicted_step_seconds = 0;             ///< activations' part of the step: forward + backward of the blocks
  std::uint64_t host_bytes = 0, nvme_bytes = 0;  ///< swapped activations (and fetched parameters) held per tier at the peak
  std::vector<std::uint64_t> tier_bytes;         ///< the same per row of swap_tiers (host_bytes, nvme_bytes, further rows)
  std::vector<std::string> tier_names;           ///< the rows' names, as the lines print them (Note [Tier descriptors])
  // Additions to the agreed interface:
  double keep_all_step_seconds = 0;              ///< the step if every block were kept (the fastest possible)
  std::uint64_t device_budget_bytes = 0;         ///< Budgets::device_bytes the plan was made for
  bool fits = true;                              ///< device peak, host and NVMe usage within the budgets
  bool proven_optimal = true;                    ///< false: the search stopped at its node limit (best found)
  Tier rest_params = Tier::kGpu;                 ///< where the rest unit's parameters live between uses
  std::uint64_t device_param_bytes = 0;          ///< resident parameters (blocks and rest) on the device all step
  std::uint64_t param_window_bytes = 0;          ///< fetched parameters on the device at once (two largest fetched units)
  std::uint64_t param_prefetch_bytes = 0;        ///< ParamSchedule's prefetch window: the largest fetched unit
  std::uint64_t host_param_bytes = 0, nvme_param_bytes = 0;  ///< fetched parameters held per tier
  double rest_fetch_seconds = 0;                 ///< the rest unit's fetches (in predicted_step_seconds)
  bool outside_kept = true;                      ///< the saved tensors outside the blocks stay on the device
  Tier outside_tier = Tier::kGpu;                ///< where they are between forward and backward (kGpu: kept)
  std::uint64_t outside_bytes = 0;               ///< Budgets::outside_saved_bytes (in outside_tier)
  double outside_swap_seconds = 0;               ///< their way to their tier and back, not hidden (in predicted_step_seconds)
  std::uint64_t outside_staging_bytes = 0;       ///< outside_tier kNvme: their pinned host staging (in host_bytes)
  std::string summary() const;                   ///< one line: modes count, peak, step, vs keep-all
  std::string block_line(std::size_t i) const;   ///< one line per block
  std::string tier_name(SwapTier t) const;       ///< row `t`'s name (to_string(t) without the table's names)
};

/// Most combinations of fetched counts the joint search tries exactly (Note [Activation planner], Parameters).
inline constexpr std::size_t kMaxParamChoices = 256;

/// The plan that minimizes the predicted step time within the budgets (see Note [Activation planner]);
/// with Budgets::params kAuto it chooses each block's parameter residence too, with kFetchAll every unit is
/// fetched. A budget below the cheapest plan throws out_of_memory naming the bytes needed (with parameters:
/// the largest block's working set plus the parameter window).
/// Everything fits: every block kept. Throws tierflow::out_of_memory (Python: OutOfMemoryError) saying
/// how many device bytes the cheapest-memory plan needs when even that does not fit; throws config_error
/// for a negative or non-finite time or bandwidth, or when all blocks' bytes plus fixed_device_bytes and
/// prefetch_bytes reach 2^63 (no sum of the model may wrap around).
Plan plan_activations(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets);

/// Every block in `mode` (kSplit: alpha as large as the per-block link rule allows), same predictions;
/// for forced configurations. Parameters: kFetchAll fetches every unit from Budgets::param_tier (their bytes
/// take that tier's budget first); otherwise they stay resident. Swapped bytes go to host until it is full, then to NVMe; never throws
/// for budgets (Plan::fits says whether it fits); a non-splittable block asked for kSplit is recomputed.
Plan forced_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets, BlockMode mode);

/// Predicted step and peak of a given per-block assignment (mode, alpha, tier and params are read; the
/// rest is filled in). The model itself; the tests' brute force uses it. The rest unit is fetched from
/// Budgets::param_tier under kFetchAll, else resident; a block's params other than kGpu under kResident
/// is a logic_error.
Plan evaluate_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   std::vector<BlockPlan> assignment);
/// The same with the rest unit's residence given, and whether the saved tensors outside the blocks stay on the
/// device (else they go to the host; Note [Activation planner], Outside the blocks).
Plan evaluate_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   std::vector<BlockPlan> assignment, Tier rest_params, bool outside_kept = true);
/// The same with where the saved tensors outside the blocks go: kGpu (kept), kHost or kNvme (Plan::outside_tier).
Plan evaluate_plan(const std::vector<BlockProfile>& blocks, const Links& links, const Budgets& budgets,
                   std::vector<BlockPlan> assignment, Tier rest_params, Tier outside_tier);

/// The plan's predictions had block i alone taken `alternative` instead (the other blocks as planned).
struct AlternativeCost {
  BlockPlan block;                     ///< the alternative, its swap bytes, fractions and times filled in
  double step_seconds = 0;             ///< the plan's predicted step with it
  std::uint64_t device_peak_bytes = 0, host_bytes = 0, nvme_bytes = 0;  ///< the plan's usage with it
  bool fits_device = true, fits_host = true, fits_nvme = true;         ///< each usage within its budget
  bool fits_further = true;            ///< every further swap tier's usage within its budget
  bool fits() const noexcept { return fits_device && fits_host && fits_nvme && fits_further; }
};

/// The model of evaluate_plan for `plan` (as evaluate_plan or plan_activations returned it) with block i's
/// assignment replaced by `alternative` (mode, alpha and tier read): why the planner did not choose it.
/// O(blocks); the chosen assignment itself gives the plan's own figures exactly.
AlternativeCost evaluate_alternative(const std::vector<BlockProfile>& blocks, const Links& links,
                                     const Budgets& budgets, const Plan& plan, std::size_t i,
                                     BlockPlan alternative);

/// Blocks of the same shape (equal bytes of every class, transient bytes and splittable) with their times
/// replaced by the means over that shape: measured layers of one model differ only by noise, and
/// identical profiles plan exactly and fast (they group; see Note [Activation planner]).
std::vector<BlockProfile> average_same_shape_blocks(const std::vector<BlockProfile>& blocks);

/// The host staging of the saved tensors outside the blocks on their way to NVMe and back: the largest of them,
/// no more than all of them; 0 when unknown (Note [Activation planner], Outside the blocks).
std::uint64_t outside_staging_bytes(const Budgets& budgets) noexcept;

/// What is saved outside the blocks (`bytes`), to the host and back, not hidden (Note [Activation planner]).
double outside_swap_seconds(const Links& links, std::uint64_t bytes);
/// The same to `tier` and back: 0 for kGpu (kept), outside_swap_seconds for kHost, through the host for kNvme
/// (each way at the path's slowest link; Note [Activation planner]).
double outside_tier_seconds(const Links& links, std::uint64_t bytes, Tier tier);

/// Name of a mode: "keep", "swap", "split", "recompute".
std::string_view to_string(BlockMode) noexcept;
/// The mode named `text` (keep, swap, split, recompute); config_error naming it and the accepted names.
BlockMode parse_block_mode(std::string_view text);
/// Name of a tier: "host", "nvme" ("tier 2" and on for further rows: their names are the table's).
std::string_view to_string(SwapTier) noexcept;
/// Name of a parameter policy: "resident", "auto", "fetch-all".
std::string_view to_string(ParamPolicy) noexcept;

}  // namespace tierflow::tiering
