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


// The tensors and transfers of a slot; what happens to its step is the ledger's.
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
  // The optimizer state (shared with the Python state dict).
  at::Tensor master, exp_avg, exp_avg_sq, max_exp_avg_sq, step;
  // This window.
  at::Tensor grad_ref, host_grad;
  ContentProbe streamed_content;  // of the gradient that streamed, not released (Note [Gradient content])
  swap::TransferHandle copy;  // of its gradient to host_grad
  std::uint64_t copy_seq = 0; // submission order of `copy` (begin_clip)
  // A released gradient's storage, to see when it is freed (grad_bytes_freed).
  std::unique_ptr<c10::weak_intrusive_ptr<c10::StorageImpl>> grad_storage;
  std::size_t grad_bytes = 0;
  bool freed_counted = false;
  at::Tensor norm;            // clip_grad_norm_'s per-tensor norm of the released gradient
  at::Tensor out_master, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, staging;
  // What tierflow last wrote into the parameter (Note [Weight content]): a write of the user's since then
  // (p.data edits) makes the master stale for this parameter.
  ContentProbe written;
  bool probe_after_upload = false;  // CUDA: probe the parameter once the compute stream waits for `upload`
  bool master_stale = false;        // the user wrote it: stepped from p (its master re-read) before any early step
  // Its weights on the way back.
  swap::TransferHandle upload;
  bool upload_pending = false;
  std::uint64_t upload_seq = 0;
};

struct GradStream::Bucket {
  at::Tensor buffer;  // pinned, this window
  std::vector<swap::TransferHandle> copies;
};

struct GradStream::Entry {
  std::size_t slot = 0;
  optimizer::AdamOptions options;
  std::int64_t step = 0;
  bool held = false;  // no memory for the out-of-place outputs: steps in step()
  at::Tensor host_grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq;
  at::Tensor out_master, out_exp_avg, out_exp_avg_sq, out_max_exp_avg_sq, staging;
};

}  // namespace tierflow::bindings
