#include "tierflow/core/error.hpp"

#include <cstring>

namespace tierflow::detail {

std::string where(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  return std::string(base ? base + 1 : file) + ":" + std::to_string(line) + ": " + msg;
}

void throw_logic_error(const char* file, int line, const std::string& msg) {
  throw logic_error(where(file, line, msg));
}

void throw_io_error(const char* file, int line, int err, const std::string& msg) {
  throw io_error(err, where(file, line, msg + ": " + std::strerror(err)));
}

}  // namespace tierflow::detail
