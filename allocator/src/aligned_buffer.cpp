#include "tierflow/allocator/aligned_buffer.hpp"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "tierflow/core/error.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow::allocator {

AlignedBuffer::AlignedBuffer(std::size_t bytes, std::size_t alignment)
    : capacity_(round_up(bytes == 0 ? alignment : bytes, alignment)), alignment_(alignment) {
  TIERFLOW_EXPECTS(alignment != 0 && (alignment & (alignment - 1)) == 0,
                   "AlignedBuffer: alignment must be a power of two, got " + std::to_string(alignment));
  void* p = nullptr;
  if (posix_memalign(&p, alignment, capacity_) != 0) {
    throw out_of_memory("AlignedBuffer: could not allocate " + format_bytes(capacity_));
  }
  std::memset(p, 0, capacity_);
  data_ = static_cast<std::byte*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)),
      alignment_(other.alignment_) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
    alignment_ = other.alignment_;
  }
  return *this;
}

}  // namespace tierflow::allocator
