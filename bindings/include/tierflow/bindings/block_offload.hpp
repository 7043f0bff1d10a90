// Activation offload for a pure C++ LibTorch trainer: per block, keep, swap
// the block's input to the host or NVMe tier, or recompute.
//
// Note [C++ block offload]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Python reaches every tensor autograd saves through saved_tensors_hooks
// (Note [Saved-tensor offload]). LibTorch offers no C++ equivalent:
// at::SavedTensorDefaultHooks::push_hooks takes c10::SafePyObject (Python
// callables); Engine::get_default_saved_variable_hooks() returns nothing
// outside the Python engine, and overriding it means replacing the default
// engine (an internal API); the SavedVariables of a generated node are typed
// fields with no generic accessor (Python reaches them through getters
// generated per node type). So a C++ trainer hands tierflow its blocks (a
// transformer layer, say), and each call goes through BlockFunction, a
// torch::autograd::Function:
//   forward   runs the block with autograd off (CppNode::apply runs forward
//             under AutoGradMode(false)), so nothing inside the block saves
//             a tensor. It records the CPU generator's state, the CUDA
//             generator's of the input's device, and the autocast state
//             (enabled and dtype for CPU and CUDA, cache flag), then holds
//             the block's input according to the block's action:
//               kRecompute  on the device, as a SavedVariable of the node;
//               kSwapHost   in the pinned host pool: ActivationOffloader::pack,
//                           the copy engine after the producing stream
//                           (Note [Copy ordering]), device memory dropped once
//                           the copy is done;
//               kSwapNvme   the same, written on to the NVMe tier behind the
//                           compute (Note [NVMe engine]).
//   backward  gets the input back (unpack; the first block that backward
//             reaches in a step starts the prefetch of the others, in the
//             recorded order of Note [Recorded-order prefetch]), sets the
//             recorded RNG and autocast state, reruns the block with grad
//             mode on a detached copy of the input, restores the RNG state
//             it found, and returns the gradients of the input and of the
//             block's parameters. The parameters are inputs of the Function
//             (a TensorList argument), so the engine accumulates their
//             gradients like any other node's, hooks and all.
//   kKeep     calls the block directly: autograd keeps what it saves on the device.
// Dropout draws the same masks in the rerun, so on CPU the gradients are
// bit-identical to running the block plainly; on CUDA they are as long as
// the block's kernels are deterministic.
//
// What a swap plan swaps. Only the block's input leaves the device; the
// tensors the block saves internally are recomputed from it in backward, so
// between a block's forward and its backward the device holds nothing of it.
// Swapping those internal tensors instead would need the block's graph to be
// built in forward and its SavedVariables reached from C++. A SavedVariable
// takes per-variable hooks (SavedVariable::register_hooks, with
// SavedVariableHooks::call_pack_hook/call_unpack_hook), but nothing public
// enumerates a node's SavedVariables: the only generic walk is compiled
// autograd's Node::compiled_args / apply_with_saved (node.h; internal,
// changing between releases, and built for Python's compiler). Hooks on the graph
// rebuilt in backward would not help either: that graph lives only for the
// block's own backward. So a C++ swap plan costs one extra forward of the
// block, the price of MEMO's recompute share at alpha = 0, and moves only
// the block boundary over the link. A planner that wants swap without
// recompute for a block needs the Python route (tierflow.wrap).
//
// Note [C++ parameter residency]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Parameters on the host. A trainer whose
// blocks' weights do not fit the device hands BlockOffload each block's
// parameters once (offload_parameters): each becomes a pinned host copy (the
// parameter's data between uses: the CPU AdamW steps it in place there) and
// tiering::ParamSchedule (Note [Parameter residency]) says when each block's
// parameters are fetched and released. The mechanism needs no saved-tensor
// hook: a swap or recompute block runs its forward with autograd off (nothing
// holds its weights afterwards) and its backward is the rerun, whose graph
// lives only inside backward. So a block's parameters are fetched before its
// forward and released when it returns, fetched before its rerun and
// released once its gradients are computed; the next blocks' are prefetched
// in the recorded order within one block's bytes. A fetch copies the host
// copy into fresh device memory through the copy engine after the compute
// stream's earlier work (the allocation), and the compute stream waits for
// it only when the block runs (Runtime::fetch_to_device / await_on_device,
// rules 1 and 2 of Note [Copy ordering]); a release points the parameter
// back at its host copy, and the device memory goes back to the caching
// allocator in stream order. A kKeep block lets autograd hold its weights
// until backward, so its parameters stay on the device (resident); asking
// for kKeep on a block whose parameters are fetched is refused at its next
// call. Parameters outside the blocks (embeddings, head) stay where the
// trainer put them.
//
// What a rerun restores (Note [Replay side effects] in tiering/replay_rule.hpp, The C++ BlockOffload): the
// tensors a block may write are handed in beside its parameters (`state`: its modules' buffers; the
// ModuleHolder overload passes module->buffers()); tiering::BlockWrites says which to copy before a call and
// restore around its rerun, and when the block is kept instead.
//
// Where the plan comes from: the per-block action table of
// tiering::BlockActionTable (Note [C++ block actions]: the default from
// TIERFLOW_OFFLOAD_ACTIVATIONS, per-block overrides, a plan's mode and tier).
//
// Note [C++ auto activations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TIERFLOW_OFFLOAD_ACTIVATIONS=auto makes BlockOffload a front end of
// tiering::PlanDriver (Note [Plan driver]), as Python's AutoPlanner is: the
// driver decides the phases, the plan, the re-plan and batch growth; the
// front end (bindings/src/block_offload_auto.cpp) measures and applies.
//   phases    the first call of each forward pass (block 0 again) is the
//             driver's before_forward, its size the elements of block 0's
//             input; forwards 1 and 2 run every block swapped to the host
//             (the table's default for auto), forward 2 is timed, and the
//             plan is in force from forward 3 (Note [Auto plan phases]).
//   measures  until a plan is in force: per block its input bytes, its
//             parameters' bytes, its forward's time (autograd off), and in
//             backward its rerun, which is a kept forward: the bytes it
//             leaves allocated besides its output are what the block saves
//             (tierflow::bindings::DeviceMemoryMeter, Note [Device memory
//             meter]: CUDA's caching allocator, or on the emulated device a
//             counting allocator in front of torch's CPU one), and the
//             backward's time. The saved bytes are one class (the record's
//             attention bytes: swapped whole), with no split op: C++ has no
//             split action, so the planner never splits (inexact_splits
//             calls every split inexact besides). The link probe times a
//             4 MiB pinned copy each way and both at once through
//             Runtime::copy_to_host / copy_to_device.
//   budgets   the runtime's device, host and NVMe room; the parameters are
//             set_model_parameters' (else the blocks' own), all counted on
//             the device (conservative with offload_parameters).
//   applies   the plan's blocks through BlockActionTable::apply_plan (keep
//             -> kKeep, the others -> kSwapHost / kSwapNvme by tier: a swap
//             block reruns where the plan priced a swap of everything it
//             saves, so the prediction is a lower bound, Note [C++ block
//             actions]). A kept block whose parameters are fetched
//             (offload_parameters) runs kRecompute: its input stays on the
//             device and autograd holds none of its weights.
// Setting an action by hand (set_action, set_actions, set_default_action,
// apply_plan) is the trainer's plan: the driver stands aside from then on.
// What Python's front end measures and this one does not: the tensors saved
// outside the blocks (C++ cannot see them: 0), the host's gaps between
// blocks, and CUDA's peaks; TIERFLOW_PROFILE is written, never read back.
//
// LibTorch API relied on (checked against 2.13.0; the range is 2.4, where
// at::autocast took a DeviceType, to 2.13):
// torch::autograd::Function with non-tensor and TensorList arguments
// (custom_function.h), AutogradContext::save_for_backward and saved_data
// (an IValue capsule holds tierflow's state), autograd::grad for the rerun,
// at::Generator::get_state/set_state (CPU, and CUDA through
// at::globalContext().defaultGenerator), at::autocast::{is,set}_autocast_enabled
// and {get,set}_autocast_dtype per DeviceType, {is,set}_autocast_cache_enabled.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/bindings/activation_offloader.hpp"
#include "tierflow/core/config.hpp"
#include "tierflow/tiering/block_actions.hpp"
#include "tierflow/tiering/param_schedule.hpp"
#include "tierflow/tiering/planner.hpp"

namespace tierflow::bindings {

class Runtime;

// The action table is torch-free (Note [C++ block actions]); these names keep the C++ API's spelling.
using tiering::BlockAction;
using tiering::block_action_from_config;
using tiering::block_action_from_plan;
using tiering::to_string;

/// A block's forward: one tensor in, one tensor out.
using BlockForward = std::function<at::Tensor(const at::Tensor&)>;

/// Counters of a BlockOffload since creation (tiering::BlockCalls).
using BlockOffloadStats = tiering::BlockCallStats;

/// Runs a trainer's blocks under per-block plans; see Note [C++ block offload].
/// Thread-safe; one per model.
class BlockOffload {
 public:
  /// Every block starts with block_action_from_config(runtime->config()).
  explicit BlockOffload(std::shared_ptr<Runtime> runtime);
  ~BlockOffload();

  /// Sets the action of block `block` (0 is the first block of a forward).
  /// kSwapNvme needs an NVMe engine (TIERFLOW_NVME_PATHS, and an nvme
  /// offload target); otherwise throws config_error.
  void set_action(std::size_t block, BlockAction action);
  /// Sets the actions of blocks 0..n-1; later blocks keep the default.
  void set_actions(const std::vector<BlockAction>& actions);
  /// Sets every block's action from tiering::plan_activations' plan (tiering::block_action_from_plan).
  void apply_plan(const tiering::Plan& plan);
  /// Sets the action of every block not set one by one.
  void set_default_action(BlockAction action);
  /// The action block `block` runs with.
  BlockAction action(std::size_t block) const;

  /// Runs block `block` on `input` under its action. `parameters` are the
  /// tensors the block reads besides its input (its module's parameters);
  /// their gradients flow through the Function. A call with a block index
  /// not greater than the previous call's starts a new forward pass. With
  /// autograd off, or nothing requiring grad, the block simply runs.
  at::Tensor forward(std::size_t block, const BlockForward& fn, const at::Tensor& input,
                     const std::vector<at::Tensor>& parameters);
  /// Same, with the tensors the block may write in place besides its parameters (`state`: its modules'
  /// buffers, BatchNorm's running statistics): a rerun restores what they held before the forward and puts
  /// back what they hold after it (Note [C++ block offload], What a rerun restores).
  at::Tensor forward(std::size_t block, const BlockForward& fn, const at::Tensor& input,
                     const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& state);

  /// Same for a torch::nn module holder (anything with ->forward(x), ->parameters() and ->buffers()).
  template <class ModuleHolder>
  at::Tensor forward(std::size_t block, const ModuleHolder& module, const at::Tensor& input) {
    return forward(block, [m = ModuleHolder(module)](const at::Tensor& x) mutable { return m->forward(x); }, input,
                   module->parameters(), module->buffers());
  }

  /// Puts the blocks' parameters on the host tier between uses (Note [C++ parameter residency]):
  /// `block_parameters[b]` are block b's, as passed to forward(); each becomes a pinned host copy now
  /// (its device memory, if any, goes). Blocks whose action is kKeep now keep theirs on the device. Call
  /// once, before training; `tier` must be Tier::kHost (config_error otherwise, naming what is accepted);
  /// tierflow::out_of_memory when TIERFLOW_HOST_MEMORY cannot hold them.
  void offload_parameters(const std::vector<std::vector<at::Tensor>>& block_parameters, Tier tier = Tier::kHost);
  /// The pinned host copy of `p` (its data between uses), undefined when offload_parameters did not take it.
  at::Tensor host_copy(const at::Tensor& p) const;
  /// The parameters' counters: fetches, bytes, prefetch hits, stalls, device bytes and their peak.
  tiering::ParamScheduleStats parameter_stats() const;

  /// TIERFLOW_OFFLOAD_ACTIVATIONS=auto: the whole model's parameters (embeddings and head besides the blocks'),
  /// which the plan's device budget counts (Note [C++ auto activations]); nothing otherwise.
  void set_model_parameters(const std::vector<at::Tensor>& parameters);
  /// Whether TIERFLOW_OFFLOAD_ACTIVATIONS=auto plans the blocks' actions (Note [C++ auto activations]).
  bool plans_automatically() const;
  /// The automatic plan in force, one line ("" before it is made, and without auto), and its per-block lines.
  std::string activation_plan() const;
  std::vector<std::string> activation_plan_lines() const;
  /// The forward passes the plan driver counted (0 without auto).
  int forwards_counted() const;

  /// Waits for every copy in flight (call before timing or tearing down).
  void synchronize();
  /// Counters.
  BlockOffloadStats stats() const;
  /// Why block `block` is no longer rerun ("" when it is; Note [Replay side effects]).
  std::string not_replayed(std::size_t block) const;
  /// Reruns that restored a block's written state first.
  std::uint64_t restoring_reruns() const;
  /// The host-tier offloader's counters (swapped bytes, prefetch hits, stalls).
  ActivationOffloaderStats host_stats() const;
  /// The NVMe-tier offloader's counters (zero when there is none).
  ActivationOffloaderStats nvme_stats() const;

  struct Shared;  // what BlockFunction reaches from backward

 private:
  std::shared_ptr<Runtime> runtime_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace tierflow::bindings
