// What one block's forward does, recorded once, and the decisions over it:
// which attention ops are restored, which matmuls split, how many rows of each
// split are exact, what each saved tensor's action is. Torch-free: the
// recorder (a TorchDispatchMode) and the row-split probe's kernels stay in
// bindings/ (Note [Activation plans]), beside this table and indexed the same.
//
// Note [Block table]
// ~~~~~~~~~~~~~~~~~~
// The first forward of a block with a new signature records every aten op
// (its kind: attention, a row-wise matmul, or other; its FLOPs; a matmul's
// rows; its outputs' elements) and every tensor autograd saves, in pack
// order. A saved storage is one of:
// - external (parameters, buffers, tensors made before the block: kept by
//   reference);
// - input (a tensor argument of the block: swapped whole);
// - attention (an output of an SDPA/flash/efficient attention op whose every
//   non-empty output autograd saves: swapped whole, and in the replay the op
//   is not run, its outputs are restored; attention is most of the compute at
//   long context and is never recomputed). An attention op with dropout is
//   recorded as other: it draws from the device generator, and the replay
//   must draw as forward did. An attention op with an output that is not
//   saved is not restorable, and its saved outputs are cheap;
// - split (the output of ``mm`` / ``addmm`` whose first operand is an
//   activation with contiguous rows and whose second is derived from
//   parameters only, and which no in-place or out= op wrote between the matmul
//   and the save: the replay would apply that op to swapped rows that already
//   hold its result, so such a matmul is rerun whole and never split, and all
//   its saved outputs are cheap);
// - cheap (anything else: norms, pointwise ops, dropout masks).
// The recorder reads each op's shapes, strides and flags through torch and
// asks attention_kind, attention_flops, row_matmul and batched_matmul_flops
// (below) for its kind, FLOPs and rows: the rules are here, not beside torch.
// finish() makes those calls once the forward ended. Bytes per class count a
// storage once (its first save in the block); FLOPs per class are the
// restorable attention ops', the split matmuls' and all ops'.
//
// A split is exact only where a matmul on a suffix of the rows gives the same
// bits as those rows of the full matmul, a property of the GEMM kernel and the
// shapes. probe() asks, for each split op, the first rows split_rows gives for
// the block's alpha; all rows need no probe, a proper suffix is probed on the
// device (the callback). Where it fails the op is recomputed whole
// (saved_action: not exact), and a block with no exact split op is not
// splittable (Note [Activation planner]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string_view>
#include <vector>

#include "tierflow/tiering/auto_plan.hpp"
#include "tierflow/tiering/planner.hpp"
#include "tierflow/tiering/saved_actions.hpp"

namespace tierflow::tiering {

/// What a recorded op is to the planner (Note [Block table]).
enum class OpKind : std::uint8_t {
  kOther,      ///< anything else (its saved outputs are cheap)
  kAttention,  ///< an attention op without dropout
  kMatmul,     ///< a row-wise matmul of an activation by parameters
};

std::string_view to_string(OpKind kind) noexcept;
/// The kind named `text` (attention, matmul, other); config_error naming it and the accepted names.
OpKind parse_op_kind(std::string_view text);

/// An attention op's kind: other when it draws dropout (the replay must draw as forward did), else attention.
OpKind attention_kind(double dropout_p) noexcept;
/// FLOPs of an attention op: 4 * q's elements * the key length, halved when causal.
double attention_flops(std::int64_t q_elements, std::int64_t key_length, bool causal) noexcept;

/// An operand of a recorded matmul, as plain numbers.
struct MatmulOperand {
  std::vector<std::int64_t> sizes, strides;
  bool parameter_derived = false;  ///< its storage derives from parameters and buffers only
};

/// A row-wise matmul (mm, addmm) as recorded: its kind (matmul when it may split, else other), FLOPs, rows.
struct RowMatmul {
  OpKind kind = OpKind::kOther;
  double flops = 0;
  std::int64_t rows = 0;  ///< m1's rows when it may split, else 0
};

/// m1 @ m2: it may split by rows when m1 is a 2-D row-major contiguous activation (not parameter-derived)
/// of at least 2 rows, m2 derives from parameters, and the output is contiguous at offset 0
/// (`output_contiguous_at_zero`). FLOPs: 2 * m1 rows * m1 columns * m2 columns.
RowMatmul row_matmul(const MatmulOperand& m1, const MatmulOperand& m2, bool output_contiguous_at_zero);
/// FLOPs of bmm/matmul: 2 * a's elements * b's last dimension.
double batched_matmul_flops(std::int64_t a_elements, std::int64_t b_last) noexcept;

/// One recorded aten op, as plain numbers.
struct RecordedOp {
  OpKind kind = OpKind::kOther;
  double flops = 0;
  std::int64_t rows = 0;                      ///< a matmul's rows (of its first operand and output)
  std::vector<std::int64_t> output_elements;  ///< per output: its elements, or -1 where it is not a tensor
};

/// One tensor autograd saved, as plain numbers.
struct SavedRecord {
  SavedClass cls = SavedClass::kExternal;
  std::int64_t op = -1;    ///< the producing op (-1: none)
  std::int64_t out = 0;    ///< its output index
  std::uint64_t nbytes = 0;  ///< the storage's bytes
  bool first = true;       ///< the first save of this storage in the block
};

/// Saved bytes per class (first saves only).
struct ClassBytes {
  std::uint64_t input = 0, attention = 0, split = 0, cheap = 0;
};

/// FLOPs of the restorable attention ops, the split matmuls and all ops.
struct ClassFlops {
  double attention = 0, split = 0, total = 0;
};

/// What one block's forward does, and the decisions over it (Note [Block table]).
class BlockTable {
 public:
  /// Records the next op; returns its index.
  std::size_t add_op(RecordedOp op);
  /// Records a saved tensor the block did not produce (kExternal or kInput); returns its index.
  std::size_t add_saved(SavedClass cls, std::uint64_t nbytes, bool first);
  /// Records a saved tensor that output `out` of op `op` produced: attention, split or cheap by the op's
  /// kind; a matmul output written in place since the matmul (`mutated`) is cheap and its op never splits.
  /// logic_error for an op not recorded.
  std::size_t add_produced(std::size_t op, std::int64_t out, std::uint64_t nbytes, bool first, bool mutated);
  /// The forward ended: which attention ops are restorable and which matmuls split; the others' saved
  /// tensors become cheap.
  void finish();
  /// Sets the exact first rows of each split op for `alpha` (split_rows with `granule`); `exact(op, r0)`
  /// probes a proper suffix on the device. False when no split op is exact.
  bool probe(double alpha, std::int64_t granule,
             const std::function<bool(std::size_t op, std::int64_t r0)>& exact);

  /// saved_action of every saved tensor in `mode`.
  std::vector<SavedAction> actions(BlockMode mode) const;
  ClassBytes bytes_by_class() const noexcept;
  ClassFlops flops_by_class() const noexcept;
  /// What the planner measures of this block (measured_block_profile's input).
  BlockRecord record(double forward_seconds) const noexcept;

  const std::vector<RecordedOp>& ops() const noexcept { return ops_; }
  const std::vector<SavedRecord>& saved() const noexcept { return saved_; }
  /// Attention ops whose every non-empty output is saved.
  const std::set<std::size_t>& restorable() const noexcept { return restorable_; }
  /// Matmuls with a saved split output, not mutated.
  const std::set<std::size_t>& split_ops() const noexcept { return split_ops_; }
  /// Matmuls whose saved output was written in place: never split.
  const std::set<std::size_t>& mutated_ops() const noexcept { return mutated_ops_; }
  /// Split op -> its first rows, probed exact (set by probe).
  const std::map<std::size_t, std::int64_t>& exact_rows() const noexcept { return exact_rows_; }

 private:
  std::vector<RecordedOp> ops_;
  std::vector<SavedRecord> saved_;
  std::set<std::size_t> restorable_, split_ops_, mutated_ops_;
  std::map<std::size_t, std::int64_t> exact_rows_;
};

}  // namespace tierflow::tiering
