// The staged pipeline: blocks move GPU -> pinned host staging -> NVMe and back.
//
// Note [Staged pipeline]
// ~~~~~~~~~~~~~~~~~~~~~~
// A block (an id and its bytes) leaves the device through a pinned host block
// from the pool (TIERFLOW_HOST_MEMORY), copied by the copy engine's D2H
// stream. The device copy is dropped as soon as that copy completes, observed
// on the next poll. With the host target the block stays there. With the NVMe
// target (Note [NVMe engine]) the host block is only staging: once the device
// copy is on the host, the block is written to NVMe behind the compute
// (write-behind) and the staging returns to the pool when the write
// completes. fetch() reads it back into staging (read-ahead), then copies it
// to the device. A read while the copy to the host is still in flight is
// served from the device copy (forwarding), and a block whose write is still
// pending is read back straight from its staging (SSDTrain's forwarding).
// Copies to the host still in flight hold device memory, so they are bounded
// (max_to_host_bytes): past it, offload() waits for the oldest one.
//
// Staging within the pool's budget: with the NVMe target, when the pool is
// full a transfer waits, oldest first, for the transfers that will free
// staging (writes; reads and their copies to the device; copies to the host,
// which become writes) and never allocates past the budget. Only when nothing
// is left in flight and the block still does not fit does offload() report
// "keep it on the device", or fetch_or_throw() raise out_of_memory. The host
// target never waits: a full pool keeps the block on the device. A failed
// copy to the host keeps the block on the device; a failed write keeps it in
// host memory (counted); a failed read raises from the block's
// complete_fetch(), and its staging returns to the pool.
//
// Stream ordering (the rules of Note [Copy ordering], applied here): the copy
// to the host names the stream given to offload() (the one whose work wrote
// the block) and the pipeline keeps the device buffer referenced until it
// sees that copy complete. A fetch allocates its destination through
// allocate_device and names compute_stream(device), so the copy also waits
// for work that still uses memory the device allocator just handed out.
// complete_fetch() makes that stream wait for the block's copy to the device
// and returns the staging to the pool with that copy's fence. On CUDA none of
// this blocks the host; the emulated device's adversarial mode checks each rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tierflow/allocator/pinned_host_pool.hpp"
#include "tierflow/core/stats.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/nvme_engine.hpp"

namespace tierflow::swap {

/// Device memory as the pipeline sees it: an address and what keeps it allocated.
struct DeviceBuffer {
  void* data = nullptr;         ///< first byte on the device
  std::shared_ptr<void> owner;  ///< keeps `data` allocated; dropping it lets the device memory go
};

/// Where a block's bytes are; see Note [Staged pipeline].
enum class StagedState : std::uint8_t {
  kOnDevice,  ///< the device copy is the block (kept by forwarding, back from the host, or its copy out failed)
  kToHost,    ///< the copy to the host staging is in flight; the device copy is held
  kOnHost,    ///< in host memory (host target; NVMe write pending, failed or NVMe full)
  kOnNvme,    ///< on NVMe only; its staging is back in the pool
  kToDevice,  ///< coming back: NVMe read and/or copy to the device in flight
  kReleased,  ///< released; nothing is held
};

/// Name of a state, for messages.
const char* to_string(StagedState s) noexcept;

/// Where offload() sends a block.
enum class StagedTarget : std::uint8_t { kHost, kNvme };

/// What fetch() did.
enum class FetchResult : std::uint8_t {
  kNothing,    ///< the block was not off the device (or already coming back)
  kForwarded,  ///< its copy to the host was in flight: the device copy is kept
  kStarted,    ///< its way back to the device has started
  kNoStaging,  ///< no staging memory now: the block was left where it was
};

/// Settings and device-side callbacks of a StagedPipeline.
struct StagedPipelineOptions {
  /// Copies to the host in flight beyond these bytes make offload() wait for the oldest.
  std::uint64_t max_to_host_bytes = 64ULL << 20;
  /// Device memory of `bytes` on `device` for a block coming back.
  std::function<DeviceBuffer(std::size_t bytes, int device)> allocate_device;
  /// The compute stream current on `device` (Note [Copy ordering]).
  std::function<StreamRef(int device)> compute_stream;
  /// Called on every state change of a block after offload() registered it.
  std::function<void(std::uint64_t id, StagedState to)> on_state;
};

/// Counters of a StagedPipeline since creation.
struct StagedPipelineStats {
  std::uint64_t offload_waits = 0;        ///< offload() waited for a copy to the host (bound reached)
  std::uint64_t offload_wait_ns = 0;      ///< time spent in those waits
  std::uint64_t staging_waits = 0;        ///< times a transfer waited for staging memory (back-pressure)
  std::uint64_t nvme_writes = 0;          ///< blocks written to NVMe (write-behind from staging)
  std::uint64_t nvme_write_bytes = 0;     ///< bytes written to NVMe
  std::uint64_t nvme_reads = 0;           ///< blocks read back from NVMe
  std::uint64_t nvme_forwarded = 0;       ///< fetches served from staging while the write was pending
  std::uint64_t nvme_write_failures = 0;  ///< failed NVMe writes: the block stayed in host memory
  std::uint64_t nvme_full = 0;            ///< blocks kept in host memory: NVMe tier full
};

/// Moves blocks between the device, pinned host staging and NVMe; see Note
/// [Staged pipeline]. Not thread-safe: its owner serializes calls.
class StagedPipeline {
 public:
  /// `pool`, `engine` and `nvme` (null: no NVMe tier) are shared with other users.
  StagedPipeline(StagedPipelineOptions options, std::shared_ptr<allocator::PinnedHostPool> pool,
                 std::shared_ptr<CopyEngine> engine, std::shared_ptr<NvmeEngine> nvme = nullptr);
  /// Releases every block still held (waiting for its transfers).
  ~StagedPipeline();
  StagedPipeline(const StagedPipeline&) = delete;
  StagedPipeline& operator=(const StagedPipeline&) = delete;

  /// Whether an NVMe tier is attached (kNvme is only valid then).
  bool has_nvme() const noexcept { return nvme_ != nullptr; }
  /// The NVMe engine, or null.
  const std::shared_ptr<NvmeEngine>& nvme() const noexcept { return nvme_; }
  /// Starts copying block `id` (unique among unreleased blocks) of `bytes` at
  /// `src` on `device` to host staging, after the work queued on `after`.
  /// False when there is no staging for it: keep it on the device (nothing registered).
  bool offload(std::uint64_t id, DeviceBuffer src, std::size_t bytes, int device, StagedTarget target,
               StreamRef after);
  /// Starts bringing a block back to the device (forwarding where it can).
  FetchResult fetch(std::uint64_t id);
  /// fetch(), raising out_of_memory when no staging can be had with every transfer settled.
  void fetch_or_throw(std::uint64_t id);
  /// Finishes a fetch: waits for the read (raising a failed one), makes the
  /// block's compute stream wait for its copy to the device, frees its staging.
  void complete_fetch(std::uint64_t id);
  /// True when a block coming back has its copy to the device complete (or not yet started).
  bool copy_to_device_ready(std::uint64_t id) const;
  /// True when a block was copied off the device (its copy out did not fail).
  bool offloaded(std::uint64_t id) const;
  /// True while the pipeline holds block `id`.
  bool contains(std::uint64_t id) const noexcept { return blocks_.count(id) != 0; }
  /// Current state of a block (kReleased for one the pipeline does not hold).
  StagedState state(std::uint64_t id) const;
  /// The block's device copy (empty while it has none).
  const DeviceBuffer& device_copy(std::uint64_t id) const;
  /// Waits for a block's transfers and frees its staging, NVMe space and device copy.
  void release(std::uint64_t id) noexcept;
  /// Observes completed transfers and moves blocks on.
  void poll();
  /// Waits for every copy in flight and settles block states.
  void synchronize();
  /// A new bound on the bytes copying to the host at once, from the next offload() on (> 0).
  void set_max_to_host_bytes(std::uint64_t bytes);
  /// Counters snapshot.
  const StagedPipelineStats& stats() const noexcept { return stats_; }

 private:
  struct Block;
  using BlockPtr = std::shared_ptr<Block>;

  Block& at(std::uint64_t id) const;
  void set_state(Block& b, StagedState to);
  void* staging(std::size_t bytes);
  std::size_t transfers_left() const noexcept;
  bool wait_for_a_transfer();
  void throttle(std::size_t just_added);
  void start_nvme_write(Block& b);
  void poll_to_host();
  void poll_writes();
  void poll_reads();
  void poll_to_device();
  void park_stalled(const BlockPtr& b, const char* what, const std::exception& e) noexcept;
  void poll_stalled() noexcept;
  void raise_stall() const;
  void free_block(Block& b) noexcept;

  StagedPipelineOptions options_;
  std::shared_ptr<allocator::PinnedHostPool> pool_;
  std::shared_ptr<CopyEngine> engine_;
  std::shared_ptr<NvmeEngine> nvme_;
  std::unordered_map<std::uint64_t, BlockPtr> blocks_;
  std::vector<BlockPtr> to_host_;    // copies to the host not yet observed complete, oldest first
  std::uint64_t to_host_bytes_ = 0;  // their bytes
  std::vector<BlockPtr> writes_;     // NVMe writes in flight
  std::vector<BlockPtr> reads_;      // NVMe reads in flight
  std::vector<BlockPtr> to_device_;  // NVMe tier: staging to free once the copy to the device is done
  std::vector<BlockPtr> stalled_;    // released while a copy or request of theirs stalled: freed once it ends
  std::string stall_;                // the first stall release() saw, raised by the next offload or fetch
  StagedPipelineStats stats_;
};

}  // namespace tierflow::swap
