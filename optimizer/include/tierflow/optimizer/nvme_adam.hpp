// Optimizer states on the NVMe tier: fp32 master, m and v of each parameter
// live in one NVMe block and stream through pinned memory for each step.
//
// Note [Optimizer states on NVMe]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// step() walks the parameters in order with two pinned buffers: while the CPU
// Adam steps parameter i in one buffer, parameter i+1's state is being read
// into the other and parameter i-1's new state is being written back (double
// buffering). New state is written out of place, to a fresh block: only when
// the write has completed does the parameter's key point at it and the old
// block return to the free list. A failed write therefore leaves the previous
// state valid, and the model's weight is restored from the previous master,
// so an I/O failure loses nothing. A full tier (no space for a new state)
// leaves that item and the rest unstepped. A state that cannot be read back
// (a checksum mismatch: the data on disk is corrupt) is lost: that item is
// not stepped and the others are. step() reports all of these per item
// (StepResult) instead of throwing, so its caller knows exactly which
// parameters stepped and can retry only the others. Pinned buffers come from
// the pool (TIERFLOW_HOST_MEMORY): two of the largest state, double buffered.
// reserve() grows the swap files up front for the states and a step's new
// state (Note [NVMe space] in nvme_engine.hpp), so that too little disk is an
// error when the optimizer is made, not in a step.
// The moments sit on NVMe in their format (Note [Optimizer state formats]):
// a block is the fp32 master, then m and v of moment_bytes each (bf16, or
// 8bit's codes, padding and scales), then vmax (fp32, amsgrad only): 4+2+2 or
// 4+1+1 bytes a parameter read and written a step instead of 4+4+4. The
// kernel steps the block in place in its buffer, so an 8-bit state goes back
// to NVMe exactly as a host step leaves it (its blocks counted from the
// state's, or shard's, first element). read() and write() take the moments
// in the entry's format, or in fp32 (decoded and encoded: decoding then
// encoding gives the same bytes back, so a state read as fp32 and written
// back is unchanged).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"
#include "tierflow/optimizer/state_tier.hpp"
#include "tierflow/swap/nvme_engine.hpp"

namespace tierflow::optimizer {

/// Counters of an NvmeAdamStore.
struct NvmeAdamStats {
  std::uint64_t steps = 0;            ///< step() calls
  std::uint64_t bytes_read = 0;       ///< state bytes read from NVMe
  std::uint64_t bytes_written = 0;    ///< state bytes written to NVMe
  std::uint64_t read_wait_ns = 0;     ///< time the CPU waited for reads (not hidden by the pipeline)
  std::uint64_t write_failures = 0;   ///< parameters whose new state could not be written (state kept)
};

/// The optimizer states of many parameters on NVMe, stepped by CpuAdam.
class NvmeAdamStore {
 public:
  NvmeAdamStore(std::shared_ptr<swap::NvmeEngine> nvme, std::shared_ptr<allocator::PinnedHostPool> pool,
                int threads, CpuIsa isa = CpuIsa::kAuto);
  ~NvmeAdamStore();

  /// Registers a parameter of `numel` elements whose moments are kept in
  /// `format`: writes its initial state (master from `master`, moments from
  /// `m`/`v` in `moments_format` (`format` or fp32) and `vmax`, or zeros when null).
  /// Returns its key; when it throws (a full tier, a failed write) nothing is
  /// registered. amsgrad is refused with bf16 and 8-bit moments.
  std::uint64_t add(std::size_t numel, bool amsgrad, const float* master, const void* m = nullptr,
                    const void* v = nullptr, const float* vmax = nullptr, StateFormat format = StateFormat::kFp32,
                    StateFormat moments_format = StateFormat::kFp32);
  /// Reads a parameter's state (vmax may be null); synchronous. The moments
  /// come in `moments_format`: fp32 (decoded) or the entry's own format (its bytes).
  void read(std::uint64_t key, float* master, void* m, void* v, float* vmax,
            StateFormat moments_format = StateFormat::kFp32) const;
  /// Replaces a parameter's state; synchronous, out of place like a step. The
  /// moments are given in `moments_format`: fp32 (encoded) or the entry's own.
  void write(std::uint64_t key, const float* master, const void* m, const void* v, const float* vmax,
             StateFormat moments_format = StateFormat::kFp32);
  /// Forgets a parameter and frees its space.
  void remove(std::uint64_t key) noexcept;
  /// Bytes of one parameter's state: fp32 master, m and v in `format`
  /// (moment_bytes each) and, with amsgrad, an fp32 vmax.
  static std::uint64_t state_bytes(std::size_t numel, bool amsgrad, StateFormat format = StateFormat::kFp32) noexcept {
    return optimizer::state_bytes(ParamStateShape{numel, amsgrad, 0, format});
  }
  /// Grows the NVMe files now for states of these sizes plus a step's new
  /// state; throws io_error naming the need, the free space and TIERFLOW_NVME_MEMORY.
  void reserve(const std::vector<std::uint64_t>& state_sizes);
  /// Where a parameter's state lies in the swap files (tests, diagnostics).
  std::vector<swap::NvmeExtent> extents(std::uint64_t key) const;

  /// One parameter's inputs to a step.
  struct Item {
    std::uint64_t key = 0;
    const void* grad = nullptr;
    ScalarType grad_type = ScalarType::kFloat32;
    void* param_out = nullptr;                    ///< the model's weight, written in the same pass
    ScalarType param_type = ScalarType::kFloat32;
  };
  /// The outcome of a step: which items kept their previous state and weights.
  struct StepResult {
    std::vector<std::size_t> failed;  ///< indices into `items`, not stepped (state and weight unchanged)
    std::vector<std::size_t> lost;    ///< of those, the ones whose state could not be read (corrupt)
    std::string first_error;          ///< what went wrong first, naming the file and the operation
  };
  /// One Adam/AdamW step of `items`, pipelined as in Note [Optimizer states on NVMe].
  /// A failed write, a full tier or an unreadable state fails only the items it
  /// touches (reported, not thrown); every other item is stepped.
  StepResult step(const AdamOptions& options, std::int64_t step, const std::vector<Item>& items);

  /// Counters.
  NvmeAdamStats stats() const noexcept { return stats_; }
  /// Elements of a registered parameter.
  std::size_t numel(std::uint64_t key) const;
  /// The format a registered parameter's moments are kept in.
  StateFormat format(std::uint64_t key) const;

 private:
  struct Entry {
    swap::NvmeBlock block;
    std::size_t numel;
    bool amsgrad;
    StateFormat format;
  };
  std::size_t state_bytes(const Entry& e) const noexcept { return state_bytes(e.numel, e.amsgrad, e.format); }
  void fill_and_write(const Entry& e, swap::NvmeBlock block, const float* master, const void* m, const void* v,
                      const float* vmax, StateFormat moments_format);
  const Entry& entry(std::uint64_t key) const;
  struct Flight;  // step()'s two buffers: one item's read ahead, another's write behind
  bool step_item(Flight& f, const AdamOptions& options, std::int64_t step, std::size_t i);

  std::shared_ptr<swap::NvmeEngine> nvme_;
  std::shared_ptr<allocator::PinnedHostPool> pool_;
  CpuAdam adam_;
  std::unordered_map<std::uint64_t, Entry> entries_;
  std::uint64_t next_key_ = 1;
  NvmeAdamStats stats_;
};

}  // namespace tierflow::optimizer
