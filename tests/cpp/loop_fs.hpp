// A small ext4 file system on a loop device, for a real ENOSPC in the NVMe
// tests. Needs root and loop devices: ok() is false otherwise and why() says
// which is missing, for the test's GTEST_SKIP (or its injected-fault path).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace tierflow::testing {

class LoopFs {
 public:
  LoopFs(const std::string& dir, int mib) : image_(dir + "/fs.img"), mount_(dir + "/mnt") {
    if (geteuid() != 0) {
      why_ = "needs root to mount a loop file system";
      return;
    }
    std::filesystem::create_directories(mount_);
    const std::string cmd = "truncate -s " + std::to_string(mib) + "M " + image_ + " && mkfs.ext4 -q -F " + image_ +
                            " >/dev/null 2>&1 && mount -o loop " + image_ + " " + mount_ + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      why_ = "mount -o loop of a " + std::to_string(mib) + " MiB ext4 image failed (no loop device here?)";
      return;
    }
    mounted_ = true;
  }
  ~LoopFs() {
    if (mounted_) (void)std::system(("umount " + mount_).c_str());
    std::error_code ec;
    std::filesystem::remove(image_, ec);
  }
  LoopFs(const LoopFs&) = delete;
  LoopFs& operator=(const LoopFs&) = delete;

  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }
  const std::string& path() const { return mount_; }
  std::uint64_t free_bytes() const { return stat().f_bavail * stat().f_frsize; }
  std::uint64_t size_bytes() const { return stat().f_blocks * stat().f_frsize; }

  /// Fills the file system with a ballast file until `leave` bytes stay free.
  void fill(std::uint64_t leave) {
    const std::uint64_t free = free_bytes();
    int fd = ::open((mount_ + "/ballast").c_str(), O_CREAT | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_GT(free, leave);
    ASSERT_EQ(posix_fallocate(fd, 0, static_cast<off_t>(free - leave)), 0);
    ::close(fd);
  }
  /// Removes the ballast of fill().
  void empty() { std::filesystem::remove(mount_ + "/ballast"); }

 private:
  struct statvfs stat() const {
    struct statvfs s {};
    statvfs(mount_.c_str(), &s);
    return s;
  }
  std::string image_, mount_, why_;
  bool mounted_ = false;
};

}  // namespace tierflow::testing
