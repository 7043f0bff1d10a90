// The uses of parameters offloaded between uses (TIERFLOW_OFFLOAD_PARAMS=host|nvme): which uses are open, per
// unit and per call, when each ends, which parameters are held for reads outside uses and why, and the order
// the schedule's events are sent in, an error midway included. Torch-free: the torch side (params.py) watches
// the modules, tensors and autograd nodes and tells this class what happened, by integers.
//
// Note [Parameter uses]
// ~~~~~~~~~~~~~~~~~~~~~
// Note [Parameter hooks] (bindings/python/tierflow/params.py) says when a use begins and ends; this class keeps
// the count and sends the schedule's events (Note [Parameter residency]) through a ParamUsesHost, so that the
// counts and the schedule never disagree, whatever raises.
//
// Forward uses. begin_forward(u) sends begin_forward first and records the use (innermost last) only when it
// did not throw (over the budget): a use that did not begin is not ended. pop_forward(u) takes the innermost
// open use of u off the record (none: its begin threw); the caller ends it (end_forward) once the torch side
// is done with it. Each use carries a token the caller keys its own state by (autocast's cache, the casts it
// refilled).
//
// Calls. A call of a unit that built a graph has a record (new_call): its backward use begins at the first
// gradient of its outputs (begin_call, once per backward: a retained graph's second backward begins it
// again) and ends when the last nodes of the call the engine runs have run (expect_ends with their count,
// then edge_ran per node), or at close_backward. A watched call whose backward has not begun is "unbegun":
// a recompute in backward asks for those of its unit (Note [Parameter hooks]). A recompute that finds no use
// of its unit open opens one (recompute_begins); its forward's end (recompute_ends) says how it ends. The
// torch side drops a record when its call object goes (drop_call).
//
// Backward. begin_backward refuses a backward inside a forward or one that builds a graph (double backward):
// their second pass would read weights this one released. close_backward ends every call still open, the
// higher units first (the order the blocks' backward runs), then every hold with the held error (below),
// then the phase; an error midway still releases the holds and ends the phase, and the first error goes on.
//
// Reads outside uses. read(p) of a parameter no open use of its units lists, not held and offloaded (OLMo's
// head, F.linear(h, self.wte.weight), in the model's forward; a block reading a weight another module holds):
// inside a block's forward (not in backward) it joins the innermost open block's unit from now on (attach:
// fetched with its uses, forward and backward); elsewhere it is held until the end of the next backward (or of
// a forward no backward follows: model_ends without a graph; two forwards before one backward keep it): a hold
// over a step would keep a copy the step makes stale. Both count in the budget. A hold that ends with a backward
// leaves held_error(p) on the storage: a second backward that reads it (a retained graph, a second forward's
// graph made before the first backward) is told why.
//
// Gathered. tierflow.gathered() is DeepSpeed's GatheredParameters (bindings/python/tierflow/_param_state.py, Note
// [Parameter state]): outside the model's forward and backward (EMA, norms, logging, an edit of the weights), the
// given offloaded parameters are fetched to the device and held there until the context exits; then written back
// to their host copy or NVMe block only with modify=True, and released. Whether to write back is the caller's
// word, not decided by comparing contents: a comparison costs what the write back costs (a read of every byte from
// the device, and from NVMe), and DeepSpeed's users already say it (modifier_rank=None: read only). An in-place
// write under modify=False that autograd's version counter saw (p.mul_(), p.copy_() under no_grad; not
// p.data.mul_(), which has its own counter) is not silently dropped: the context raises on exit naming the
// parameter and saying to pass modify=True (gathered_edited_error). Inside the model's forward or backward
// gathered() is refused (check_outside_passes): the parameters of the module running are on the device already, a
// weight of another module read through its module attribute is fetched for the step (Note [Parameter hooks]),
// and a release on exit would free the storage autograd saved for backward; DeepSpeed's users do the same there
// with register_external_parameter, not GatheredParameters. ParamGathers counts the contexts per parameter:
// nested contexts over one parameter fetch it once (fresh, before enter); the outermost's exit releases it,
// written back if any level asked to modify. Inside the block a forward under no_grad (evaluation, generation:
// DeepSpeed-Chat gathers for it) reads the gathered values; a forward that builds a graph (forward_begins), and
// an optimizer step over the parameters held (gathered_step_refusal), are refused: the step would update the host
// copies (or the CPU AdamW's masters) behind the block, which would write its stale values over them with
// modify=True. The device memory is counted with the schedule's (ParamMover::gather): a gather beyond
// TIERFLOW_GPU_MEMORY raises out_of_memory, and the message says to gather fewer modules at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tierflow/tiering/param_schedule.hpp"

namespace tierflow::tiering {

/// A call of a unit (its record's id, chosen by ParamUses; 0: none).
using CallId = std::uint64_t;

/// What ParamUses sends the schedule (ParamResidency in bindings/, a recorder in the tests). Any may throw.
class ParamUsesHost {
 public:
  virtual ~ParamUsesHost() = default;
  virtual void begin_forward(UnitId unit, std::uint64_t extra_bytes) = 0;
  virtual void end_forward(UnitId unit, std::uint64_t extra_bytes) = 0;
  virtual void begin_backward(UnitId unit, std::uint64_t extra_bytes) = 0;
  virtual void end_backward(UnitId unit, std::uint64_t extra_bytes) = 0;
  virtual void end_phase() = 0;
  /// Whether the parameter lives off the device between uses now (not resident).
  virtual bool offloaded(ParamId param) = 0;
  virtual void hold(ParamId param) = 0;
  virtual void unhold(ParamId param, const std::string& why) = 0;
  virtual void attach(UnitId unit, ParamId param) = 0;
};

/// One open forward use.
struct ForwardUse {
  UnitId unit = 0;
  std::uint64_t extra_bytes = 0;  ///< autocast's casts of its weights, counted with the use
  std::uint64_t token = 0;        ///< the caller's key for its own state of the use
  CallId call = 0;                ///< the call whose backward use follows (0: none, no graph)
};

/// What read() did.
enum class ReadVerdict : std::uint8_t { kNothing, kAttached, kHeld };

/// The uses of one wrapped model's offloaded parameters (Note [Parameter uses]). Not thread-safe: called from
/// the thread that runs the hooks.
class ParamUses {
 public:
  /// `units`: each unit's parameters (0..blocks-1 the blocks); `names`: what the held error calls each, in the
  /// order `units` lists them ("?" for any missing); `tier`: where they live between uses ("host", "nvme"). The
  /// host outlives this object.
  ParamUses(const std::vector<std::vector<ParamId>>& units, std::size_t blocks, const std::vector<std::string>& names,
            std::string tier, ParamUsesHost& host);

  std::size_t units() const noexcept { return open_.size(); }
  /// Open uses of `unit`, forward and backward.
  std::uint32_t open(UnitId unit) const { return open_.at(unit); }
  /// Whether a forward use is open.
  bool forward_open() const noexcept { return !forward_.empty(); }
  bool in_backward() const noexcept { return in_backward_; }
  /// Backwards begun so far.
  std::uint64_t backwards() const noexcept { return backwards_; }

  // -- forward ---------------------------------------------------------------------------------------
  /// A forward use of `unit` begins (the schedule first; nothing recorded if it throws). Returns its token.
  std::uint64_t begin_forward(UnitId unit, std::uint64_t extra_bytes, CallId call = 0);
  /// The innermost open forward use of `unit` (or of any unit), taken off the record; none when there is none.
  std::optional<ForwardUse> pop_forward(UnitId unit);
  std::optional<ForwardUse> pop_forward();
  /// Sends the end of a popped use to the schedule.
  void end_forward(const ForwardUse& use);
  /// The end of a forward phase (the model's forward returned): the schedule's end_phase.
  void end_phase();

  // -- calls -----------------------------------------------------------------------------------------
  CallId new_call(UnitId unit, std::uint64_t extra_bytes);
  /// The call's object went: its record goes, once its use ends where it is open (nothing when unknown).
  void drop_call(CallId call) noexcept;
  /// Its forward returned with a graph: unbegun until its backward begins.
  void watched(CallId call);
  /// The unbegun calls of `unit`.
  std::vector<CallId> unbegun(UnitId unit) const;
  /// A gradient of the call's outputs arrived: its backward use begins unless it began in this backward.
  /// Returns whether it began now. A backward must be open (begin_backward).
  bool begin_call(CallId call);
  /// The call's last nodes this backward runs: `left`; 0 ends its use now.
  void expect_ends(CallId call, std::size_t left);
  /// One of its last nodes ran.
  void edge_ran(CallId call);
  /// Its backward use ends (nothing when it is not open in this backward).
  void end_call(CallId call);
  std::size_t calls() const noexcept { return calls_.size(); }

  // -- recomputes in backward ------------------------------------------------------------------------
  /// Whether a recompute of `unit` must open a use: in a backward, with none of the unit open.
  bool recompute_opens(UnitId unit) const;
  /// The recompute's call (begun): `transient`: ends with the recompute's forward, else with its own backward.
  void recompute_begins(CallId call, bool transient);
  /// The recompute of `unit` returned: its call and whether it is transient (none: no recompute opened one).
  std::optional<std::pair<CallId, bool>> recompute_ends(UnitId unit);

  // -- backward --------------------------------------------------------------------------------------
  /// A backward begins (false: one is open already). Throws config_error, changing nothing, inside a
  /// forward or when `grad_enabled` (it builds a graph of its own).
  bool begin_backward(bool grad_enabled);
  /// The end of backward (Note [Parameter uses], Backward). Nothing when none is open.
  void close_backward();

  // -- the model's forward ---------------------------------------------------------------------------
  /// The model's forward begins (backward closed, forward uses ended): holds of a forward no backward
  /// followed end.
  void model_begins();
  /// The model's forward ended; `graph`: it built one (a backward follows), else holds end unless an earlier
  /// forward's graph waits.
  void model_ends(bool graph);

  // -- reads outside uses ----------------------------------------------------------------------------
  /// A read of `param` (Note [Parameter uses], Reads outside uses). `in_autograd`: the engine runs a backward
  /// on this thread now (a recompute).
  ReadVerdict read(ParamId param, bool in_autograd);
  /// Every hold ends (with the held error when `backward_ended`).
  void release_held(bool backward_ended = false);
  bool held(ParamId param) const { return held_ids_.count(param) != 0; }
  /// What a read of `param` after its hold ended with a backward raises.
  std::string held_error(ParamId param) const;
  /// These parameters are resident from now on: no longer watched.
  void forget(const std::vector<ParamId>& params);

 private:
  struct Call {
    UnitId unit = 0;
    std::uint64_t extra_bytes = 0;
    std::uint64_t begun = 0, ended = 0;  // the backward (1-based) that began and ended its use; 0: none
    std::size_t left = 0;                // its last nodes this backward has still to run
    bool dropped = false;                // its object went while its use was open: goes when the use ends
  };
  bool open_now(const Call& call) const noexcept {
    return in_backward_ && call.begun == backwards_ && call.ended != backwards_;
  }
  void ended(CallId id, Call& call);
  Call* find(CallId call);
  void end_open_calls();

  ParamUsesHost& host_;
  std::size_t blocks_;
  std::unordered_map<ParamId, std::string> names_;
  std::string tier_;
  std::unordered_map<ParamId, std::vector<UnitId>> units_of_;
  std::vector<std::uint32_t> open_;
  std::vector<ForwardUse> forward_;                       // innermost last
  std::unordered_map<CallId, Call> calls_;
  std::unordered_set<CallId> unbegun_;
  std::vector<CallId> backward_open_;                     // this backward's calls whose use is open
  std::vector<std::pair<CallId, bool>> recomputes_;       // (call, transient), until the recompute returns
  std::vector<ParamId> held_;                             // in the order held
  std::unordered_set<ParamId> held_ids_;
  bool in_backward_ = false;
  bool graph_pending_ = false;  // a forward that built a graph ran since the last backward ended
  std::uint64_t backwards_ = 0;
  std::uint64_t next_call_ = 1, next_token_ = 1;
};

/// The parameters tierflow.gathered() holds on the device (Note [Parameter uses], Gathered).
class ParamGathers {
 public:
  /// What the outermost exit over a parameter does with it (each list in the order exit was given).
  struct Release {
    std::vector<ParamId> write_back;  ///< a level asked to modify: written back, then released
    std::vector<ParamId> discard;     ///< released without writing back
    std::vector<ParamId> edited;      ///< of `discard`, those whose version moved since fetched (a refused write)
  };
  /// Of `params`, those no context holds: the caller fetches them (all or none) before enter().
  std::vector<ParamId> fresh(const std::vector<ParamId>& params) const;
  /// A context holds `params` (fetched); `versions`: each one's version now (kept for the fresh ones).
  void enter(const std::vector<ParamId>& params, bool modify, const std::vector<std::int64_t>& versions);
  /// A context over `params` exits; `versions`: each one's version now.
  Release exit(const std::vector<ParamId>& params, const std::vector<std::int64_t>& versions);
  bool held(ParamId param) const { return held_.count(param) != 0; }
  bool any() const noexcept { return !held_.empty(); }

  /// A forward of `model` begins (not a recompute in backward). Throws config_error, counting nothing, when it
  /// builds a graph (`grad_enabled`) while a context holds parameters: the step it leads to would update the host
  /// copies behind the context (written back over them with modify=True). A forward under no_grad reads them.
  void forward_begins(bool grad_enabled, const std::string& model);
  /// It ended (or raised).
  void forward_ends() noexcept { forwards_ -= forwards_ > 0 ? 1 : 0; }
  /// A context over `model`'s parameters may fetch them: throws config_error inside its forward or backward
  /// (`in_backward`), where the schedule fetches them and a release on exit would free what autograd saved.
  void check_outside_passes(bool in_backward, const std::string& model) const;

 private:
  struct Entry {
    std::uint32_t contexts = 0;
    bool modify = false;
    std::int64_t version = 0;  // when fetched
  };
  std::unordered_map<ParamId, Entry> held_;
  std::uint32_t forwards_ = 0;  // forwards of the model in progress (on any thread)
};

/// What gathered()'s exit raises when in-place writes under modify=False were discarded: `names` (at least one;
/// the first four named) and what to pass.
std::string gathered_edited_error(const std::vector<std::string>& names);
/// What a step of the optimizer class `optimizer` over parameters a gathered() context holds raises.
std::string gathered_step_refusal(const std::string& optimizer);
/// load_state_dict(assign=True)'s refusal (Note [Parameter state]): it would replace parameter `name`, which lives
/// on `tier` ("host", "nvme") between uses.
std::string assign_refusal(const std::string& name, const std::string& tier);
/// Module._apply's refusal (Note [Parameter state]): `module`'s `call` (the user's method; "_apply" for a direct
/// call or a lambda) would make parameter `name` (`was`: its dtype and device) `becomes`, and it lives on `tier`.
std::string conversion_refusal(const std::string& module, std::string call, const std::string& name,
                               const std::string& was, const std::string& becomes, const std::string& tier);

}  // namespace tierflow::tiering
