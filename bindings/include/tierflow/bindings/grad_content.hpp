// A gradient's content (Note [Gradient content] in optimizer/grad_content.hpp)
// computed where the gradient lives: in one pass on the host (or the emulated
// device), by a few kernels queued on the current stream on a GPU, read later.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "tierflow/optimizer/grad_content.hpp"

namespace tierflow::bindings {

/// The content of one gradient, known now or once its device result is read (resolve).
class ContentProbe {
 public:
  ContentProbe() = default;
  /// Probes `grad`: a contiguous float32, bfloat16 or float16 tensor (anything else: not known, which
  /// compares unequal). A host tensor is read now; a CUDA one's sums are queued on its current stream.
  static ContentProbe of(const at::Tensor& grad);
  bool pending() const noexcept { return slabs_.defined(); }
  /// The content (reads a pending device result: prefer resolve() for many).
  optimizer::GradContent get();
  /// Reads every pending probe's device result with one transfer per device.
  static void resolve(const std::vector<ContentProbe*>& probes);

 private:
  optimizer::GradContent content_;
  at::Tensor slabs_;  // [2, slabs] on the device: each slab's sum and weighted sum, uint64 bits (pending)
};

}  // namespace tierflow::bindings
