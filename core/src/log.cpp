#include "tierflow/core/log.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

namespace tierflow {
namespace {
std::atomic<LogLevel> g_level{LogLevel::kWarn};
std::mutex g_mutex;
}  // namespace

void set_log_level(LogLevel level) noexcept { g_level.store(level); }
LogLevel log_level() noexcept { return g_level.load(); }

void log(LogLevel level, std::string_view message) {
  if (static_cast<int>(level) > static_cast<int>(g_level.load())) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[tierflow %s] %.*s\n", std::string(to_string(level)).c_str(),
               static_cast<int>(message.size()), message.data());
}

}  // namespace tierflow
