// The NVMe engine's swap files: created under a fresh name and locked, known
// to this process while it holds them, and found stale by another's lock
// (Note [Stale swap files] in nvme_engine.hpp). Private to swap/src.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace tierflow::swap::detail {

/// Creates a swap file in `dir` (its name carries `name_tag`, the pid and a random part), opened for O_DIRECT
/// and held with its flock; returns (its descriptor, its path). Throws io_error naming TIERFLOW_NVME_PATHS when
/// the directory cannot hold one.
std::pair<int, std::string> create_locked_swap_file(const std::string& dir, const std::string& name_tag);

/// This process no longer holds `path` (about to be removed): remove_stale_swap_files may judge it again.
void forget_swap_file(const std::string& path) noexcept;

/// Removes the swap files in `paths` whose lock can be taken (no running engine holds them); returns how many.
std::size_t remove_stale_swap_files(const std::vector<std::string>& paths);

}  // namespace tierflow::swap::detail
