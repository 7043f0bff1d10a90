// The configuration table's rows (config_rows.cpp), shared with config.cpp's parsing; private to core.
// See Note [One configuration table] in tierflow/core/config.hpp.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/config.hpp"

namespace tierflow::config_detail {

inline constexpr std::string_view kPrefix = "TIERFLOW_";

/// One row: the public part plus the parser that stores a value into Config.
struct Row {
  ConfigEntry entry;
  std::function<void(Config&, std::string_view name, std::string_view value)> apply;
};

/// The table, in its order (docs/configuration.md lists it so).
const std::vector<Row>& rows();
/// The row of a full variable name, or null.
const Row* find_row(std::string_view name);

/// Throws config_error: `name`=`value` is not valid (`reason`, when given, says why a value of an
/// accepted-looking form is refused: "it is a directory"); accepted: `accepted`.
[[noreturn]] void bad_value(std::string_view name, std::string_view value, std::string_view accepted,
                            std::string_view reason = {});
/// The keyword of a full variable name: TIERFLOW_HOST_MEMORY -> host_memory.
std::string keyword_of(std::string_view name);
/// `s` in lower case (ASCII).
std::string lower(std::string_view s);
/// `s` without leading and trailing white space.
std::string trim(std::string_view s);

}  // namespace tierflow::config_detail
