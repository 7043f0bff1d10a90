// See Note [mimalloc shim] in small_alloc.hpp.
#include "tierflow/allocator/small_alloc.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

namespace tierflow::allocator {
namespace {

// A sanitizer must see every allocation, and ASan aborts on RTLD_DEEPBIND.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

struct Mimalloc {
  using AllocFn = void* (*)(std::size_t, std::size_t);
  using FreeFn = void (*)(void*);
  AllocFn alloc_aligned = nullptr;
  FreeFn free = nullptr;

  Mimalloc() {
    // Read directly (allocation starts before any Config exists); the table
    // in core/ validates the same variable.
    if (kSanitized) return;
    const char* mode = std::getenv("TIERFLOW_MIMALLOC");
    if (mode && (std::string(mode) == "off" || std::string(mode) == "OFF")) return;
    void* lib = dlopen("libmimalloc.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!lib) return;
    auto a = reinterpret_cast<AllocFn>(dlsym(lib, "mi_malloc_aligned"));
    auto f = reinterpret_cast<FreeFn>(dlsym(lib, "mi_free"));
    if (a && f) {
      alloc_aligned = a;
      free = f;
    }
  }
};

const Mimalloc& mimalloc() {
  static const Mimalloc m;
  return m;
}

}  // namespace

void* small_malloc(std::size_t bytes, std::size_t alignment) noexcept {
  if (bytes == 0) bytes = 1;
  const auto& m = mimalloc();
  if (m.alloc_aligned) return m.alloc_aligned(bytes, alignment);
  void* p = nullptr;
  if (alignment < sizeof(void*)) alignment = sizeof(void*);
  return posix_memalign(&p, alignment, bytes) == 0 ? p : nullptr;
}

void small_free(void* p) noexcept {
  if (!p) return;
  const auto& m = mimalloc();
  if (m.free) m.free(p);
  else std::free(p);
}

bool mimalloc_active() noexcept { return mimalloc().alloc_aligned != nullptr; }

bool built_with_sanitizer() noexcept { return kSanitized; }

}  // namespace tierflow::allocator
