// GradStream's per-slot and per-bucket records, shared by grad_stream.cpp
// (backward: hooks, copies, the worker) and grad_stream_step.cpp (step(): the
// confirmation, the weights back, the user's clip). Private to bindings/src.
#pragma once

#if __has_include(<torch/csrc/autograd/node.h>)
#include <torch/csrc/autograd/node.h>
#else  // torch before 2.12 (a GPU image's 2.11) declares Node in function.h
#include <torch/csrc/autograd/function.h>
#endif
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "tierflow/bindings/dtypes.hpp"
#include "tierflow/bindings/grad_content.hpp"
#include "tierflow/bindings/grad_stream.hpp"

namespace tierflow::bindings {


// The tensors of a slot; its host arrays and copies are the engine's, what happens to its step the ledger's.
struct GradStream::Slot {
  at::Tensor param;
  // FSDP2 (add_fed_parameter): the DTensor parameter whose .grad is this slot's gradient; `param` is its local
  // tensor, whose .grad the feed keeps at that gradient's local tensor (identity_of).
  at::Tensor owner;
  at::Tensor home;  // the parameter's host copy when it lives on the host between uses (set_home)
  // kept alive: autograd reuses it, with our hook. An intrusive_ptr from torch 2.12 on, a shared_ptr before
  // (a GPU image's torch 2.11): the type grad_accumulator returns.
  decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
  std::uintptr_t hook_key = 0;
  at::Tensor step;  // the state's step counter (shared with the Python state dict)
  // This window.
  at::Tensor grad_ref;
  ContentProbe streamed_content;  // of the gradient that streamed, not released (Note [Gradient content])
  // A released gradient's storage, to see when it is freed (grad_bytes_freed).
  std::unique_ptr<c10::weak_intrusive_ptr<c10::StorageImpl>> grad_storage;
  std::size_t grad_bytes = 0;
  bool freed_counted = false;
  at::Tensor norm;            // clip_grad_norm_'s per-tensor norm of the released gradient
  // What tierflow last wrote into the parameter (Note [Weight content]): a write of the user's since then
  // (p.data edits) makes the master stale for this parameter.
  ContentProbe written;
  bool probe_after_upload = false;  // CUDA: probe the parameter once the compute stream waits for `upload`
};

/// `t` (contiguous, on the host) as the engine's array; the array keeps `t`.
optimizer::HostArray host_array(const at::Tensor& t);
/// The tensor of `dtype` over array `a` (one host_array or GradStream::allocate made, or a slice of one):
/// the very tensor when `a` is all of it in its dtype; undefined for an undefined array.
at::Tensor tensor_of(const optimizer::HostArray& a, at::ScalarType dtype);
/// The torch dtype of a kernel type.
at::ScalarType torch_type(optimizer::ScalarType t) noexcept;

}  // namespace tierflow::bindings
