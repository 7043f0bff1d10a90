// See Note [Stall timeout] in stall.hpp.
#include "tierflow/core/stall.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/core/size.hpp"
#include "tierflow/core/trace.hpp"

namespace tierflow {
namespace {
std::atomic<double> g_timeout{kDefaultStallTimeout};
std::atomic<bool> g_stall_seen{false};

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}
}  // namespace

// A doubly linked list of the work in flight, oldest first (work registers as it starts).
struct PendingRegistry {
  std::mutex mutex;
  PendingWork* head = nullptr;
  PendingWork* tail = nullptr;

  static PendingRegistry& get() {
    static PendingRegistry* r = new PendingRegistry();  // never destroyed: work may finish during exit
    return *r;
  }
  void add(PendingWork* w) {
    std::lock_guard<std::mutex> lock(mutex);
    w->prev_ = tail;
    w->next_ = nullptr;
    (tail ? tail->next_ : head) = w;
    tail = w;
    w->listed_ = true;
  }
  void remove(PendingWork* w) noexcept {
    std::lock_guard<std::mutex> lock(mutex);
    if (!w->listed_) return;
    (w->prev_ ? w->prev_->next_ : head) = w->next_;
    (w->next_ ? w->next_->prev_ : tail) = w->prev_;
    w->listed_ = false;
  }
};

namespace {
thread_local bool t_unlimited = false;
}  // namespace

void set_stall_timeout(double seconds) noexcept { g_timeout.store(seconds); }
double stall_timeout() noexcept { return t_unlimited ? 0.0 : g_timeout.load(); }

UnlimitedWaits::UnlimitedWaits() noexcept : before_(t_unlimited) { t_unlimited = true; }
UnlimitedWaits::~UnlimitedWaits() { t_unlimited = before_; }

std::chrono::steady_clock::time_point stall_deadline(std::chrono::steady_clock::time_point since) noexcept {
  const double s = stall_timeout();
  if (!(s > 0)) return std::chrono::steady_clock::time_point::max();
  return since + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

std::chrono::steady_clock::time_point PendingWork::deadline() const noexcept { return stall_deadline(since_); }

bool stall_seen() noexcept { return g_stall_seen.load(); }

namespace {
std::mutex g_claim_mutex;
std::size_t g_claims = 0;
double g_claimed = 0;

std::string limit_text(double s) { return s > 0 ? seconds_text(s) : std::string("none"); }
}  // namespace

StallTimeoutClaim::StallTimeoutClaim(double seconds) {
  std::lock_guard<std::mutex> lock(g_claim_mutex);
  if (g_claims > 0 && g_claimed != seconds)
    throw config_error("TIERFLOW_STALL_TIMEOUT (stall_timeout=): this runtime asks for " + limit_text(seconds) +
                       " but a runtime alive in this process uses " + limit_text(g_claimed) +
                       "; the limit is process-wide (Note [Stall timeout]): give every runtime the same value, "
                       "or end the other one first");
  ++g_claims;
  g_claimed = seconds;
  set_stall_timeout(seconds);
}

StallTimeoutClaim::~StallTimeoutClaim() {
  std::lock_guard<std::mutex> lock(g_claim_mutex);
  --g_claims;
}

PendingWork::PendingWork(const char* kind, std::uint64_t bytes, std::int64_t id) noexcept
    : kind_(kind), bytes_(bytes), id_(id), since_(std::chrono::steady_clock::now()) {
  try {
    PendingRegistry::get().add(this);
  } catch (...) {  // a lock that cannot be taken: the work goes unlisted, its waits still time out
  }
}

PendingWork::~PendingWork() { done(); }

void PendingWork::done() noexcept {
  if (listed_ && trace::on()) trace::work_done(kind_, bytes_, id_, since_);  // Note [Trace]: its lane's event
  PendingRegistry::get().remove(this);
}

std::string PendingWork::describe() const {
  const double age = std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
  std::string s = std::string(kind_) + " of " + format_bytes(bytes_);
  if (id_ >= 0) s += " (block " + std::to_string(id_) + ")";
  return s + ", " + seconds_text(age) + " old";
}

std::vector<std::string> PendingWork::in_flight(std::size_t max) {
  auto& r = PendingRegistry::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (PendingWork* w = r.head; w && out.size() < max; w = w->next_) out.push_back(w->describe());
  return out;
}

// The oldest work from `w` on whose end the registry learns when it comes (not a polled CUDA event, which may
// have ended unseen: Note [Stall timeout]). Under the registry's lock.
const PendingWork* oldest_known(const PendingWork* w) noexcept {
  while (w && w->polled_) w = w->next_;
  return w;
}

namespace {
// The oldest work in flight if it is past its deadline (and is not `except`): its description.
bool oldest_stalled(std::string* description, const PendingWork* except = nullptr) {
  auto& r = PendingRegistry::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  const PendingWork* w = oldest_known(r.head);
  if (!w || w == except || std::chrono::steady_clock::now() < w->deadline()) return false;
  *description = w->describe();
  return true;
}

[[noreturn]] void throw_stall_message(std::string head) {
  g_stall_seen.store(true);
  std::string msg = std::move(head) + " (TIERFLOW_STALL_TIMEOUT=" + seconds_text(g_timeout.load()) +
                    "; a healthy step comes nowhere near it: a hung device, driver or disk?). In flight, oldest "
                    "first:";
  const auto others = PendingWork::in_flight(kStallListed);
  for (const auto& o : others) msg += "\n  " + o;
  if (others.empty()) msg += " nothing else on the host's side";
  msg += "\nThe work is not cancelled; end the run (raise TIERFLOW_STALL_TIMEOUT, or 0 for no limit, if a step "
         "truly takes this long).";
  throw stall_error(msg);
}
}  // namespace

// Note [Stall timeout]: the oldest stalled work is named first; the work waited for after it.
void PendingWork::stalled(double waited_seconds) const {
  std::string oldest;
  if (!oldest_stalled(&oldest, this) || oldest.empty()) throw_stall(describe(), waited_seconds);
  throw_stall_message("tierflow: a " + oldest + " has not completed (the oldest work in flight; waited " +
                      seconds_text(waited_seconds) + " for a " + describe() + " behind it)");
}

void raise_if_stalled() {
  if (!(stall_timeout() > 0)) return;
  std::string oldest;
  if (oldest_stalled(&oldest))
    throw_stall_message("tierflow: a " + oldest + " has not completed (the oldest work in flight)");
}

std::chrono::steady_clock::time_point oldest_deadline() noexcept {
  if (!(stall_timeout() > 0)) return std::chrono::steady_clock::time_point::max();
  auto& r = PendingRegistry::get();
  std::lock_guard<std::mutex> lock(r.mutex);
  const PendingWork* w = oldest_known(r.head);
  return w ? w->deadline() : std::chrono::steady_clock::time_point::max();
}

void throw_stall(const std::string& description, double waited_seconds) {
  throw_stall_message("tierflow: waited " + seconds_text(waited_seconds) + " for a " + description +
                      ", which has not completed");
}

}  // namespace tierflow
