// A keyword constructor for a bound struct (private to bindings/src: planner_bindings.cpp, prediction_bindings.cpp
// and plan_driver_bindings.cpp, which bind into the two extensions, Note [Two extensions] in core_module.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::bindings {

// A keyword constructor: every keyword must name a field (a typo must not pass silently).
template <typename T>
void init_from_kwargs(pybind11::class_<T>& cls) {
  cls.def(pybind11::init([cls](const pybind11::kwargs& kwargs) {
            T value{};
            pybind11::object obj = pybind11::cast(value);
            for (auto item : kwargs) {
              const auto key = item.first.cast<std::string>();
              if (!pybind11::hasattr(cls, key.c_str()) || key.rfind('_', 0) == 0) {
                throw config_error(std::string(pybind11::str(cls.attr("__name__"))) + ": unknown field '" + key +
                                   "'");
              }
              obj.attr(key.c_str()) = item.second;
            }
            return obj.cast<T>();
          }),
          "Keyword arguments set fields of the same name; the others keep their defaults.");
}

}  // namespace tierflow::bindings
