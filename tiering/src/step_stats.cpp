// Per-step figures from counter snapshots (Note [Step stats]).
#include "tierflow/tiering/step_stats.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "tierflow/core/error.hpp"
#include "tierflow/core/trace.hpp"

namespace tierflow::tiering {

namespace {

constexpr double kSecondsPerNs = 1e-9;

/// b - a for counts that only grow; 0 when a reader saw them out of order.
std::uint64_t grown(std::uint64_t a, std::uint64_t b) noexcept { return b > a ? b - a : 0; }

struct Peak {
  std::uint64_t bytes;
  bool exact;
};

/// The step's peak of one tier (Note [Step stats]): the highest window after the first mark (and the first
/// reading) when every mark had one; else the meter's new all-time peak when it rose during the step, else the
/// highest reading at the marks (exact only when that is the meter's all-time peak).
Peak step_peak(const TierReading& first, const TierReading& last, std::int64_t seen, std::int64_t window,
                      bool windowed) noexcept {
  if (windowed) return {static_cast<std::uint64_t>(std::max<std::int64_t>({seen, window, 0})), true};
  const bool metered = last.peak != TierReading::kNoPeak;
  if (metered && first.peak != TierReading::kNoPeak && last.peak > first.peak)
    return {static_cast<std::uint64_t>(last.peak), true};
  const std::int64_t v = std::max<std::int64_t>(seen, 0);
  return {static_cast<std::uint64_t>(v), metered && v >= last.peak};
}

}  // namespace

const std::vector<StatField<StepStats>>& step_stat_fields() {
  using S = StepStats;
  static const std::vector<StatField<S>> fields = {
      {"step", &S::step},
      {"forwards", &S::forwards},
      {"backwards", &S::backwards},
      {"wall_s", nullptr, &S::wall_s},
      {"forward_s", nullptr, &S::forward_s},
      {"backward_s", nullptr, &S::backward_s},
      {"step_s", nullptr, &S::step_s},
      {"exposed_copy_wait_s", nullptr, &S::exposed_copy_wait_s},
      {"exposed_cpu_step_s", nullptr, &S::exposed_cpu_step_s},
      {"exposed_nvme_wait_s", nullptr, &S::exposed_nvme_wait_s},
      {"exposed_param_wait_s", nullptr, &S::exposed_param_wait_s},
      {"device_to_host_bytes", &S::device_to_host_bytes},
      {"host_to_device_bytes", &S::host_to_device_bytes},
      {"host_to_nvme_bytes", &S::host_to_nvme_bytes},
      {"nvme_to_host_bytes", &S::nvme_to_host_bytes},
      {"peak_device_activation_bytes", &S::peak_device_activation_bytes},
      {"peak_pinned_host_bytes", &S::peak_pinned_host_bytes},
      {"peak_nvme_bytes", &S::peak_nvme_bytes},
  };
  return fields;
}

StepStats mean_of_steps(const std::vector<StepStats>& steps) {
  TIERFLOW_EXPECTS(!steps.empty(), "mean_of_steps: no steps to sum up");
  StepStats out;
  out.peak_device_activation_bytes = out.peak_pinned_host_bytes = out.peak_nvme_bytes = 0;
  double forwards = 0, backwards = 0, d2h = 0, h2d = 0, h2n = 0, n2h = 0;
  for (const StepStats& s : steps) {
    forwards += static_cast<double>(s.forwards);
    backwards += static_cast<double>(s.backwards);
    out.wall_s += s.wall_s;
    out.forward_s += s.forward_s;
    out.backward_s += s.backward_s;
    out.step_s += s.step_s;
    out.exposed_copy_wait_s += s.exposed_copy_wait_s;
    out.exposed_cpu_step_s += s.exposed_cpu_step_s;
    out.exposed_nvme_wait_s += s.exposed_nvme_wait_s;
    out.exposed_param_wait_s += s.exposed_param_wait_s;
    d2h += static_cast<double>(s.device_to_host_bytes);
    h2d += static_cast<double>(s.host_to_device_bytes);
    h2n += static_cast<double>(s.host_to_nvme_bytes);
    n2h += static_cast<double>(s.nvme_to_host_bytes);
    out.peak_device_activation_bytes = std::max(out.peak_device_activation_bytes, s.peak_device_activation_bytes);
    out.peak_pinned_host_bytes = std::max(out.peak_pinned_host_bytes, s.peak_pinned_host_bytes);
    out.peak_nvme_bytes = std::max(out.peak_nvme_bytes, s.peak_nvme_bytes);
    out.peaks_exact = out.peaks_exact && s.peaks_exact;
  }
  const double n = static_cast<double>(steps.size());
  auto mean = [n](double total) { return static_cast<std::uint64_t>(total / n + 0.5); };
  out.step = steps.back().step;
  out.forwards = mean(forwards);
  out.backwards = mean(backwards);
  out.device_to_host_bytes = mean(d2h);
  out.host_to_device_bytes = mean(h2d);
  out.host_to_nvme_bytes = mean(h2n);
  out.nvme_to_host_bytes = mean(n2h);
  for (double* t : {&out.wall_s, &out.forward_s, &out.backward_s, &out.step_s, &out.exposed_copy_wait_s,
                    &out.exposed_cpu_step_s, &out.exposed_nvme_wait_s, &out.exposed_param_wait_s})
    *t /= n;
  return out;
}

StepRecorder::StepRecorder(std::size_t capacity, bool ends_at_step) : capacity_(capacity), ends_at_step_(ends_at_step) {
  TIERFLOW_EXPECTS(capacity > 0, "StepRecorder: capacity must be at least one step");
}

std::optional<StepStats> StepRecorder::last() const {
  if (steps_.empty()) return std::nullopt;
  return steps_.back();
}

void StepRecorder::clear() noexcept {
  steps_.clear();
  open_ = false;
}

void StepRecorder::sample(const StepCounters& c) noexcept {
  const bool first = first_sample_;
  first_sample_ = false;
  auto take = [first](Seen& s, const TierReading& r) {
    s.reading = std::max(s.reading, r.current);
    if (first) return;  // the first mark's window is the time before the step
    if (r.window == TierReading::kNoPeak)
      s.windowed = false;
    else
      s.window = std::max(s.window, r.window);
  };
  take(seen_device_, c.device_activations);
  take(seen_host_, c.pinned_host);
  take(seen_nvme_, c.nvme);
}

void StepRecorder::begin(std::uint64_t now_ns, const StepCounters& c) {
  open_ = true;
  backward_seen_ = false;
  first_ = c;
  first_ns_ = now_ns;
  forward_at_ = backward_at_ = step_at_ = 0;
  forward_ns_ = backward_ns_ = step_ns_ = 0;
  forwards_ = backwards_ = 0;
  seen_device_ = seen_host_ = seen_nvme_ = Seen{};
  first_sample_ = true;
}

void StepRecorder::finish(std::uint64_t now_ns, const StepCounters& c) {
  StepStats s;
  s.step = ++recorded_;
  s.forwards = forwards_;
  s.backwards = backwards_;
  s.wall_s = static_cast<double>(grown(first_ns_, now_ns)) * kSecondsPerNs;
  s.forward_s = static_cast<double>(forward_ns_) * kSecondsPerNs;
  s.backward_s = static_cast<double>(backward_ns_) * kSecondsPerNs;
  s.step_s = static_cast<double>(step_ns_) * kSecondsPerNs;
  s.exposed_copy_wait_s = static_cast<double>(grown(first_.copy_wait_ns, c.copy_wait_ns)) * kSecondsPerNs;
  s.exposed_cpu_step_s = static_cast<double>(grown(first_.cpu_step_ns, c.cpu_step_ns)) * kSecondsPerNs;
  s.exposed_nvme_wait_s = static_cast<double>(grown(first_.nvme_wait_ns, c.nvme_wait_ns)) * kSecondsPerNs;
  s.exposed_param_wait_s = static_cast<double>(grown(first_.param_wait_ns, c.param_wait_ns)) * kSecondsPerNs;
  s.device_to_host_bytes = grown(first_.device_to_host_bytes, c.device_to_host_bytes);
  s.host_to_device_bytes = grown(first_.host_to_device_bytes, c.host_to_device_bytes);
  s.host_to_nvme_bytes = grown(first_.host_to_nvme_bytes, c.host_to_nvme_bytes);
  s.nvme_to_host_bytes = grown(first_.nvme_to_host_bytes, c.nvme_to_host_bytes);
  auto peak = [](const TierReading& first, const TierReading& last, const Seen& seen) {
    return step_peak(first, last, seen.reading, seen.window, seen.windowed);
  };
  const Peak dev = peak(first_.device_activations, c.device_activations, seen_device_);
  const Peak host = peak(first_.pinned_host, c.pinned_host, seen_host_);
  const Peak nvme = peak(first_.nvme, c.nvme, seen_nvme_);
  s.peak_device_activation_bytes = dev.bytes;
  s.peak_pinned_host_bytes = host.bytes;
  s.peak_nvme_bytes = nvme.bytes;
  s.peaks_exact = dev.exact && host.exact && nvme.exact;
  steps_.push_back(s);
  while (steps_.size() > capacity_) steps_.pop_front();
  open_ = false;
}

void StepRecorder::trace_mark(StepMark m, std::uint64_t now_ns) {
  if (m == StepMark::kForwardBegin) {
    if (trace_begin_ns_ == 0) trace_begin_ns_ = now_ns;
    ++trace_forwards_;
    return;
  }
  if (m != StepMark::kStepEnd && (m != StepMark::kBackwardEnd || ends_at_step_)) return;
  const auto step = static_cast<std::int64_t>(++trace_steps_);  // a step ended (Note [Step stats], steps lane)
  const std::uint64_t begin_ns = std::exchange(trace_begin_ns_, 0);
  const auto forwards = static_cast<std::int64_t>(std::exchange(trace_forwards_, 0));
  if (begin_ns != 0 && trace::on())
    trace::complete_args(trace::Lane::kSteps, "step " + std::to_string(step), begin_ns, now_ns,
                         {{"step", step}, {"forwards", forwards}});
}

void StepRecorder::mark(StepMark m, std::uint64_t now_ns, const StepCounters& c) {
  trace_mark(m, now_ns);
  if (m == StepMark::kForwardBegin && open_ && backward_seen_ && !ends_at_step_) {
    sample(c);  // the window up to now is the ending step's
    finish(now_ns, c);
  }
  if (!open_) {
    if (m == StepMark::kForwardEnd || m == StepMark::kBackwardEnd || m == StepMark::kStepEnd)
      return;  // the end of a span whose beginning no step saw (e.g. marked before the recorder existed)
    begin(now_ns, c);
  }
  sample(c);
  switch (m) {
    case StepMark::kForwardBegin:
      forward_at_ = now_ns;
      ++forwards_;
      break;
    case StepMark::kForwardEnd:
      if (forward_at_ != 0) forward_ns_ += grown(forward_at_, now_ns);
      forward_at_ = 0;
      break;
    case StepMark::kBackwardBegin:
      backward_at_ = now_ns;
      ++backwards_;
      backward_seen_ = true;
      break;
    case StepMark::kBackwardEnd:
      if (backward_at_ != 0) backward_ns_ += grown(backward_at_, now_ns);
      backward_at_ = 0;
      break;
    case StepMark::kStepBegin:
      if (backward_at_ != 0) backward_ns_ += grown(backward_at_, now_ns);  // no end seen: it ended by now
      backward_at_ = 0;
      step_at_ = now_ns;
      break;
    case StepMark::kStepEnd:
      if (step_at_ != 0) step_ns_ += grown(step_at_, now_ns);
      step_at_ = 0;
      finish(now_ns, c);
      break;
  }
}

}  // namespace tierflow::tiering
