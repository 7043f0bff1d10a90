// The planner's Python surface (tiering/planner.hpp, tiering/transformer_profile.hpp), added to tierflow._C.
#pragma once

#include <pybind11/pybind11.h>

namespace tierflow::bindings {

/// Registers the planner's types and functions on `m`.
void bind_planner(pybind11::module_& m);

}  // namespace tierflow::bindings
