// The optimizer states' format a Python string names, parsed as the configuration table parses
// TIERFLOW_OPTIMIZER_STATES (private to bindings/src, torch-free: the bound structs and functions that take a
// format as text share it).
#pragma once

#include <string>

#include "tierflow/core/config.hpp"
#include "tierflow/core/state_format.hpp"

namespace tierflow::bindings {

/// The format TIERFLOW_OPTIMIZER_STATES names `text` (the table's parser: "8BIT " is 8bit); ConfigError naming the
/// variable and the accepted values otherwise.
inline StateFormat state_format_of(const std::string& text) {
  return *parse_state_format(parse_setting("TIERFLOW_OPTIMIZER_STATES", text));
}

}  // namespace tierflow::bindings
