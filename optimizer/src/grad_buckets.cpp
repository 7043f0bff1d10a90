// See Note [Gradient streaming] in bindings/include/tierflow/bindings/grad_stream.hpp.
#include "tierflow/optimizer/grad_buckets.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tierflow/core/error.hpp"

namespace tierflow::optimizer {

std::vector<GradBucket> plan_grad_buckets(const std::vector<std::size_t>& bytes,
                                          const std::vector<std::size_t>& order, std::size_t bucket_bytes) {
  TIERFLOW_EXPECTS(bucket_bytes > 0, "plan_grad_buckets: bucket_bytes must be > 0");
  TIERFLOW_EXPECTS(order.size() == bytes.size(), "plan_grad_buckets: order has " + std::to_string(order.size()) +
                                                     " entries for " + std::to_string(bytes.size()) + " tensors");
  std::vector<bool> seen(bytes.size(), false);
  std::vector<GradBucket> buckets;
  for (std::size_t i : order) {
    TIERFLOW_EXPECTS(i < bytes.size() && !seen[i], "plan_grad_buckets: order is not a permutation");
    seen[i] = true;
    if (buckets.empty() || (buckets.back().bytes + bytes[i] > bucket_bytes && !buckets.back().tensors.empty()))
      buckets.emplace_back();
    buckets.back().tensors.push_back(i);
    buckets.back().bytes += bytes[i];
  }
  return buckets;
}

std::size_t auto_grad_bucket_bytes(std::size_t total_grad_bytes) noexcept {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  return std::clamp<std::size_t>(total_grad_bytes / 16, 4 * kMiB, 64 * kMiB);
}

std::size_t measured_grad_bucket_bytes(const BucketSizing& in) noexcept {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  constexpr double kTailShare = 0.02;
  if (!(in.backward_seconds > 0) || !(in.link_bytes_per_second > 0) || !(in.cpu_grad_bytes_per_second > 0) ||
      !std::isfinite(in.link_bytes_per_second) || !std::isfinite(in.cpu_grad_bytes_per_second))
    return auto_grad_bucket_bytes(in.total_grad_bytes);
  const double seconds_per_byte = 1.0 / in.link_bytes_per_second + 1.0 / in.cpu_grad_bytes_per_second;
  const double bytes = kTailShare * in.backward_seconds / seconds_per_byte;
  const std::size_t hi = std::max(4 * kMiB, std::min(256 * kMiB, in.total_grad_bytes / 4));
  if (!(bytes < static_cast<double>(hi))) return hi;
  return std::clamp(static_cast<std::size_t>(bytes), 4 * kMiB, hi);
}

double sum_of_squares(const void* data, ScalarType type, std::size_t numel) noexcept {
  // Four partial sums: independent chains the compiler can keep in flight.
  double s[4] = {0, 0, 0, 0};
  auto add = [&](auto&& value_at) {
    std::size_t i = 0;
    for (; i + 4 <= numel; i += 4)
      for (int k = 0; k < 4; ++k) {
        const double x = value_at(i + k);
        s[k] += x * x;
      }
    for (; i < numel; ++i) {
      const double x = value_at(i);
      s[0] += x * x;
    }
  };
  switch (type) {
    case ScalarType::kFloat32: {
      const float* f = static_cast<const float*>(data);
      add([f](std::size_t i) { return static_cast<double>(f[i]); });
      break;
    }
    case ScalarType::kBFloat16: {
      const std::uint16_t* h = static_cast<const std::uint16_t*>(data);
      add([h](std::size_t i) { return static_cast<double>(bf16_to_float(h[i])); });
      break;
    }
    case ScalarType::kFloat16: {
      const std::uint16_t* h = static_cast<const std::uint16_t*>(data);
      add([h](std::size_t i) { return static_cast<double>(fp16_to_float(h[i])); });
      break;
    }
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

double PartialNorms::norm() const noexcept { return std::sqrt(sum_sq_); }

bool PartialNorms::clip_must_bind(double max_norm) const noexcept {
  if (!std::isfinite(sum_sq_)) return true;
  return max_norm > 0 && norm() > max_norm * (1.0 + 1e-3);
}

double choose_gpu_fraction(const SplitInputs& in) noexcept {
  if (in.elements == 0 || !(in.cpu_elements_per_second > 0)) return 0.0;
  // CPU time (1-f)N/cpu must fit in the backward; the GPU's own step, fN/gpu,
  // runs on the device after backward, so it is charged against the gain.
  const double n = static_cast<double>(in.elements);
  const double cpu_all = n / in.cpu_elements_per_second;
  const double budget = std::max(0.0, in.backward_seconds);
  if (cpu_all <= budget) return 0.0;
  double f = 1.0 - budget / cpu_all;
  if (in.gpu_elements_per_second > 0) {
    // Balance instead: (1-f)N/cpu - bwd = fN/gpu, i.e. both sides finish together.
    const double cpu_rate = in.cpu_elements_per_second, gpu_rate = in.gpu_elements_per_second;
    f = (n / cpu_rate - budget) / (n / cpu_rate + n / gpu_rate);
  }
  if (in.gpu_bytes_per_element > 0) {
    const double fits = static_cast<double>(in.gpu_free_bytes) /
                        (static_cast<double>(in.gpu_bytes_per_element) * n);
    f = std::min(f, fits);
  }
  return std::clamp(f, 0.0, 1.0);
}

std::size_t grad_link_probe_bytes(std::size_t total_grad_bytes) noexcept {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  return std::max(kMiB, std::min(16 * kMiB, total_grad_bytes / 16));
}

std::int64_t gpu_share_room(std::int64_t free_bytes, std::int64_t budget_bytes,
                            std::int64_t first_step_peak_bytes, std::int64_t planned_peak_bytes) noexcept {
  const std::int64_t peak = std::max(first_step_peak_bytes, planned_peak_bytes);
  return std::max<std::int64_t>(0, std::min(free_bytes / 2, budget_bytes - peak));
}

std::size_t gpu_share_bytes_per_element(bool any_16bit) noexcept { return any_16bit ? 12 : 8; }

std::vector<bool> assign_gpu_share(const std::vector<std::size_t>& numels, double fraction) {
  std::vector<bool> chosen(numels.size(), false);
  if (!(fraction > 0)) return chosen;
  double gpu = 0, seen = 0;  // element counts; doubles, as the Python it replaces compared them
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const auto n = static_cast<double>(numels[i]);
    seen += n;
    if (gpu + n / 2 <= fraction * seen) {
      chosen[i] = true;
      gpu += n;
    }
  }
  return chosen;
}

bool SteadyStepWatch::steady(double backward_ms, bool pool_grew) noexcept {
  const double previous = previous_backward_ms_;
  previous_backward_ms_ = backward_ms;
  if (++streamed_steps_ >= kSteadyStepLimit) return true;
  if (streamed_steps_ < 2 || pool_grew || !(previous > 0)) return false;
  return std::abs(backward_ms - previous) <= kSteadyBackwardSpread * previous;
}

bool BucketSizingSchedule::due(bool carries_parameters, bool streamed, double last_backward_ms,
                               bool pool_grew) noexcept {
  if (!pending_ || !carries_parameters) return false;
  if (!streamed || last_backward_ms <= 0) return false;  // nothing streamed and stepped in this window
  if (!watch_.steady(last_backward_ms, pool_grew)) return false;
  pending_ = false;
  return true;
}

GpuShareChoice::GpuShareChoice(const std::string& setting) : pending_(setting == "auto") {
  if (pending_) return;
  std::size_t used = 0;
  try {
    fraction_ = std::stod(setting, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TIERFLOW_EXPECTS(used == setting.size() && used > 0 && fraction_ >= 0.0 && fraction_ <= 1.0,
                   "TIERFLOW_GPU_OPTIMIZER_FRACTION: '" + setting + "'; accepted: auto or a number from 0 to 1");
}

bool GpuShareChoice::choose_now(bool streamed, double backward_ms, bool pool_grew) noexcept {
  if (!pending_ || !streamed || !(backward_ms > 0) || !watch_.steady(backward_ms, pool_grew)) return false;
  pending_ = false;  // decided once
  return true;
}

std::vector<bool> GpuShareChoice::choose(const std::vector<ShareCandidate>& candidates,
                                         const ShareMeasurements& measured) {
  std::size_t elements = 0;
  bool any_streamed = false, any_16bit = false;
  std::vector<std::size_t> numels;
  for (const auto& c : candidates) {
    numels.push_back(c.numel);
    if (!c.streamed) continue;
    any_streamed = true;
    any_16bit = any_16bit || c.is_16bit;
    elements += c.numel;
  }
  if (!any_streamed || measured.cpu_step_ms <= 0 || measured.backward_ms <= 0)
    return std::vector<bool>(candidates.size(), false);
  SplitInputs in;
  in.cpu_elements_per_second = measured.cpu_elements / (measured.cpu_step_ms / 1e3);
  in.gpu_elements_per_second = 0.0;
  in.backward_seconds = measured.backward_ms / 1e3;
  in.elements = elements;
  in.gpu_bytes_per_element = gpu_share_bytes_per_element(any_16bit);
  in.gpu_free_bytes = static_cast<std::size_t>(
      gpu_share_room(measured.free_bytes, measured.budget_bytes, measured.first_step_peak_bytes,
                     measured.planned_peak_bytes));
  fraction_ = choose_gpu_fraction(in);
  return assign(numels);
}

}  // namespace tierflow::optimizer
