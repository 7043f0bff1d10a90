// Minimal leveled logging to stderr, controlled by TIERFLOW_LOG_LEVEL.
#pragma once

#include <string_view>

#include "tierflow/core/config.hpp"

namespace tierflow {

/// Sets the process-wide threshold; messages above it are dropped.
void set_log_level(LogLevel level) noexcept;
/// Current threshold.
LogLevel log_level() noexcept;
/// Writes "[tierflow LEVEL] message" to stderr when `level` passes the threshold.
void log(LogLevel level, std::string_view message);

}  // namespace tierflow
