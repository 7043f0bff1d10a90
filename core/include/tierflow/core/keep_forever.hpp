// Memory kept for good after a stall (Note [Stall timeout] in stall.hpp): what a stalled copy or request may still
// read or write is never freed. It is held in one list for the rest of the process, reachable, so LeakSanitizer
// does not report what is kept on purpose, and each keeping is counted and named in one warning.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tierflow {

/// Keeps `memory` alive for the rest of the process: memory a stalled copy or request may still read or write,
/// given up at teardown. Logs one warning naming `what` ("a gradient bucket of 4.00 MiB").
void keep_forever(std::shared_ptr<void> memory, std::uint64_t bytes, const std::string& what) noexcept;
/// Keeps every one of `pieces` alive for the rest of the process, counted as one keeping of `bytes` with one
/// warning naming `what` ("3 staged block(s) of 12.0 MiB ...").
void keep_forever(std::vector<std::shared_ptr<void>> pieces, std::uint64_t bytes, const std::string& what) noexcept;
/// Bytes kept for good so far, and how many keepings.
std::uint64_t kept_forever_bytes() noexcept;
std::size_t kept_forever_count() noexcept;
/// Counts `bytes` as kept for good (memory kept some other way, e.g. by leaking its owner), logging one
/// warning naming `what`.
void note_kept_forever(std::uint64_t bytes, const std::string& what) noexcept;

}  // namespace tierflow
