// A C++ struct's fields as a Python dict (private to bindings/src, torch-free: both extensions use it, Note [Two
// extensions] in core_module.cpp): the keys in the order given, each read by a member pointer or a callable of the
// struct, so that a binding names each field once instead of writing `d["key"] = s.key;` per field.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <initializer_list>
#include <type_traits>

namespace tierflow::bindings {

/// One dict entry of a `T`: its key and how to read it.
template <typename T>
struct DictField {
  const char* key;
  std::function<pybind11::object(const T&)> read;

  /// The member `member` of the struct, e.g. {"step_ms", &WindowTimeline::step_ms}.
  template <typename M>
  DictField(const char* k, M T::*member) : key(k), read([member](const T& v) { return pybind11::cast(v.*member); }) {}
  /// What `of` makes of the struct, e.g. {"nvme_bytes", [](const StepCounters& c) { return c.nvme.current; }}.
  template <typename F, typename = std::enable_if_t<!std::is_member_pointer_v<F> && std::is_invocable_v<F, const T&>>>
  DictField(const char* k, F of) : key(k), read([of](const T& v) { return pybind11::cast(of(v)); }) {}
};

/// `value`'s `fields` added to `into` (a new dict by default), in order.
template <typename T>
pybind11::dict struct_dict(const T& value, std::initializer_list<DictField<T>> fields,
                           pybind11::dict into = pybind11::dict()) {
  for (const auto& f : fields) into[f.key] = f.read(value);
  return into;
}

}  // namespace tierflow::bindings
