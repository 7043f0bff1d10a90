// Memory kept for good after a stall; see keep_forever.hpp and Note [Stall timeout] in stall.hpp.
#include "tierflow/core/keep_forever.hpp"

#include <atomic>
#include <mutex>
#include <utility>

#include "tierflow/core/log.hpp"

namespace tierflow {
namespace {
std::atomic<std::uint64_t> g_kept_bytes{0};
std::atomic<std::size_t> g_kept_count{0};

// Adds `pieces` to the list kept for the rest of the process; false when even the list has no room (the memory
// is then freed when the caller's pointers go: nothing else can be done).
bool hold(std::vector<std::shared_ptr<void>>& pieces) noexcept {
  try {
    // Deliberately never freed, and reachable from here (no leak report under LeakSanitizer: it is kept).
    static std::mutex kept_mutex;
    static auto* kept = new std::vector<std::shared_ptr<void>>();
    std::lock_guard<std::mutex> lock(kept_mutex);
    kept->reserve(kept->size() + pieces.size());
    for (auto& p : pieces)
      if (p) kept->push_back(std::move(p));
  } catch (...) {
    return false;
  }
  return true;
}
}  // namespace

void note_kept_forever(std::uint64_t bytes, const std::string& what) noexcept {
  g_kept_bytes += bytes;
  ++g_kept_count;
  try {
    log(LogLevel::kWarn, "tierflow: " + what + " is kept for good (not freed): a stalled copy or request may "
                         "still read or write it (Note [Stall timeout])");
  } catch (...) {
  }
}

void keep_forever(std::vector<std::shared_ptr<void>> pieces, std::uint64_t bytes, const std::string& what) noexcept {
  if (hold(pieces)) note_kept_forever(bytes, what);
}

void keep_forever(std::shared_ptr<void> memory, std::uint64_t bytes, const std::string& what) noexcept {
  if (!memory) return;
  std::vector<std::shared_ptr<void>> one;
  try {
    one.push_back(std::move(memory));
  } catch (...) {
    return;  // no room even for the holder: the memory is freed when `memory` goes
  }
  keep_forever(std::move(one), bytes, what);
}

std::uint64_t kept_forever_bytes() noexcept { return g_kept_bytes.load(); }
std::size_t kept_forever_count() noexcept { return g_kept_count.load(); }

}  // namespace tierflow
