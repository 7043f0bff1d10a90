// StepEngine's step() in two (Note [Atomic step]): the verdicts the ledger gives each slot and the prepared
// record commit_prepared commits; and the weights back to the device (Note [Streamed steps], 4): which
// copy each slot and device sent last, which compute stream waits for which, and when staging may go.
#include <algorithm>
#include <string>
#include <utility>

#include "tierflow/core/clock.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/optimizer/step_engine.hpp"

namespace tierflow::optimizer {

std::vector<std::size_t> StepEngine::prepare(const std::vector<GradIdentity>& now, double scale, bool stale) {
  TIERFLOW_EXPECTS(now.size() == slots_.size(), "StepEngine::prepare: " + std::to_string(now.size()) +
                                                    " identities for " + std::to_string(slots_.size()) + " slots");
  prepared_ = Prepared{};
  prepared_.scale = scale;
  prepared_.stale = stale;
  std::vector<std::size_t> unhandled;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!ledger_.streamable(i)) continue;
    const Confirmation c = ledger_.verdict(i, now[i], scale, stale);
    prepared_.slots.push_back({i, now[i], c.kind});
    if (c.kind == Confirmation::kUnhandled) {
      unhandled.push_back(i);
      // Never committed: their pinned room goes to what the step needs (a tight host budget holds one or the other).
      drop_outputs(i, true);
    } else if (c.kind == Confirmation::kRedo) {
      drop_outputs(i, false);  // redone in place
    }
  }
  return unhandled;
}

void StepEngine::prepare_staging(bool frugal) {
  // The early steps' out-of-place results are an optimisation: with `frugal`, or when the redone steps'
  // staging finds no room beside them, they go and their steps are redone in place from the landed gradients.
  auto let_early_results_go = [&] {
    for (auto& p : prepared_.slots) {
      if (p.kind != Confirmation::kCommit) continue;
      drop_outputs(p.slot, false);
      ledger_.forget_early(p.slot);
      p.kind = Confirmation::kRedo;
    }
  };
  if (frugal) let_early_results_go();
  auto allocate_staging = [&] {
    for (const auto& p : prepared_.slots)
      if (p.kind == Confirmation::kRedo) ensure_staging(p.slot);
  };
  try {
    allocate_staging();
  } catch (const out_of_memory&) {
    if (frugal) throw;
    let_early_results_go();
    allocate_staging();
  }
  prepared_.ready = true;
}

StepEngine::Finish StepEngine::commit_prepared() {
  TIERFLOW_EXPECTS(prepared_.ready, "StepEngine::commit_prepared: no prepare and prepare_staging before it");
  prepared_.ready = false;
  const std::vector<Verdict> verdicts = std::move(prepared_.slots);
  prepared_.slots.clear();
  return commit(verdicts, prepared_.scale, prepared_.stale);
}

std::size_t StepEngine::add_module(std::vector<std::size_t> slots) {
  for (std::size_t i : slots)
    TIERFLOW_EXPECTS(i < slots_.size(), "StepEngine::add_module: no slot " + std::to_string(i));
  modules_.push_back(std::move(slots));
  return modules_.size() - 1;
}

void StepEngine::upload_sent(std::size_t slot, DeviceId device, swap::TransferHandle upload) {
  Slot& s = slots_.at(slot);
  TIERFLOW_EXPECTS(s.staging.defined(), "StepEngine::upload_sent: slot " + std::to_string(slot) + " has no staging");
  s.upload = std::move(upload);
  s.device = device;
  s.upload_pending = true;
  s.upload_seq = ++upload_seq_;
  uploads_.emplace_back(s.upload, s.staging);  // staging stays until the copy is done (rule 3)
  stats_.weight_bytes_to_device += s.staging.bytes;
}

void StepEngine::keep_until_done(swap::TransferHandle copy, HostArray buffer) {
  uploads_.emplace_back(std::move(copy), std::move(buffer));
}

void StepEngine::wait_uploads() {
  const std::uint64_t t0 = now_ns();
  for (auto& [h, buffer] : uploads_) h.wait();
  uploads_.clear();
  // Copies seen complete on the host are complete for any kernel queued from now on.
  for (auto& s : slots_) s.upload_pending = false;
  stats_.weight_wait_ns += now_ns() - t0;
}

void StepEngine::wait_for_step_uploads(const std::vector<std::size_t>& sent) {
  // Rule 2; host -> device copies complete in submission order, so one event per device's compute stream:
  // that of the last copy sent to it.
  std::vector<std::pair<DeviceId, std::size_t>> last;
  for (std::size_t i : sent) {
    Slot& s = slots_.at(i);
    s.upload_pending = false;
    auto it = std::find_if(last.begin(), last.end(), [&](const auto& l) { return l.first == s.device; });
    if (it == last.end()) last.emplace_back(s.device, i);
    else it->second = i;
  }
  step_uploads_.clear();
  waited_streams_.clear();
  for (const auto& [d, i] : last) {
    const swap::StreamRef compute = host_.compute_stream(d);
    host_.make_stream_wait(compute, slots_[i].upload);
    step_uploads_.emplace_back(d, slots_[i].upload);
    waited_streams_.emplace_back(d, compute.native());
  }
}

void StepEngine::wait_step_uploads() {
  step_uploads_.erase(std::remove_if(step_uploads_.begin(), step_uploads_.end(),
                                     [](const auto& u) { return u.second.ready(); }),
                      step_uploads_.end());
  for (const auto& [device, upload] : step_uploads_) {
    const swap::StreamRef compute = host_.compute_stream(device);
    const std::pair<DeviceId, void*> key(device, compute.native());
    if (std::find(waited_streams_.begin(), waited_streams_.end(), key) != waited_streams_.end()) continue;
    host_.make_stream_wait(compute, upload);  // rule 2, for a reader on another stream
    waited_streams_.push_back(key);
  }
}

void StepEngine::wait_module(std::size_t module) {
  TIERFLOW_EXPECTS(module < modules_.size(), "StepEngine::wait_module: no module " + std::to_string(module));
  // Host -> device copies complete in submission order: waiting for the one sent last waits for all of the
  // module's (rule 2, one event per module).
  Slot* last = nullptr;
  for (std::size_t i : modules_[module]) {
    Slot& s = slots_[i];
    if (!s.upload_pending) continue;
    if (!last || s.upload_seq > last->upload_seq) last = &s;
    s.upload_pending = false;
  }
  // (A module's parameters are on one device: the front end's.)
  if (last) host_.make_stream_wait(host_.compute_stream(last->device), last->upload);
}

void StepEngine::wait_upload(std::size_t slot) {
  const Slot& s = slots_.at(slot);
  if (s.upload_pending) host_.make_stream_wait(host_.compute_stream(s.device), s.upload);
}

void StepEngine::synchronize() {
  for (auto& s : slots_)
    if (s.upload_pending) {
      host_.make_stream_wait(host_.compute_stream(s.device), s.upload);
      s.upload_pending = false;
    }
  wait_uploads();
}

}  // namespace tierflow::optimizer
