// Swap files: created, locked, and removed when stale (Note [Stale swap files] in nvme_engine.hpp).
#include "swap_files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "tierflow/core/error.hpp"
#include "tierflow/core/log.hpp"

namespace tierflow::swap::detail {
namespace {

// Swap files this process created and has not removed. Their locks already
// keep them (Note [Stale swap files]); this also keeps them where flock is
// emulated with per-process locks (NFS), which this process could take again.
std::mutex g_live_mutex;
std::set<std::string> g_live_files;
constexpr const char* kPrefix = "tierflow-swap-";

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

std::pair<int, std::string> create_locked_swap_file(const std::string& dir, const std::string& name_tag) {
  static std::atomic<int> counter{0};
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex rng_mutex;
  for (int attempt = 0;; ++attempt) {
    std::uint64_t tag;
    {
      std::lock_guard<std::mutex> lock(rng_mutex);
      tag = rng() & 0xffffffffu;
    }
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08llx", static_cast<unsigned long long>(tag));
    std::string file = dir + "/" + kPrefix + name_tag + std::to_string(getpid()) + "-" + std::to_string(counter++) +
                       "-" + hex + ".bin";
    int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
      int err = errno;
      if (err == EEXIST && attempt < 16) continue;
      // Some file systems (ramfs) create the file and then refuse O_DIRECT: the name is ours (O_EXCL).
      if (err != EEXIST) (void)::unlink(file.c_str());
      throw io_error(err, "TIERFLOW_NVME_PATHS (keyword nvme_paths): the directory '" + dir +
                              "' cannot hold a swap file: open(" + file + ", O_DIRECT) failed: " + errno_text(err) +
                              (err == EINVAL ? " (the file system does not support O_DIRECT)" : "") +
                              "; accepted: existing, writable directories on file systems that support O_DIRECT "
                              "(ext4, xfs on an NVMe SSD; not ramfs)");
    }
    bool ours = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    int lock_err = ours ? 0 : errno;
    struct stat by_fd {}, by_name {};
    // A cleaner may have judged the file between open and flock: then the lock
    // was taken (EWOULDBLOCK) or the name is gone; start again under a new name.
    if (ours && (::fstat(fd, &by_fd) != 0 || ::stat(file.c_str(), &by_name) != 0 || by_fd.st_ino != by_name.st_ino ||
                 by_fd.st_dev != by_name.st_dev)) {
      ours = false;
      lock_err = ENOENT;
    }
    if (ours) {
      std::lock_guard<std::mutex> lock(g_live_mutex);
      g_live_files.insert(file);
      return {fd, file};
    }
    ::close(fd);
    if (lock_err != EWOULDBLOCK && lock_err != ENOENT)
      throw io_error(lock_err, "NvmeEngine: flock(" + file + ") failed: " + errno_text(lock_err));
    if (attempt >= 16) throw io_error(lock_err, "NvmeEngine: could not create a swap file in " + dir);
  }
}

void forget_swap_file(const std::string& path) noexcept {
  std::lock_guard<std::mutex> lock(g_live_mutex);
  g_live_files.erase(path);
}

std::size_t remove_stale_swap_files(const std::vector<std::string>& paths) {
  // Note [Stale swap files]: a file is stale when its lock can be taken.
  std::size_t removed = 0;
  const std::string prefix = kPrefix;
  for (const auto& dir : paths) {
    DIR* d = ::opendir(dir.c_str());
    if (!d) continue;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.rfind(prefix, 0) != 0) continue;
      const std::string path = dir + "/" + name;
      {
        std::lock_guard<std::mutex> lock(g_live_mutex);
        if (g_live_files.count(path)) continue;  // ours
      }
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
      if (fd < 0) continue;  // gone already, or not ours to judge
      struct stat by_fd {}, by_name {};
      const bool stale = ::fstat(fd, &by_fd) == 0 && S_ISREG(by_fd.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
                         ::stat(path.c_str(), &by_name) == 0 && by_fd.st_ino == by_name.st_ino &&
                         by_fd.st_dev == by_name.st_dev;
      if (stale && ::unlink(path.c_str()) == 0) {
        ++removed;
        log(LogLevel::kInfo, "removed a swap file that no running engine holds (a crashed run's): " + path);
      }
      ::close(fd);  // lets go of the lock
    }
    ::closedir(d);
  }
  return removed;
}

}  // namespace tierflow::swap::detail
