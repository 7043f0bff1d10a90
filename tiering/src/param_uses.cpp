// See Note [Parameter uses] in param_uses.hpp.
#include "tierflow/tiering/param_uses.hpp"

#include <algorithm>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

ParamUses::ParamUses(const std::vector<std::vector<ParamId>>& units, std::size_t blocks,
                     const std::vector<std::string>& names, std::string tier, ParamUsesHost& host)
    : host_(host), blocks_(blocks), tier_(std::move(tier)), open_(units.size(), 0) {
  std::size_t i = 0;
  for (UnitId u = 0; u < units.size(); ++u) {
    for (ParamId p : units[u]) {
      names_.emplace(p, i < names.size() ? names[i] : "?");
      ++i;
      auto& of = units_of_[p];
      if (std::find(of.begin(), of.end(), u) == of.end()) of.push_back(u);
    }
  }
}

// -- forward -------------------------------------------------------------------------------------------------

std::uint64_t ParamUses::begin_forward(UnitId unit, std::uint64_t extra_bytes, CallId call) {
  TIERFLOW_EXPECTS(unit < open_.size(), "ParamUses: unit " + std::to_string(unit) + " of " +
                                            std::to_string(open_.size()));
  host_.begin_forward(unit, extra_bytes);  // over the budget: throws, and no use began
  ++open_[unit];
  forward_.push_back({unit, extra_bytes, next_token_, call});
  return next_token_++;
}

std::optional<ForwardUse> ParamUses::pop_forward(UnitId unit) {
  for (auto it = forward_.rbegin(); it != forward_.rend(); ++it) {
    if (it->unit != unit) continue;
    const ForwardUse use = *it;
    forward_.erase(std::next(it).base());
    --open_[unit];
    return use;
  }
  return std::nullopt;  // its begin threw
}

std::optional<ForwardUse> ParamUses::pop_forward() {
  if (forward_.empty()) return std::nullopt;
  const ForwardUse use = forward_.back();
  forward_.pop_back();
  --open_[use.unit];
  return use;
}

void ParamUses::end_forward(const ForwardUse& use) { host_.end_forward(use.unit, use.extra_bytes); }

void ParamUses::end_phase() { host_.end_phase(); }

// -- calls ---------------------------------------------------------------------------------------------------

CallId ParamUses::new_call(UnitId unit, std::uint64_t extra_bytes) {
  TIERFLOW_EXPECTS(unit < open_.size(), "ParamUses: unit " + std::to_string(unit) + " of " +
                                            std::to_string(open_.size()));
  calls_[next_call_] = Call{unit, extra_bytes};
  return next_call_++;
}

ParamUses::Call* ParamUses::find(CallId call) {
  const auto it = calls_.find(call);
  return it == calls_.end() ? nullptr : &it->second;
}

void ParamUses::drop_call(CallId id) noexcept {
  unbegun_.erase(id);
  const auto it = calls_.find(id);
  if (it == calls_.end()) return;
  if (open_now(it->second)) it->second.dropped = true;  // its use ends first (its last nodes, or the backward's end)
  else calls_.erase(it);
}

void ParamUses::ended(CallId id, Call& call) {
  call.ended = backwards_;
  --open_[call.unit];
  const UnitId unit = call.unit;
  const std::uint64_t extra = call.extra_bytes;
  if (call.dropped) calls_.erase(id);
  host_.end_backward(unit, extra);
}

void ParamUses::watched(CallId call) {
  if (find(call) != nullptr) unbegun_.insert(call);
}

std::vector<CallId> ParamUses::unbegun(UnitId unit) const {
  std::vector<CallId> out;
  for (CallId c : unbegun_) {
    if (calls_.at(c).unit == unit) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool ParamUses::begin_call(CallId id) {
  Call* call = find(id);
  TIERFLOW_EXPECTS(in_backward_, "ParamUses: a call's backward use begins outside a backward");
  if (call == nullptr || call->begun == backwards_) return false;  // another output of the call
  host_.begin_backward(call->unit, call->extra_bytes);  // over the budget: throws, and it did not begin
  call->begun = backwards_;
  unbegun_.erase(id);
  ++open_[call->unit];
  backward_open_.push_back(id);
  return true;
}

void ParamUses::expect_ends(CallId id, std::size_t left) {
  Call* call = find(id);
  if (call == nullptr) return;
  call->left = left;
  if (left == 0) end_call(id);
}

void ParamUses::edge_ran(CallId id) {
  Call* call = find(id);
  if (!in_backward_ || call == nullptr || call->begun != backwards_ || call->left == 0) return;
  if (--call->left == 0) end_call(id);
}

void ParamUses::end_call(CallId id) {
  Call* call = find(id);
  if (call == nullptr || !open_now(*call)) return;
  backward_open_.erase(std::find(backward_open_.begin(), backward_open_.end(), id));
  ended(id, *call);
}

// -- recomputes ----------------------------------------------------------------------------------------------

bool ParamUses::recompute_opens(UnitId unit) const { return in_backward_ && open_.at(unit) == 0; }

void ParamUses::recompute_begins(CallId call, bool transient) { recomputes_.emplace_back(call, transient); }

std::optional<std::pair<CallId, bool>> ParamUses::recompute_ends(UnitId unit) {
  for (auto it = recomputes_.begin(); it != recomputes_.end(); ++it) {
    const Call* call = find(it->first);
    if (call != nullptr && call->unit == unit) {
      const auto r = *it;
      recomputes_.erase(it);
      return r;
    }
  }
  return std::nullopt;
}

// -- backward ------------------------------------------------------------------------------------------------

bool ParamUses::begin_backward(bool grad_enabled) {
  if (in_backward_) return false;  // another output of the model
  if (!forward_.empty() || grad_enabled) {
    // A backward inside a forward (autograd.grad in a block), or one that builds a graph of its own
    // (create_graph=True: double backward, gradient penalties), whose second pass reads the weights after this
    // one released them.
    throw config_error(std::string("offload_params: a backward ") +
                       (!forward_.empty() ? "inside the model's forward" : "with create_graph=True (double backward)") +
                       " is not supported with parameters off the device; accepted: TIERFLOW_OFFLOAD_PARAMS=none");
  }
  in_backward_ = true;
  ++backwards_;
  return true;
}

void ParamUses::end_open_calls() {
  std::vector<CallId> open;
  open.swap(backward_open_);
  // The higher units first: the order the blocks' backward runs.
  std::stable_sort(open.begin(), open.end(),
                   [this](CallId a, CallId b) { return calls_.at(a).unit > calls_.at(b).unit; });
  for (CallId id : open) ended(id, calls_.at(id));
}

void ParamUses::close_backward() {
  if (!in_backward_) return;
  in_backward_ = false;  // whatever happens below, this backward is over
  // Weights read inline are held through this backward only: a hold over a step would keep a copy the step
  // makes stale (a second backward, of a retained graph or of another forward, is refused by name).
  graph_pending_ = false;
  try {
    end_open_calls();
  } catch (...) {
    backward_open_.clear();
    try {
      release_held(true);
    } catch (...) {
    }
    try {
      host_.end_phase();
    } catch (...) {
    }
    throw;  // the first error goes on
  }
  try {
    release_held(true);
  } catch (...) {
    try {
      host_.end_phase();
    } catch (...) {
    }
    throw;
  }
  host_.end_phase();
}

// -- the model's forward -------------------------------------------------------------------------------------

void ParamUses::model_begins() {
  if (!graph_pending_) release_held();  // held by a forward no backward followed
}

void ParamUses::model_ends(bool graph) {
  if (graph) graph_pending_ = true;
  else if (!graph_pending_) release_held();
}

// -- reads outside uses --------------------------------------------------------------------------------------

ReadVerdict ParamUses::read(ParamId param, bool in_autograd) {
  const auto it = units_of_.find(param);
  if (it == units_of_.end() || held_ids_.count(param) != 0) return ReadVerdict::kNothing;
  for (UnitId u : it->second) {
    if (open_[u] > 0) return ReadVerdict::kNothing;  // a use lists it: fetched
  }
  if (!host_.offloaded(param)) return ReadVerdict::kNothing;
  const auto block = std::find_if(forward_.rbegin(), forward_.rend(),
                                  [this](const ForwardUse& f) { return f.unit < blocks_; });
  if (block != forward_.rend() && !in_autograd) {  // a block reads a weight another module holds
    const UnitId unit = block->unit;
    host_.attach(unit, param);
    units_of_[param].push_back(unit);  // (looked up again: the host may have let another thread in)
    return ReadVerdict::kAttached;
  }
  host_.hold(param);  // the model, or a module outside the blocks, reads it inline
  held_.push_back(param);
  held_ids_.insert(param);
  return ReadVerdict::kHeld;
}

void ParamUses::release_held(bool backward_ended) {
  std::vector<ParamId> held;
  held.swap(held_);
  held_ids_.clear();
  for (ParamId p : held) host_.unhold(p, backward_ended ? held_error(p) : std::string());
}

std::string ParamUses::held_error(ParamId param) const {
  const auto it = names_.find(param);
  const std::string name = it == names_.end() ? "?" : it->second;
  return "tierflow: parameter '" + name + "' lives on the " + tier_ +
         " between its uses (TIERFLOW_OFFLOAD_PARAMS, keyword offload_params); a forward read it outside the modules "
         "that hold it, so it was held through the next backward only, and it was read again after that backward "
         "ended: a second backward reads it (through a retained graph, retain_graph=True, or the graph of a second "
         "forward made before the first backward), or code after the step. Read the weight through a module that "
         "holds it (an nn.Linear whose weight it is), run one backward over both forwards (a summed loss), or read "
         "it inside `with tierflow.gathered(model):` between steps";
}

void ParamUses::forget(const std::vector<ParamId>& params) {
  for (ParamId p : params) units_of_.erase(p);
}

// -- gathered ------------------------------------------------------------------------------------------------

std::vector<ParamId> ParamGathers::fresh(const std::vector<ParamId>& params) const {
  std::vector<ParamId> out;
  for (ParamId p : params) {
    if (held_.count(p) == 0) out.push_back(p);
  }
  return out;
}

void ParamGathers::enter(const std::vector<ParamId>& params, bool modify, const std::vector<std::int64_t>& versions) {
  TIERFLOW_EXPECTS(versions.size() == params.size(), "ParamGathers::enter: a version per parameter");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto [it, fetched] = held_.try_emplace(params[i]);
    if (fetched) it->second.version = versions[i];
    ++it->second.contexts;
    it->second.modify = it->second.modify || modify;
  }
}

ParamGathers::Release ParamGathers::exit(const std::vector<ParamId>& params,
                                         const std::vector<std::int64_t>& versions) {
  TIERFLOW_EXPECTS(versions.size() == params.size(), "ParamGathers::exit: a version per parameter");
  Release out;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto it = held_.find(params[i]);
    if (it == held_.end() || --it->second.contexts > 0) continue;  // an outer context holds it still
    if (it->second.modify) {
      out.write_back.push_back(params[i]);
    } else {
      out.discard.push_back(params[i]);
      if (versions[i] != it->second.version) out.edited.push_back(params[i]);
    }
    held_.erase(it);
  }
  return out;
}

void ParamGathers::forward_begins(bool grad_enabled, const std::string& model) {
  if (any() && grad_enabled)
    throw config_error("tierflow.gathered: a forward of " + model + " that builds a graph (grad enabled) inside a "
                       "gathered() block over its parameters: the step it leads to would update the host copies while "
                       "the block holds the values it read on the device (written back over them with modify=True); "
                       "train outside the block, or run the forward under torch.no_grad() (evaluation, generation)");
  ++forwards_;
}

void ParamGathers::check_outside_passes(bool in_backward, const std::string& model) const {
  if (forwards_ > 0 || in_backward)
    throw config_error("tierflow.gathered: inside " + model + "'s " + (in_backward ? "backward" : "forward") +
                       ", whose parameters tierflow fetches for their uses (a weight of another module is fetched "
                       "when read through its module, self.wte.weight); gathered() is for reads outside the forward "
                       "and backward (EMA, norms, logging, an edit of the weights): move it out, or read the weight "
                       "through its module");
}

std::string gathered_edited_error(const std::vector<std::string>& names) {
  std::string named;
  for (std::size_t i = 0; i < names.size() && i < 4; ++i) named += (i ? ", '" : "'") + names[i] + "'";
  return "tierflow.gathered(..., modify=False): " + named + (names.size() > 4 ? " and others" : "") +
         " written in place inside the block; the write was discarded (modify=False releases without writing "
         "back): pass modify=True to keep it";
}

std::string gathered_step_refusal(const std::string& optimizer) {
  return "tierflow.gathered: " + optimizer + ".step() inside a gathered() block over the parameters it steps: the "
         "step updates the host copies while the block holds the values it read on the device (written back over "
         "them with modify=True); step outside the block";
}

std::string assign_refusal(const std::string& name, const std::string& tier) {
  return "tierflow: load_state_dict(..., assign=True) after tierflow.wrap would replace parameter '" + name +
         "', which lives on the " + tier + " between uses (TIERFLOW_OFFLOAD_PARAMS=" + tier + ", offload_params='" +
         tier + "'), with the loaded tensor; load without assign (the values are copied into it), or "
         "tierflow.unwrap(model) first. Nothing was changed";
}

std::string conversion_refusal(const std::string& module, std::string call, const std::string& name,
                               const std::string& was, const std::string& becomes, const std::string& tier) {
  if (call == "<lambda>") call = "_apply";
  return "tierflow: " + module + "." + call + "() after tierflow.wrap would make parameter '" + name + "' (" + was +
         ") " + becomes + ", and it lives on the " + tier + " between uses (TIERFLOW_OFFLOAD_PARAMS=" + tier +
         ", offload_params='" + tier + "'), where tierflow cannot convert it; call ." + call + "() before "
         "tierflow.wrap, or tierflow.unwrap(model) first and wrap again after. Nothing was changed";
}

}  // namespace tierflow::tiering
