// Host buffers aligned for O_DIRECT I/O (address and length multiples of the block).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierflow::allocator {

/// Alignment O_DIRECT needs on every Linux file system tierflow supports.
inline constexpr std::size_t kDirectIoAlignment = 4096;

/// Rounds `n` up to a multiple of `alignment` (a power of two).
constexpr std::size_t round_up(std::size_t n, std::size_t alignment) noexcept {
  return (n + alignment - 1) & ~(alignment - 1);
}

/// True when `p` is a multiple of `alignment`.
inline bool is_aligned(const void* p, std::size_t alignment) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) & (alignment - 1)) == 0;
}

/// Owning, move-only host buffer whose address and capacity are multiples of
/// kDirectIoAlignment, zero-filled on creation.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  /// Allocates at least `bytes` (rounded up to the alignment); throws out_of_memory.
  explicit AlignedBuffer(std::size_t bytes, std::size_t alignment = kDirectIoAlignment);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  /// Start of the buffer.
  std::byte* data() noexcept { return data_; }
  /// Start of the buffer.
  const std::byte* data() const noexcept { return data_; }
  /// Usable bytes (the rounded-up size).
  std::size_t capacity() const noexcept { return capacity_; }
  /// Alignment of data() and capacity().
  std::size_t alignment() const noexcept { return alignment_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t alignment_ = kDirectIoAlignment;
};

}  // namespace tierflow::allocator
