// The NVMe engine's space: the free bytes of a file system and the best-fit
// free list over one swap file (Note [NVMe engine] in nvme_engine.hpp).
// Private to swap/src.
#pragma once

#include <sys/statvfs.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <utility>

namespace tierflow::swap::detail {

// Free bytes of the file system holding `dir` (for unprivileged users), and its size.
struct FsSpace {
  std::uint64_t free = 0, size = 0;
  bool known = false;
};
inline FsSpace fs_space(const std::string& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return {};
  return {static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize, static_cast<std::uint64_t>(fs.f_blocks) * fs.f_frsize,
          true};
}

// Best-fit free list over one file, coalescing on free.
class ExtentAllocator {
 public:
  explicit ExtentAllocator(std::uint64_t bytes) : capacity_(bytes) { insert(0, bytes); }
  // Where the free space that runs to the end of the capacity starts (the end
  // of the highest block in use); the capacity when the last bytes are in use.
  std::uint64_t tail_start() const {
    if (by_offset_.empty()) return capacity_;
    auto last = std::prev(by_offset_.end());
    return last->first + last->second == capacity_ ? last->first : capacity_;
  }
  bool allocate(std::uint64_t bytes, std::uint64_t* offset) {
    auto it = by_size_.lower_bound({bytes, 0});
    if (it == by_size_.end()) return false;
    auto [size, off] = *it;
    by_size_.erase(it);
    by_offset_.erase(off);
    if (size > bytes) insert(off + bytes, size - bytes);
    *offset = off;
    return true;
  }
  void free(std::uint64_t off, std::uint64_t bytes) {
    auto next = by_offset_.lower_bound(off);
    if (next != by_offset_.end() && off + bytes == next->first) {
      by_size_.erase({next->second, next->first});
      bytes += next->second;
      next = by_offset_.erase(next);
    }
    if (next != by_offset_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        by_size_.erase({prev->second, prev->first});
        off = prev->first;
        bytes += prev->second;
        by_offset_.erase(prev);
      }
    }
    insert(off, bytes);
  }

 private:
  void insert(std::uint64_t off, std::uint64_t bytes) {
    if (bytes == 0) return;
    by_offset_.emplace(off, bytes);
    by_size_.insert({bytes, off});
  }
  std::uint64_t capacity_;
  std::map<std::uint64_t, std::uint64_t> by_offset_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;
};

}  // namespace tierflow::swap::detail
