// See Note [NVMe engine] in nvme_engine.hpp.
#include "tierflow/swap/nvme_engine.hpp"

#include <fcntl.h>
#include <libaio.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "tierflow/allocator/aligned_buffer.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/swap/copy_engine.hpp"
#include "tierflow/swap/detail/host_event.hpp"

#include "nvme_space.hpp"
#include "swap_files.hpp"

namespace tierflow::swap {
namespace {

using detail::ExtentAllocator;
using detail::FsSpace;
using detail::fs_space;

constexpr std::size_t kAlign = allocator::kDirectIoAlignment;

std::string errno_text(int err) { return std::strerror(err); }

// Takes one from a fault counter; true when there was one.
bool take_one(std::atomic<int>& n) {
  int v = n.load();
  while (v > 0 && !n.compare_exchange_weak(v, v - 1)) {
  }
  return v > 0;
}

struct BlockInfo {
  std::uint64_t bytes = 0;                 // rounded capacity
  std::vector<std::uint64_t> offsets;      // per path: start of this block's extent
  std::vector<std::uint64_t> lengths;      // per path: extent length
  std::uint64_t written = 0;               // bytes of the last successful write
  std::uint64_t checksum = 0;
  bool valid = false;
  int inflight = 0;
};

// One user operation (a block read or write), split into aio requests.
struct Operation {
  bool is_write = false;
  NvmeBlock block = 0;
  std::uint64_t bytes = 0;          // user bytes
  std::byte* io_buffer = nullptr;   // aligned buffer the requests use
  allocator::AlignedBuffer staging; // owns io_buffer when the user's buffer is unaligned
  void* user = nullptr;             // read destination to copy into when staged
  std::uint64_t checksum = 0;       // write: of the source
  int remaining = 0;
  int error = 0;                    // first errno
  std::string error_what;
  std::shared_ptr<detail::HostEvent> event;
};

struct Request {
  iocb cb;
  Operation* op;
  std::size_t path;
  std::uint64_t length;
};

}  // namespace

struct NvmeEngine::Impl {
  NvmeEngineOptions o;
  bool auto_cap = false;                // TIERFLOW_NVME_MEMORY=auto: the free space caps the files
  std::vector<int> fds;                 // each holds its file's flock (Note [Stale swap files])
  std::vector<std::string> files;
  std::vector<std::uint64_t> on_disk;   // per path: bytes fallocated from offset 0
  std::vector<std::uint64_t> in_use;    // per path: bytes of blocks
  std::vector<ExtentAllocator> space;
  io_context_t ctx{};
  mutable std::mutex mutex;
  std::condition_variable cv, idle;
  std::unordered_map<NvmeBlock, BlockInfo> blocks;
  NvmeBlock next_block = 1;
  std::deque<Request*> queue;
  std::size_t inflight = 0;
  std::size_t pending_ops = 0;
  bool stop = false;
  NvmeEngineStats st;
  std::uint64_t window_peak = 0;        // the most st.bytes_in_use since the last take_in_use_window_peak()
  std::thread thread;

  explicit Impl(NvmeEngineOptions opts) : o(std::move(opts)) {
    TIERFLOW_EXPECTS(!o.paths.empty(), "NvmeEngine: no path given (set TIERFLOW_NVME_PATHS)");
    TIERFLOW_EXPECTS(o.block_bytes >= kAlign && o.block_bytes % kAlign == 0,
                     "NvmeEngine: block size must be a multiple of 4096, got " + std::to_string(o.block_bytes));
    TIERFLOW_EXPECTS(o.queue_depth >= 1, "NvmeEngine: queue depth must be at least 1");
    auto_cap = o.bytes_per_path == kNvmeAutoBytes;
    // Auto: no fixed cap; the free space decides at each grow. 2^62 keeps offsets in off_t.
    o.bytes_per_path = auto_cap ? (std::uint64_t{1} << 62) : o.bytes_per_path / kAlign * kAlign;
    TIERFLOW_EXPECTS(o.grow_bytes > 0, "NvmeEngine: grow_bytes must be positive");
    NvmeEngine::remove_stale_files(o.paths);
    try {
      for (const auto& dir : o.paths) {
        auto [fd, file] = detail::create_locked_swap_file(dir, o.name_tag);
        fds.push_back(fd);
        files.push_back(file);
        on_disk.push_back(0);
        in_use.push_back(0);
        space.emplace_back(o.bytes_per_path);
      }
      // The first block of each file now: a path where nothing can be written
      // (a full disk, a cap below one request) fails here, at start.
      for (std::size_t p = 0; p < fds.size(); ++p) {
        std::string why = "TIERFLOW_NVME_MEMORY allows " + format_bytes(o.bytes_per_path) + " per path";
        int rc = o.bytes_per_path < kAlign ? ENOSPC : grow_locked(p, std::min<std::uint64_t>(o.block_bytes, o.bytes_per_path), true, &why);
        if (rc != 0)
          throw io_error(rc, "NvmeEngine: no space for a swap file in " + o.paths[p] + ": " + why +
                                 "; free space, add a path to TIERFLOW_NVME_PATHS or change TIERFLOW_NVME_MEMORY");
      }
      int rc = io_setup(static_cast<int>(o.queue_depth), &ctx);
      if (rc < 0) throw io_error(-rc, "NvmeEngine: io_setup(" + std::to_string(o.queue_depth) + ") failed: " + errno_text(-rc));
    } catch (...) {
      close_and_remove();
      throw;
    }
    st.bytes_capacity = auto_cap ? 0 : o.bytes_per_path * o.paths.size();
    thread = std::thread([this] { loop(); });
  }

  // Free space the file system of path p may still give this engine: all of it
  // under a fixed cap, or what leaves kNvmeAutoKeepFree of it free under auto.
  // Sets *why to the words that explain a refusal.
  std::uint64_t growable(std::size_t p, std::string* why) const {
    FsSpace fs = fs_space(o.paths[p]);
    if (!fs.known) return ~std::uint64_t{0};
    if (!auto_cap) {
      *why = format_bytes(fs.free) + " free on " + o.paths[p];
      return fs.free;
    }
    const auto keep = static_cast<std::uint64_t>(static_cast<double>(fs.size) * kNvmeAutoKeepFree);
    *why = format_bytes(fs.free) + " free on " + o.paths[p] + " of " + format_bytes(fs.size) +
           ", and TIERFLOW_NVME_MEMORY=auto leaves " + std::to_string(static_cast<int>(kNvmeAutoKeepFree * 100)) +
           "% of the file system (" + format_bytes(keep) + ") free";
    return fs.free > keep ? fs.free - keep : 0;
  }

  // Grows file p so that it holds at least `end` bytes (rounded up to a grow
  // step when there is room): 0, or the errno with *why saying what stood in
  // the way. With `exact` it grows to `end` only. Holds `mutex` or runs alone.
  int grow_locked(std::size_t p, std::uint64_t end, bool exact, std::string* why) {
    if (end <= on_disk[p]) return 0;
    if (end > o.bytes_per_path) {
      *why = "TIERFLOW_NVME_MEMORY caps each file at " + format_bytes(o.bytes_per_path);
      return ENOSPC;
    }
    std::string space_words;
    const std::uint64_t room = growable(p, &space_words);
    if (end - on_disk[p] > room) {
      *why = errno_text(ENOSPC) + ": " + files[p] + " needs " + format_bytes(end - on_disk[p]) + " more, " +
             space_words;
      return ENOSPC;
    }
    std::uint64_t target = end;
    if (!exact) {  // a whole grow step where the cap and the free space allow it
      const std::uint64_t want = allocator::round_up(on_disk[p] + o.grow_bytes, kAlign);
      std::uint64_t limit = o.bytes_per_path;
      if (room != ~std::uint64_t{0}) limit = std::min(limit, on_disk[p] + room / kAlign * kAlign);
      target = std::max(end, std::min(want, limit));
    }
    if (o.faults && take_one(o.faults->fail_grows)) {
      FsSpace fs = fs_space(o.paths[p]);
      *why = "fallocate(" + files[p] + ", " + format_bytes(target) + ") failed: " + errno_text(ENOSPC) +
             " (injected; " + format_bytes(fs.free) + " free on " + o.paths[p] + ")";
      return ENOSPC;
    }
    int rc = posix_fallocate(fds[p], static_cast<off_t>(on_disk[p]), static_cast<off_t>(target - on_disk[p]));
    if (rc != 0 && target > end) {
      (void)::ftruncate(fds[p], static_cast<off_t>(on_disk[p]));  // let go of what a partial grow took
      target = end;
      rc = posix_fallocate(fds[p], static_cast<off_t>(on_disk[p]), static_cast<off_t>(target - on_disk[p]));
    }
    if (rc != 0) {
      (void)::ftruncate(fds[p], static_cast<off_t>(on_disk[p]));
      FsSpace fs = fs_space(o.paths[p]);
      *why = "fallocate(" + files[p] + ", " + format_bytes(target) + ") failed: " + errno_text(rc) +
             (fs.known ? " (" + format_bytes(fs.free) + " free on " + o.paths[p] + ")" : "");
      return rc;
    }
    st.bytes_on_disk += target - on_disk[p];
    ++st.grows;
    on_disk[p] = target;
    return 0;
  }

  // Shrinks file p back to `end` bytes (undoing grows of a failed reserve).
  void shrink_locked(std::size_t p, std::uint64_t end) {
    if (end >= on_disk[p]) return;
    (void)::ftruncate(fds[p], static_cast<off_t>(end));
    st.bytes_on_disk -= on_disk[p] - end;
    on_disk[p] = end;
  }

  // Per-path extent lengths of a block of `bytes` (see plan()).
  std::vector<std::uint64_t> lengths_of(std::uint64_t bytes) const {
    const std::size_t P = fds.size();
    const std::uint64_t total = allocator::round_up(bytes == 0 ? kAlign : bytes, kAlign);
    const std::uint64_t stripes = (total + o.block_bytes - 1) / o.block_bytes;
    std::vector<std::uint64_t> lengths(P, 0);
    for (std::size_t p = 0; p < P; ++p) {
      const std::uint64_t mine = stripes / P + (p < stripes % P ? 1 : 0);
      // The last stripe may be partial; a full stripe per slot keeps the layout simple.
      lengths[p] = std::min<std::uint64_t>(mine * o.block_bytes, total);
    }
    return lengths;
  }

  ~Impl() {
    {
      std::unique_lock<std::mutex> lock(mutex);
      idle.wait(lock, [&] { return pending_ops == 0; });
      stop = true;
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
    io_destroy(ctx);
    close_and_remove();
  }

  bool unlinked = false;

  void unlink_all() noexcept {
    if (unlinked) return;
    unlinked = true;
    for (const auto& f : files) {
      detail::forget_swap_file(f);
      if (::unlink(f.c_str()) != 0 && errno != ENOENT)
        log(LogLevel::kWarn, "NvmeEngine: could not remove " + f + ": " + errno_text(errno));
    }
  }

  void close_and_remove() noexcept {
    for (int fd : fds) ::close(fd);
    unlink_all();
    fds.clear();
    files.clear();
  }

  // Splits a block into stripes: stripe k on path k % P at index k / P of that path's extent.
  void plan(Operation* op, const BlockInfo& b, std::vector<Request*>* out) {
    const std::size_t P = fds.size();
    const std::uint64_t total = allocator::round_up(op->bytes, kAlign);
    std::uint64_t pos = 0;
    for (std::uint64_t k = 0; pos < total; ++k) {
      const std::size_t p = k % P;
      const std::uint64_t len = std::min<std::uint64_t>(o.block_bytes, total - pos);
      auto* r = new Request{};
      r->op = op;
      r->path = p;
      r->length = len;
      const std::uint64_t off = b.offsets[p] + (k / P) * o.block_bytes;
      if (op->is_write) io_prep_pwrite(&r->cb, fds[p], op->io_buffer + pos, len, static_cast<long long>(off));
      else io_prep_pread(&r->cb, fds[p], op->io_buffer + pos, len, static_cast<long long>(off));
      r->cb.data = r;
      out->push_back(r);
      pos += len;
    }
  }

  void loop() {
    std::vector<io_event> events(o.queue_depth);
    std::vector<iocb*> batch;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return stop || !queue.empty() || inflight > 0; });
        if (stop && queue.empty() && inflight == 0) return;
        batch.clear();
        while (!queue.empty() && inflight + batch.size() < o.queue_depth) {
          batch.push_back(&queue.front()->cb);
          queue.pop_front();
        }
      }
      std::size_t done = 0;
      while (done < batch.size()) {
        int rc = io_submit(ctx, static_cast<long>(batch.size() - done), batch.data() + done);
        if (rc == -EAGAIN) {
          std::this_thread::yield();
          continue;
        }
        if (rc < 0) {
          // Nothing from here on was submitted: fail those requests with the reason.
          for (std::size_t i = done; i < batch.size(); ++i) complete(static_cast<Request*>(batch[i]->data), rc);
          break;
        }
        {
          std::lock_guard<std::mutex> lock(mutex);
          inflight += static_cast<std::size_t>(rc);
        }
        done += static_cast<std::size_t>(rc);
      }
      std::size_t now_inflight;
      {
        std::lock_guard<std::mutex> lock(mutex);
        now_inflight = inflight;
      }
      if (now_inflight == 0) continue;
      timespec timeout{0, 2'000'000};  // wake up to submit new requests
      int n = io_getevents(ctx, 1, static_cast<long>(events.size()), events.data(), &timeout);
      if (n < 0 && n != -EINTR) {
        log(LogLevel::kError, "NvmeEngine: io_getevents failed: " + errno_text(-n));
        continue;
      }
      for (int i = 0; i < n; ++i) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          --inflight;
        }
        complete(static_cast<Request*>(events[i].data), static_cast<long>(events[i].res));
      }
    }
  }

  // res: bytes transferred, or -errno.
  void complete(Request* r, long res) {
    Operation* op = r->op;
    if (o.faults) {
      std::this_thread::sleep_for(
          std::chrono::microseconds(op->is_write ? o.faults->write_delay_us.load() : o.faults->read_delay_us.load()));
      auto take = take_one;
      if (op->is_write ? take(o.faults->fail_writes) : take(o.faults->fail_reads)) res = -o.faults->error;
      else if (op->is_write ? take(o.faults->short_writes) : take(o.faults->short_reads)) res = static_cast<long>(r->length / 2);
      else if (!op->is_write && res > 0 && take(o.faults->corrupt_reads))
        static_cast<unsigned char*>(r->cb.u.c.buf)[0] ^= 0x5a;
    }
    const char* what = op->is_write ? "write" : "read";
    if (op->error == 0) {
      if (res < 0) {
        op->error = static_cast<int>(-res);
        op->error_what = std::string("NvmeEngine: ") + what + " of " + format_bytes(r->length) + " at offset " +
                         std::to_string(r->cb.u.c.offset) + " in " + files[r->path] + " failed: " + errno_text(op->error);
      } else if (static_cast<std::uint64_t>(res) != r->length) {
        op->error = EIO;
        op->error_what = std::string("NvmeEngine: short ") + what + " in " + files[r->path] + ": " +
                         std::to_string(res) + " of " + std::to_string(r->length) + " bytes at offset " +
                         std::to_string(r->cb.u.c.offset);
      }
    }
    delete r;
    if (--op->remaining > 0) return;
    finish(op);
  }

  void finish(Operation* op) {
    std::exception_ptr error;
    if (!op->is_write && op->error == 0) {
      std::uint64_t expected = 0;
      {
        std::lock_guard<std::mutex> lock(mutex);
        expected = blocks[op->block].checksum;
      }
      if (o.checksums && XXH3_64bits(op->io_buffer, op->bytes) != expected) {
        op->error = EIO;
        op->error_what = "NvmeEngine: checksum mismatch reading block " + std::to_string(op->block) + " (" +
                         format_bytes(op->bytes) + ") from " + files_of_block() + ": the data on disk is corrupt";
      } else if (op->user) {
        std::memcpy(op->user, op->io_buffer, op->bytes);
      }
    }
    if (op->error) error = std::make_exception_ptr(io_error(op->error, op->error_what));
    {
      std::lock_guard<std::mutex> lock(mutex);
      BlockInfo& b = blocks[op->block];
      --b.inflight;
      if (op->is_write) {
        b.valid = op->error == 0;  // a failed write never leaves the block valid
        if (b.valid) {
          b.written = op->bytes;
          b.checksum = op->checksum;
        }
      }
      if (op->error) ++st.failures;
      else if (op->is_write) { st.bytes_written += op->bytes; ++st.write_ops; }
      else { st.bytes_read += op->bytes; ++st.read_ops; }
      --pending_ops;
    }
    op->event->finish(error);
    delete op;
    idle.notify_all();
  }

  std::string files_of_block() const {
    std::string s;
    for (std::size_t i = 0; i < files.size(); ++i) s += (i ? ", " : "") + files[i];
    return s;
  }

  TransferHandle submit(NvmeBlock block, bool is_write, void* buffer, std::uint64_t bytes) {
    detail::count_queued_transfer();
    auto event = std::make_shared<detail::HostEvent>(bytes, is_write ? "NVMe write" : "NVMe read",
                                                     static_cast<std::int64_t>(block));
    auto op = std::make_unique<Operation>();
    op->is_write = is_write;
    op->block = block;
    op->bytes = bytes;
    op->event = event;
    BlockInfo layout;
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = blocks.find(block);
      if (it == blocks.end()) throw logic_error("NvmeEngine: unknown block " + std::to_string(block));
      const BlockInfo& b = it->second;
      if (bytes > b.bytes) {
        throw logic_error("NvmeEngine: " + std::string(is_write ? "write" : "read") + " of " + format_bytes(bytes) +
                          " into a block of " + format_bytes(b.bytes));
      }
      if (!is_write && (!b.valid || b.written != bytes)) {
        throw io_error(EIO, "NvmeEngine: read of block " + std::to_string(block) +
                                (b.valid ? " asks for " + format_bytes(bytes) + " but " + format_bytes(b.written) + " were written"
                                         : " which holds no valid data (its last write failed or never happened)"));
      }
      layout = b;
    }
    // Everything that can throw (staging, requests) happens before the
    // operation is counted, so a failure here leaves no count to wait on.
    const bool aligned = allocator::is_aligned(buffer, kAlign) && bytes % kAlign == 0;
    if (aligned) {
      op->io_buffer = static_cast<std::byte*>(buffer);
    } else {
      op->staging = allocator::AlignedBuffer(bytes == 0 ? kAlign : bytes);
      op->io_buffer = op->staging.data();
      if (is_write) std::memcpy(op->io_buffer, buffer, bytes);
      else op->user = buffer;
    }
    if (is_write && o.checksums) op->checksum = XXH3_64bits(op->io_buffer, bytes);
    std::vector<Request*> reqs;
    try {
      plan(op.get(), layout, &reqs);
    } catch (...) {
      for (auto* r : reqs) delete r;
      throw;
    }
    op->remaining = static_cast<int>(reqs.size());
    Operation* raw = op.release();
    {
      std::lock_guard<std::mutex> lock(mutex);
      BlockInfo& b = blocks[block];
      if (is_write) b.valid = false;  // until this write completes
      ++b.inflight;
      ++pending_ops;
      for (auto* r : reqs) queue.push_back(r);
    }
    if (reqs.empty()) {  // zero bytes: complete at once
      raw->remaining = 1;
      auto* r = new Request{};
      r->op = raw;
      r->length = 0;
      complete(r, 0);
      return TransferHandle(event);
    }
    cv.notify_all();
    return TransferHandle(event);
  }
};

NvmeEngine::NvmeEngine(NvmeEngineOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

NvmeEngine::~NvmeEngine() = default;

NvmeBlock NvmeEngine::allocate(std::uint64_t bytes) {
  auto& m = *impl_;
  const std::size_t P = m.fds.size();
  BlockInfo b;
  b.bytes = allocator::round_up(bytes == 0 ? kAlign : bytes, kAlign);
  b.offsets.assign(P, 0);
  b.lengths = m.lengths_of(bytes);
  std::lock_guard<std::mutex> lock(m.mutex);
  auto undo = [&](std::size_t upto) {
    for (std::size_t q = 0; q < upto; ++q)
      if (b.lengths[q]) m.space[q].free(b.offsets[q], b.lengths[q]);
  };
  for (std::size_t p = 0; p < P; ++p) {
    if (b.lengths[p] == 0) continue;
    if (!m.space[p].allocate(b.lengths[p], &b.offsets[p])) {
      undo(p);
      throw out_of_memory("NVMe tier full: cannot place " + format_bytes(bytes) + " in " + m.files[p] + " (" +
                          format_bytes(m.st.bytes_in_use) + " in use, TIERFLOW_NVME_MEMORY caps each file at " +
                          format_bytes(m.o.bytes_per_path) +
                          "); raise TIERFLOW_NVME_MEMORY or add paths to TIERFLOW_NVME_PATHS");
    }
    // Note [NVMe space]: the file grows before anything is written past its end.
    std::string why;
    if (int rc = m.grow_locked(p, b.offsets[p] + b.lengths[p], false, &why); rc != 0) {
      undo(p + 1);
      std::string what = "NVMe tier full: cannot grow " + m.files[p] + " to hold " + format_bytes(bytes) + " more (" +
                         format_bytes(m.st.bytes_in_use) + " in use): " + why +
                         "; free space, add a path to TIERFLOW_NVME_PATHS or set TIERFLOW_NVME_MEMORY";
      if (rc == ENOSPC || rc == EDQUOT || rc == EFBIG) throw out_of_memory(what);
      throw io_error(rc, what);
    }
  }
  for (std::size_t p = 0; p < P; ++p) {
    m.st.bytes_in_use += b.lengths[p];
    m.in_use[p] += b.lengths[p];
  }
  m.window_peak = std::max(m.window_peak, m.st.bytes_in_use);
  NvmeBlock id = m.next_block++;
  m.blocks.emplace(id, std::move(b));
  return id;
}

void NvmeEngine::reserve(const std::vector<std::uint64_t>& block_sizes) {
  auto& m = *impl_;
  const std::size_t P = m.fds.size();
  std::vector<std::uint64_t> need(P, 0);
  std::uint64_t total = 0;
  for (auto bytes : block_sizes) {
    auto l = m.lengths_of(bytes);
    for (std::size_t p = 0; p < P; ++p) need[p] += l[p];
    total += bytes;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  const std::vector<std::uint64_t> before = m.on_disk;
  for (std::size_t p = 0; p < P; ++p) {
    if (need[p] == 0) continue;
    // Past the highest block in use, so that these blocks fit however the free list is cut.
    const std::uint64_t end = m.space[p].tail_start() + need[p];
    std::string why;
    int rc = end > m.o.bytes_per_path
                 ? (why = "TIERFLOW_NVME_MEMORY caps each file at " + format_bytes(m.o.bytes_per_path), ENOSPC)
                 : m.grow_locked(p, end, true, &why);
    if (rc != 0) {
      for (std::size_t q = 0; q < P; ++q) m.shrink_locked(q, before[q]);
      throw io_error(rc, "NVMe tier: cannot reserve " + format_bytes(need[p]) + " in " + m.files[p] + " (" +
                             format_bytes(total) + " over " + std::to_string(P) + " path" + (P > 1 ? "s" : "") +
                             "; the file now holds " + format_bytes(before[p]) + "): " + why +
                             "; free space, add a path to TIERFLOW_NVME_PATHS or set TIERFLOW_NVME_MEMORY");
    }
  }
}

void NvmeEngine::release(NvmeBlock block) noexcept {
  auto& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mutex);
  auto it = m.blocks.find(block);
  if (it == m.blocks.end()) return;
  m.idle.wait(lock, [&] { return m.blocks[block].inflight == 0; });
  BlockInfo& b = m.blocks[block];
  for (std::size_t p = 0; p < b.offsets.size(); ++p) {
    if (b.lengths[p]) m.space[p].free(b.offsets[p], b.lengths[p]);
    m.st.bytes_in_use -= b.lengths[p];
    m.in_use[p] -= b.lengths[p];
  }
  m.blocks.erase(block);
}

TransferHandle NvmeEngine::write(NvmeBlock block, const void* src, std::uint64_t bytes) {
  return impl_->submit(block, true, const_cast<void*>(src), bytes);
}

TransferHandle NvmeEngine::read(NvmeBlock block, void* dst, std::uint64_t bytes) {
  return impl_->submit(block, false, dst, bytes);
}

bool NvmeEngine::valid(NvmeBlock block) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->blocks.find(block);
  return it != impl_->blocks.end() && it->second.valid;
}

std::uint64_t NvmeEngine::available_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const Impl& m = *impl_;
  std::uint64_t least = ~std::uint64_t{0};
  for (std::size_t p = 0; p < m.files.size(); ++p) {
    std::string unused;
    const std::uint64_t room = m.growable(p, &unused);
    const std::uint64_t reach = room > m.o.bytes_per_path - m.on_disk[p] ? m.o.bytes_per_path : m.on_disk[p] + room;
    least = std::min(least, reach > m.in_use[p] ? reach - m.in_use[p] : 0);
  }
  return m.files.empty() ? 0 : least / kAlign * kAlign * m.files.size();
}

NvmeEngineStats NvmeEngine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->st;
}

std::uint64_t NvmeEngine::take_in_use_window_peak() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  const std::uint64_t w = std::max(impl_->window_peak, impl_->st.bytes_in_use);
  impl_->window_peak = impl_->st.bytes_in_use;
  return w;
}

std::vector<std::string> NvmeEngine::files() const { return impl_->files; }

std::vector<NvmeExtent> NvmeEngine::extents(NvmeBlock block) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->blocks.find(block);
  if (it == impl_->blocks.end()) throw logic_error("NvmeEngine: unknown block " + std::to_string(block));
  std::vector<NvmeExtent> out;
  for (std::size_t p = 0; p < it->second.lengths.size(); ++p)
    if (it->second.lengths[p]) out.push_back({impl_->files[p], it->second.offsets[p], it->second.lengths[p]});
  return out;
}

void NvmeEngine::unlink_files() noexcept { impl_->unlink_all(); }

std::size_t NvmeEngine::remove_stale_files(const std::vector<std::string>& paths) {
  return detail::remove_stale_swap_files(paths);
}

}  // namespace tierflow::swap
