// The runtime's own small host allocations (handles, bookkeeping), served by
// mimalloc when its library can be loaded, else by the C library.
//
// Note [mimalloc shim]
// ~~~~~~~~~~~~~~~~~~~~
// Debian's libmimalloc.so is built to override malloc/free and operator
// new/delete. Linking it into an extension that Python dlopens splits the
// process between two heaps (memory from one freed by the other) and crashes
// at import. So tierflow never links it: on first use it dlopens the library
// with RTLD_LOCAL | RTLD_DEEPBIND, which keeps its overriding symbols out of
// every other library's lookup, and calls only the mi_* entry points through
// dlsym. Without the library, with TIERFLOW_MIMALLOC=off, or in a sanitizer
// build (which must see every allocation, and whose ASan runtime aborts on
// RTLD_DEEPBIND) the same calls fall back to posix_memalign/free. Memory
// must be freed through small_free().
#pragma once

#include <cstddef>
#include <new>

namespace tierflow::allocator {

/// Allocates `bytes` aligned to `alignment` (a power of two); nullptr on failure.
void* small_malloc(std::size_t bytes, std::size_t alignment = alignof(std::max_align_t)) noexcept;
/// Frees memory from small_malloc (nullptr is ignored).
void small_free(void* p) noexcept;
/// True when mimalloc serves small_malloc in this process.
bool mimalloc_active() noexcept;
/// True in a build made with -fsanitize=address or thread (mimalloc is never loaded there).
bool built_with_sanitizer() noexcept;

/// STL allocator over small_malloc, for std::allocate_shared and containers.
template <class T>
struct SmallAllocator {
  using value_type = T;
  SmallAllocator() noexcept = default;
  template <class U>
  SmallAllocator(const SmallAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    void* p = small_malloc(n * sizeof(T), alignof(T) > alignof(std::max_align_t) ? alignof(T)
                                                                                  : alignof(std::max_align_t));
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { small_free(p); }
  template <class U>
  bool operator==(const SmallAllocator<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const SmallAllocator<U>&) const noexcept { return false; }
};

}  // namespace tierflow::allocator
