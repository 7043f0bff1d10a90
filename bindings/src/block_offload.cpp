// See Note [C++ block offload] in block_offload.hpp.
#include "tierflow/bindings/block_offload.hpp"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <unordered_map>

#include "tierflow/allocator/device.hpp"
#include "block_offload_auto.hpp"
#include "tierflow/bindings/device_memory_meter.hpp"
#include "tierflow/bindings/runtime.hpp"
#include "tierflow/core/error.hpp"
#include "tierflow/core/clock.hpp"
#include "tierflow/core/log.hpp"
#include "tierflow/tiering/replay_rule.hpp"

namespace tierflow::bindings {

namespace {
// A parameter's identity for the schedule: its TensorImpl, which set_data keeps.
tiering::ParamId param_id(const at::Tensor& p) {
  return static_cast<tiering::ParamId>(reinterpret_cast<std::uintptr_t>(p.unsafeGetTensorImpl()));
}
}  // namespace

struct BlockOffload::Shared {
  mutable std::mutex mutex;
  std::shared_ptr<ActivationOffloader> host;
  std::shared_ptr<ActivationOffloader> nvme;  // null without an NVMe engine
  tiering::BlockActionTable actions{BlockAction::kKeep, false};  // Note [C++ block actions]
  tiering::BlockCalls calls;     // forwards, what each call does, counters (Note [C++ block actions])

  // Note [C++ parameter residency]: the blocks' parameters between uses, when offloaded.
  struct Param {
    at::Tensor param;            // the trainer's parameter (its data: the host copy or a device copy)
    at::Tensor host;             // its pinned host copy, what the optimizer steps
    swap::TransferHandle fetch;  // the copy of its device copy, while one is held
  };
  // What a rerun restores (Note [C++ block offload]): per block, which of its state and parameters it writes.
  tiering::BlockWrites writes;
  std::uint64_t restoring_reruns = 0;

  std::unique_ptr<tiering::ParamSchedule> params;  // null: parameters stay where the trainer put them
  std::unordered_map<tiering::ParamId, Param> param_copies;
  std::shared_ptr<Runtime> runtime;
  // TIERFLOW_OFFLOAD_ACTIVATIONS=auto: the plan driver's front end (Note [C++ auto activations]); null otherwise.
  std::shared_ptr<BlockAutoPlan> autoplan;
  std::atomic<bool> by_hand{false};  // the trainer set actions itself: the plan driver stands aside
  BlockAutoPlan* automatic() const { return by_hand.load() ? nullptr : autoplan.get(); }

  // Carries out what the schedule decided for one block's use; under `mutex`.
  void carry_out(const tiering::ParamActions& a, const at::Device& device) {
    for (tiering::ParamId id : a.release) {
      Param& p = param_copies.at(id);
      p.param.set_data(p.host);
      p.fetch = swap::TransferHandle();
    }
    for (const auto* ids : {&a.fetch, &a.prefetch}) {
      for (tiering::ParamId id : *ids) {
        Param& p = param_copies.at(id);
        at::Tensor copy = at::empty(p.host.sizes(), p.host.options().device(device).pinned_memory(false));
        p.fetch = runtime->fetch_to_device(copy, p.host);
        p.param.set_data(copy);
      }
    }
    for (tiering::ParamId id : a.wait) {
      runtime->await_on_device(param_copies.at(id).fetch, device);
      params->arrived(id);
    }
  }

  enum class Use { kBeginForward, kEndForward, kBeginBackward, kEndBackward };
  void param_use(std::size_t block, Use use, const at::Device& device) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!params || block + 1 >= params->units()) return;  // not offloaded, or a block it was not told of
    switch (use) {
      case Use::kBeginForward: carry_out(params->begin_forward(block), device); break;
      case Use::kEndForward: carry_out(params->end_forward(block), device); break;
      case Use::kBeginBackward: carry_out(params->begin_backward(block), device); break;
      case Use::kEndBackward: carry_out(params->end_backward(block), device); break;
    }
  }

  // The first swapped block backward reaches starts every offloader's prefetch.
  void reached_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!calls.reached_backward()) return;
    host->begin_backward();
    if (nvme) nvme->begin_backward();
  }
};

namespace {

// The generators dropout draws from: the CPU one, and the CUDA one of the
// input's device (what torch.utils.checkpoint saves, too).
struct RngState {
  at::Tensor cpu;
  std::optional<at::Device> cuda_device;
  at::Tensor cuda;
};

at::Tensor generator_state(const at::Device& device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(const at::Device& device, const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

RngState capture_rng(const at::Device& device) {
  RngState s;
  s.cpu = generator_state(at::Device(at::kCPU));
  if (device.is_cuda()) {
    s.cuda_device = device;
    s.cuda = generator_state(device);
  }
  return s;
}

void apply_rng(const RngState& s) {
  set_generator_state(at::Device(at::kCPU), s.cpu);
  if (s.cuda_device) set_generator_state(*s.cuda_device, s.cuda);
}

// Sets a recorded RNG state for a scope and puts back the one it found.
class RngFork {
 public:
  explicit RngFork(const RngState& recorded) : found_(capture_rng(recorded.cuda_device.value_or(at::Device(at::kCPU)))) {
    apply_rng(recorded);
  }
  ~RngFork() { apply_rng(found_); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngState found_;
};

struct AutocastState {
  bool cpu_enabled = false;
  bool cuda_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cache = true;
};

AutocastState capture_autocast() {
  AutocastState s;
  s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  s.cache = at::autocast::is_autocast_cache_enabled();
  return s;
}

void apply_autocast(const AutocastState& s) {
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu_enabled);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
  at::autocast::set_autocast_cache_enabled(s.cache);
}

// Sets a recorded autocast state for a scope and puts back the one it found, as
// torch.autocast enters and leaves a region: the nesting count goes up, and the
// cache of 16-bit weight copies is cleared when the outermost region ends. A
// rerun in backward (outside the user's region) would otherwise leave its copies
// in the cache, and the next forward, after optimizer.step(), would compute with
// last step's weights.
class AutocastFork {
 public:
  explicit AutocastFork(const AutocastState& recorded) : found_(capture_autocast()) {
    apply_autocast(recorded);
    at::autocast::increment_nesting();
  }
  ~AutocastFork() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    apply_autocast(found_);
  }
  AutocastFork(const AutocastFork&) = delete;
  AutocastFork& operator=(const AutocastFork&) = delete;

 private:
  AutocastState found_;
};

// A tensor the block wrote in its forward and its value from before (Note [C++ block offload]).
struct Written {
  at::Tensor tensor;
  at::Tensor before;
};

// A rerun's scope: the written tensors hold their values from before the forward; on leaving, what they held
// on entering, version counters as they were (what autograd saved of them stays valid).
class RestoredState {
 public:
  explicit RestoredState(const std::vector<Written>& written) : written_(written) {
    at::AutoGradMode no_grad(false);
    for (const auto& w : written_) {
      found_.push_back(w.tensor.detach().clone());
      versions_.push_back(w.tensor._version());
      w.tensor.detach().copy_(w.before);
    }
  }
  ~RestoredState() {
    at::AutoGradMode no_grad(false);
    for (std::size_t i = 0; i < written_.size(); ++i) {
      written_[i].tensor.detach().copy_(found_[i]);
      c10::VariableVersion counter = torch::autograd::impl::version_counter(written_[i].tensor);
      counter.set_version(versions_[i]);
    }
  }
  RestoredState(const RestoredState&) = delete;
  RestoredState& operator=(const RestoredState&) = delete;

 private:
  const std::vector<Written>& written_;
  std::vector<at::Tensor> found_;
  std::vector<std::int64_t> versions_;
};

// What one block call keeps for its backward (an IValue capsule in the context).
struct BlockState : torch::CustomClassHolder {
  BlockForward fn;
  std::size_t block = 0;  // its index (Note [C++ parameter residency])
  std::shared_ptr<BlockOffload::Shared> shared;
  std::shared_ptr<ActivationOffloader> offloader;  // null: the input stays a SavedVariable
  std::shared_ptr<SavedHandle> input;              // the swapped input
  bool input_requires_grad = false;
  std::vector<bool> param_requires_grad;
  RngState rng;
  AutocastState autocast;
  std::vector<at::Tensor> state;  // what the block may write besides its parameters (its buffers)
  std::vector<Written> written;   // what its rerun restores
};

// Runs the block's forward, noting what it writes in place (Note [C++ block offload], What a rerun restores).
at::Tensor forward_noting_writes(BlockState& s, const at::Tensor& input, at::TensorList params) {
  std::vector<at::Tensor> tracked(s.state.begin(), s.state.end());
  tracked.insert(tracked.end(), params.begin(), params.end());
  BlockOffload::Shared& shared = *s.shared;
  tiering::BlockWrites::Before known;  // which to keep a value of (tiering::BlockWrites decides)
  {
    std::lock_guard<std::mutex> lock(shared.mutex);
    known = shared.writes.before(s.block, tracked.size());
  }
  std::vector<at::Tensor> before(tracked.size());
  std::vector<std::int64_t> versions(tracked.size());
  {
    at::AutoGradMode no_grad(false);
    for (std::size_t i = 0; i < tracked.size(); ++i) {
      versions[i] = tracked[i]._version();
      if (known.keep[i]) before[i] = tracked[i].detach().clone();  // the first call: all, dropped after
    }
  }
  at::Tensor output = s.fn(input);
  std::vector<bool> wrote(tracked.size(), false);
  for (std::size_t i = 0; i < tracked.size(); ++i) {
    // native_batch_norm writes the running statistics without bumping their version: compared by value once.
    wrote[i] = tracked[i]._version() != versions[i] ||
               (!known.compared && i < s.state.size() && !at::equal(before[i], tracked[i]));
  }
  tiering::BlockWrites::After noted;
  {
    std::lock_guard<std::mutex> lock(shared.mutex);
    noted = shared.writes.after(s.block, s.state.size(), known, wrote);
  }
  for (std::size_t i = 0; i < tracked.size(); ++i)
    if (noted.restore[i]) s.written.push_back({tracked[i], before[i]});
  if (!noted.refused_now.empty())
    log(LogLevel::kWarn, "BlockOffload: block " + std::to_string(s.block) + " is not rerun from its next call on "
                         "(kept; this call's rerun may differ from its forward): " + noted.refused_now);
  return output;
}

constexpr const char* kStateKey = "tierflow_block";

struct BlockFunction : torch::autograd::Function<BlockFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<BlockState>& state,
                            const at::Tensor& input, at::TensorList params) {
    state->rng = capture_rng(input.device());
    state->autocast = capture_autocast();
    state->input_requires_grad = input.requires_grad();
    for (const auto& p : params) state->param_requires_grad.push_back(p.requires_grad());
    // Note [C++ auto activations]: until a plan is in force, each block's forward is timed.
    BlockAutoPlan* const autoplan = state->shared->automatic();
    const bool measure = autoplan && autoplan->measuring();
    if (measure) settle_device(input.device());
    const std::uint64_t t0 = now_ns();
    at::Tensor output = forward_noting_writes(*state, input, params);
    if (measure) {
      settle_device(input.device());
      std::uint64_t parameter_bytes = 0;
      for (const auto& p : params) parameter_bytes += p.nbytes();
      autoplan->forward_measured(state->block, input.nbytes(), parameter_bytes,
                                 static_cast<double>(now_ns() - t0) / 1e9);
    }
    std::vector<at::Tensor> saved(params.begin(), params.end());
    if (state->offloader) {
      state->input = state->offloader->pack(input);
    } else {
      saved.push_back(input);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data[kStateKey] = at::IValue::make_capsule(state);
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<BlockState>(ctx->saved_data.at(kStateKey).toCapsule());
    std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const std::size_t n_params = state->param_requires_grad.size();
    at::Tensor input;
    if (state->offloader) {
      TORCH_CHECK(state->input != nullptr,
                  "tierflow BlockOffload: backward through a swapped block a second time (retain_graph): "
                  "its input was released after the first backward; use the recompute or keep action for such blocks");
      state->shared->reached_backward();
      input = state->offloader->unpack(state->input);
      state->input.reset();  // the host or NVMe copy goes as soon as it is read
    } else {
      input = saved.at(n_params);
    }
    state->shared->param_use(state->block, BlockOffload::Shared::Use::kBeginBackward, input.device());
    at::Tensor x = input.detach().requires_grad_(state->input_requires_grad);
    const std::uint64_t t0 = now_ns();
    at::Tensor y;
    // What the forward wrote holds its values from before it until the rerun's gradients are computed.
    std::optional<RestoredState> restored;
    if (!state->written.empty()) {
      restored.emplace(state->written);
      std::lock_guard<std::mutex> lock(state->shared->mutex);
      ++state->shared->restoring_reruns;
    }
    // Note [C++ auto activations]: until a plan is in force, the rerun (a kept forward) measures what the block
    // saves for backward (what it leaves allocated but its output), and the backward is timed.
    BlockAutoPlan* const autoplan = state->shared->automatic();
    const bool measure = autoplan && autoplan->measuring();
    std::uint64_t saved_bytes = 0;
    {
      RngFork rng(state->rng);
      AutocastFork autocast(state->autocast);
      at::AutoGradMode grad_mode(true);
      std::optional<DeviceMemoryMeter> meter;
      if (measure) meter.emplace(x.device());
      y = state->fn(x);
      if (meter) {
        const std::uint64_t live = meter->live_bytes(), output = y.nbytes();
        saved_bytes = live > output ? live - output : 0;
      }
    }
    if (measure) settle_device(x.device());
    const std::uint64_t backward_t0 = now_ns();
    std::vector<at::Tensor> wrt;
    if (state->input_requires_grad) wrt.push_back(x);
    for (std::size_t i = 0; i < n_params; ++i)
      if (state->param_requires_grad[i]) wrt.push_back(saved[i]);
    std::vector<at::Tensor> grads;
    if (y.requires_grad() && !wrt.empty())
      grads = torch::autograd::grad({y}, wrt, {grad_outputs.at(0)}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
    if (measure) {
      settle_device(x.device());
      autoplan->rerun_measured(state->block, saved_bytes, static_cast<double>(now_ns() - backward_t0) / 1e9);
    }
    restored.reset();  // the forward's (or a later call's) values back
    state->shared->param_use(state->block, BlockOffload::Shared::Use::kEndBackward, input.device());
    {
      std::lock_guard<std::mutex> lock(state->shared->mutex);
      state->shared->calls.rerun(now_ns() - t0);
    }
    // One gradient per argument of forward: none for the state, then the input, then each parameter.
    torch::autograd::variable_list result(2 + n_params);
    std::size_t next = 0;
    if (state->input_requires_grad && !grads.empty()) result[1] = grads[next++];
    for (std::size_t i = 0; i < n_params; ++i)
      if (state->param_requires_grad[i] && !grads.empty()) result[2 + i] = grads[next++];
    return result;
  }
};

}  // namespace

BlockOffload::BlockOffload(std::shared_ptr<Runtime> runtime)
    : runtime_(std::move(runtime)), shared_(std::make_shared<Shared>()) {
  TIERFLOW_EXPECTS(runtime_ != nullptr, "BlockOffload: a runtime is required");
  shared_->runtime = runtime_;
  const Config& c = runtime_->config();
  ActivationOffloaderOptions o;
  o.schedule.prefetch_bytes = c.prefetch_bytes;
  o.schedule.keep_tail_bytes = 0;  // the plan says per block what stays
  o.min_offload_bytes = c.min_offload_bytes;
  o.schedule.target = OffloadTarget::kHost;  // what reaches this offloader is a block the plan swaps
  shared_->host = std::make_shared<ActivationOffloader>(o, runtime_->host_pool(), runtime_->copy_engine());
  if (runtime_->nvme_engine()) {
    o.schedule.target = OffloadTarget::kNvme;
    shared_->nvme = std::make_shared<ActivationOffloader>(o, runtime_->host_pool(), runtime_->copy_engine(),
                                                          runtime_->nvme_engine());
  }
  shared_->actions = tiering::BlockActionTable(block_action_from_config(c), shared_->nvme != nullptr);
  if (c.offload_activations == OffloadTarget::kAuto) {
    // Note [C++ auto activations]: the emulated device's saved bytes need the counting allocator, put in front
    // of the one in force (the adversarial device's poisoning one, which the runtime installed first).
    if (runtime_->device_kind() == allocator::DeviceKind::kEmulated && !install_counting_cpu_allocator())
      log(LogLevel::kWarn, "BlockOffload: TIERFLOW_OFFLOAD_ACTIVATIONS=auto: torch's CPU allocator could not be "
                           "counted; the blocks' saved bytes on the emulated device read as their inputs only");
    std::weak_ptr<Shared> weak = shared_;
    shared_->autoplan = std::make_shared<BlockAutoPlan>(runtime_, [weak](const tiering::Plan& plan) {
      if (const auto shared = weak.lock()) {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->actions.apply_plan(plan);
      }
    });
  }
}

BlockOffload::~BlockOffload() = default;

void BlockOffload::apply_plan(const tiering::Plan& plan) {
  shared_->by_hand = true;  // Note [C++ auto activations]: the trainer's actions, not the driver's
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->actions.apply_plan(plan);
}

void BlockOffload::set_action(std::size_t block, BlockAction action) {
  shared_->by_hand = true;  // Note [C++ auto activations]: the trainer's actions, not the driver's
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->actions.set(block, action);
}

void BlockOffload::set_actions(const std::vector<BlockAction>& actions) {
  shared_->by_hand = true;  // Note [C++ auto activations]: the trainer's actions, not the driver's
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->actions.set_all(actions);
}

void BlockOffload::set_default_action(BlockAction action) {
  shared_->by_hand = true;  // Note [C++ auto activations]: the trainer's actions, not the driver's
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->actions.set_default(action);
}

BlockAction BlockOffload::action(std::size_t block) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->actions.action(block);
}

at::Tensor BlockOffload::forward(std::size_t block, const BlockForward& fn, const at::Tensor& input,
                                 const std::vector<at::Tensor>& parameters) {
  return forward(block, fn, input, parameters, {});
}

at::Tensor BlockOffload::forward(std::size_t block, const BlockForward& fn, const at::Tensor& input,
                                 const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& block_state) {
  bool needs_graph = at::GradMode::is_enabled() && input.requires_grad();
  for (const auto& p : parameters) needs_graph = needs_graph || (at::GradMode::is_enabled() && p.requires_grad());
  // Note [C++ auto activations]: a forward pass's first call lets the plan driver act (it may plan) first.
  if (BlockAutoPlan* autoplan = shared_->automatic(); autoplan && needs_graph) autoplan->before_call(block, input);
  tiering::BlockCall call;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    const bool fetched = shared_->params && block + 1 < shared_->params->units() && !parameters.empty() &&
                         shared_->params->home(param_id(parameters[0])) != Tier::kGpu;
    // A refused rerun keeps the block; fetched parameters are never kept (tiering::block_call_action).
    const BlockAction planned = tiering::block_call_action(block, shared_->actions.action(block),
                                                           !shared_->writes.refusal(block).empty(), fetched,
                                                           shared_->automatic() != nullptr);
    call = shared_->calls.call(block, planned, needs_graph);
    if (call.new_forward) {
      shared_->host->begin_forward();
      if (shared_->nvme) shared_->nvme->begin_forward();
    }
  }
  // Note [C++ parameter residency]: the block's parameters are on the device while it runs.
  shared_->param_use(block, Shared::Use::kBeginForward, input.device());
  struct Release {
    Shared& shared;
    std::size_t block;
    at::Device device;
    ~Release() {
      try {
        shared.param_use(block, Shared::Use::kEndForward, device);
      } catch (const std::exception& e) {
        log(LogLevel::kError, std::string("BlockOffload: releasing a block's parameters: ") + e.what());
      }
    }
  } release{*shared_, block, input.device()};
  if (call.action == BlockAction::kKeep) return fn(input);
  auto state = c10::make_intrusive<BlockState>();
  state->fn = fn;
  state->block = block;
  state->shared = shared_;
  state->state = block_state;
  if (call.action == BlockAction::kSwapHost) state->offloader = shared_->host;
  if (call.action == BlockAction::kSwapNvme) state->offloader = shared_->nvme;
  return BlockFunction::apply(state, input, at::TensorList(parameters));
}

void BlockOffload::synchronize() {
  shared_->host->synchronize();
  if (shared_->nvme) shared_->nvme->synchronize();
}

void BlockOffload::offload_parameters(const std::vector<std::vector<at::Tensor>>& block_parameters, Tier tier) {
  tiering::check_param_tier(tier);  // before "called twice" and the tensors' checks, as it always was
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (shared_->params) throw config_error("BlockOffload::offload_parameters: called twice; call it once, before training");
  std::vector<std::vector<tiering::ParamRef>> refs(block_parameters.size());
  for (std::size_t b = 0; b < block_parameters.size(); ++b) {
    for (const at::Tensor& p : block_parameters[b]) {
      TIERFLOW_EXPECTS(p.defined() && p.is_leaf(), "BlockOffload::offload_parameters: block " + std::to_string(b) +
                                                       " lists a tensor that is not a parameter (undefined or not a leaf)");
      refs[b].push_back({param_id(p), p.nbytes()});
    }
  }
  // Where each block's parameters live and how far ahead they come (tiering::block_param_units).
  auto [units, options] = tiering::block_param_units(shared_->actions, refs, tier);
  auto schedule = std::make_unique<tiering::ParamSchedule>(units, options);
  std::unordered_map<tiering::ParamId, Shared::Param> copies;  // made in full before anything changes
  for (std::size_t b = 0; b < block_parameters.size(); ++b) {
    if (units[b].residence == Tier::kGpu) continue;
    for (const at::Tensor& p : block_parameters[b]) {
      const tiering::ParamId id = param_id(p);
      if (copies.count(id) || schedule->home(id) == Tier::kGpu) continue;  // shared, or resident through a kept block
      at::Tensor host = runtime_->host_empty(p.sizes(), p.scalar_type(), false);
      host.copy_(p.detach());
      copies.emplace(id, Shared::Param{p, host, {}});
    }
  }
  for (auto& [id, c] : copies) c.param.set_data(c.host);  // the device copies go
  shared_->param_copies = std::move(copies);
  shared_->params = std::move(schedule);
}

at::Tensor BlockOffload::host_copy(const at::Tensor& p) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const auto found = shared_->param_copies.find(param_id(p));
  return found == shared_->param_copies.end() ? at::Tensor() : found->second.host;
}

tiering::ParamScheduleStats BlockOffload::parameter_stats() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->params ? shared_->params->stats() : tiering::ParamScheduleStats{};
}

std::string BlockOffload::not_replayed(std::size_t block) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->writes.refusal(block);
}

std::uint64_t BlockOffload::restoring_reruns() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->restoring_reruns;
}

BlockOffloadStats BlockOffload::stats() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->calls.stats();
}

ActivationOffloaderStats BlockOffload::host_stats() const { return shared_->host->stats(); }

ActivationOffloaderStats BlockOffload::nvme_stats() const {
  return shared_->nvme ? shared_->nvme->stats() : ActivationOffloaderStats{};
}

void BlockOffload::set_model_parameters(const std::vector<at::Tensor>& parameters) {
  std::uint64_t bytes = 0;
  for (const auto& p : parameters) bytes += p.nbytes();
  if (BlockAutoPlan* autoplan = shared_->automatic()) autoplan->set_model_parameter_bytes(bytes);
}

bool BlockOffload::plans_automatically() const { return shared_->automatic() != nullptr; }

std::string BlockOffload::activation_plan() const {
  const BlockAutoPlan* autoplan = shared_->automatic();
  return autoplan ? autoplan->summary() : std::string();
}

std::vector<std::string> BlockOffload::activation_plan_lines() const {
  const BlockAutoPlan* autoplan = shared_->automatic();
  return autoplan ? autoplan->lines() : std::vector<std::string>{};
}

int BlockOffload::forwards_counted() const {
  const BlockAutoPlan* autoplan = shared_->automatic();
  return autoplan ? autoplan->driver().phases().forwards() : 0;
}

}  // namespace tierflow::bindings
