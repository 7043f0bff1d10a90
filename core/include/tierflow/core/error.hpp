// Error hierarchy and checking macros shared by every layer.
//
// User mistakes (a bad configuration value, an optimizer tierflow cannot
// replace) are `config_error` / `logic_error`; internal invariants use
// TIERFLOW_EXPECTS as well but name the invariant; I/O results become
// `io_error` carrying errno. `out_of_memory` is thrown only when a tier's
// budget or capacity is truly exhausted. Destructors never throw.
#pragma once

#include <cerrno>
#include <new>
#include <stdexcept>
#include <string>

namespace tierflow {

/// Violated precondition or invariant; the message says which.
class logic_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// A `TIERFLOW_*` variable or keyword argument that is unknown or malformed.
class config_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A CUDA runtime call failed; carries the CUDA error code.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(int code, const std::string& what) : std::runtime_error(what), code_(code) {}
  /// The cudaError_t value, as an int so this header needs no CUDA.
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A file or block-device operation failed; carries errno.
class io_error : public std::runtime_error {
 public:
  io_error(int err, const std::string& what) : std::runtime_error(what), errno_(err) {}
  /// The errno value of the failed call.
  int error_number() const noexcept { return errno_; }

 private:
  int errno_;
};

/// A tier's budget or capacity cannot satisfy an allocation.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

namespace detail {
[[noreturn]] void throw_logic_error(const char* file, int line, const std::string& msg);
[[noreturn]] void throw_io_error(const char* file, int line, int err, const std::string& msg);
/// Formats "file:line: msg" for use in exception texts.
std::string where(const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace tierflow

/// Throws tierflow::logic_error with file:line when `cond` is false.
#define TIERFLOW_EXPECTS(cond, msg)                                                  \
  do {                                                                               \
    if (!(cond)) ::tierflow::detail::throw_logic_error(__FILE__, __LINE__, (msg));   \
  } while (0)

/// Throws tierflow::io_error with errno and file:line when `cond` is false.
#define TIERFLOW_CHECK_IO(cond, msg)                                                 \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      int tierflow_saved_errno_ = errno;                                             \
      ::tierflow::detail::throw_io_error(__FILE__, __LINE__, tierflow_saved_errno_,  \
                                         (msg));                                     \
    }                                                                                \
  } while (0)
