// What the test binaries know about the sanitizer they were built with
// (scripts/sanitize.sh). A test that changes its shape under one says why.
#pragma once

namespace tierflow::testing {

#if defined(__SANITIZE_THREAD__)
/// Built with -fsanitize=thread. oneTBB's synchronization is invisible to TSan
/// (tests/sanitizers/tsan.supp), so every element a TBB worker reads is a
/// suppressed report that still costs a stack restore: a kernel over 10^5
/// elements on TBB workers takes minutes. Tests of code around the kernel run
/// it on one thread there (a one-slot arena has no workers), keeping the
/// threads of their own under TSan's eye.
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

/// CPU Adam threads for a test whose subject is not the kernel's parallelism.
inline constexpr int kAdamThreads = kThreadSanitizer ? 1 : 2;

}  // namespace tierflow::testing
