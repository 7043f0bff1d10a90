// The parts of tierflow._C (python_module.cpp defines the module and calls
// each part's bind_ function; the shared converters live there too). Private
// to bindings/src: nothing outside the extension includes it.
#pragma once

#include <pybind11/pybind11.h>

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "tierflow/core/stats.hpp"
#include "tierflow/optimizer/cpu_adam.hpp"

namespace tierflow::bindings {
class Runtime;
}  // namespace tierflow::bindings

namespace tierflow::bindings::pymod {

// Converters shared by the parts (python_module.cpp).
pybind11::dict stat_dict(const StatValues& v);
/// The fields of `s` named in its table (Note [Stat fields]).
template <class T>
pybind11::dict stat_dict(const T& s, const std::vector<StatField<T>>& fields) {
  pybind11::dict d;
  for (const auto& f : fields) {
    if (f.count && f.scale == 0.0) d[f.name] = s.*(f.count);
    else d[f.name] = f.of(s);
  }
  return d;
}
at::ScalarType dtype_from_name(const std::string& name);
optimizer::AdamOptions adam_options(const pybind11::dict& d);
pybind11::dict runtime_stats(const Runtime& rt);
std::map<std::string, std::string> to_string_map(const pybind11::dict& d);

void bind_optimizer_kernels(pybind11::module_& m);  // optimizer_bindings.cpp: the Adam kernels for Python
void bind_runtime(pybind11::module_& m);            // runtime_bindings.cpp: Runtime, transfers, fault hooks
void bind_grad_stream(pybind11::module_& m);        // grad_stream_bindings.cpp: GradStream and its sizing

}  // namespace tierflow::bindings::pymod
