// See Note [Block table] in block_table.hpp.
#include "tierflow/tiering/block_table.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

std::size_t BlockTable::add_op(RecordedOp op) {
  ops_.push_back(std::move(op));
  return ops_.size() - 1;
}

std::size_t BlockTable::add_saved(SavedClass cls, std::uint64_t nbytes, bool first) {
  TIERFLOW_EXPECTS(cls == SavedClass::kExternal || cls == SavedClass::kInput,
                   "BlockTable::add_saved: a produced tensor goes through add_produced");
  saved_.push_back(SavedRecord{cls, -1, 0, nbytes, first});
  return saved_.size() - 1;
}

std::size_t BlockTable::add_produced(std::size_t op, std::int64_t out, std::uint64_t nbytes, bool first,
                                     bool mutated) {
  TIERFLOW_EXPECTS(op < ops_.size(), "BlockTable::add_produced: the op was not recorded");
  SavedClass cls = SavedClass::kCheap;
  if (ops_[op].kind == OpKind::kAttention) cls = SavedClass::kAttention;
  if (ops_[op].kind == OpKind::kMatmul) {
    // Written in place after the matmul: the replay would apply that op to swapped rows that already hold
    // its result. The matmul is rerun whole instead (Note [Block table]).
    cls = mutated ? SavedClass::kCheap : SavedClass::kSplit;
    if (mutated) mutated_ops_.insert(op);
  }
  saved_.push_back(SavedRecord{cls, static_cast<std::int64_t>(op), out, nbytes, first});
  return saved_.size() - 1;
}

void BlockTable::finish() {
  std::set<std::pair<std::int64_t, std::int64_t>> saved_outputs;
  std::set<std::int64_t> split_saved;
  for (const auto& s : saved_) {
    if (s.op >= 0) saved_outputs.emplace(s.op, s.out);
    if (s.cls == SavedClass::kSplit) split_saved.insert(s.op);
  }
  for (std::size_t j = 0; j < ops_.size(); ++j) {
    const RecordedOp& op = ops_[j];
    const auto jj = static_cast<std::int64_t>(j);
    if (op.kind == OpKind::kAttention) {
      bool any = false, all = true;
      for (std::size_t k = 0; k < op.output_elements.size(); ++k) {
        if (op.output_elements[k] <= 0) continue;  // a value, or an empty output: nothing to save
        any = true;
        all = all && saved_outputs.count({jj, static_cast<std::int64_t>(k)}) > 0;
      }
      if (any && all) restorable_.insert(j);
    } else if (op.kind == OpKind::kMatmul && mutated_ops_.count(j) == 0 && split_saved.count(jj) > 0) {
      split_ops_.insert(j);
    }
  }
  for (auto& s : saved_) {
    const auto op = static_cast<std::size_t>(s.op);
    if (s.cls == SavedClass::kAttention && restorable_.count(op) == 0) s.cls = SavedClass::kCheap;
    if (s.cls == SavedClass::kSplit && split_ops_.count(op) == 0) s.cls = SavedClass::kCheap;
  }
}

bool BlockTable::probe(double alpha, std::int64_t granule,
                       const std::function<bool(std::size_t op, std::int64_t r0)>& exact) {
  exact_rows_.clear();
  for (std::size_t j : split_ops_) {
    const std::int64_t rows = ops_[j].rows;
    const std::int64_t r0 = split_rows(alpha, rows, granule);
    if (r0 == rows || (0 < r0 && r0 < rows && exact(j, r0))) exact_rows_[j] = r0;
  }
  return !exact_rows_.empty();
}

std::vector<SavedAction> BlockTable::actions(BlockMode mode) const {
  std::vector<SavedAction> out;
  out.reserve(saved_.size());
  for (const auto& s : saved_) {
    const auto op = static_cast<std::size_t>(s.op);
    bool exact = false;
    if (s.cls == SavedClass::kAttention) exact = restorable_.count(op) > 0;
    if (s.cls == SavedClass::kSplit) {
      const auto it = exact_rows_.find(op);
      exact = it != exact_rows_.end() && it->second > 0;
    }
    out.push_back(saved_action(mode, s.cls, exact));
  }
  return out;
}

ClassBytes BlockTable::bytes_by_class() const noexcept {
  ClassBytes b;
  for (const auto& s : saved_) {
    if (!s.first) continue;
    switch (s.cls) {
      case SavedClass::kInput: b.input += s.nbytes; break;
      case SavedClass::kAttention: b.attention += s.nbytes; break;
      case SavedClass::kSplit: b.split += s.nbytes; break;
      case SavedClass::kCheap: b.cheap += s.nbytes; break;
      case SavedClass::kExternal: break;
    }
  }
  return b;
}

ClassFlops BlockTable::flops_by_class() const noexcept {
  ClassFlops f;
  for (std::size_t j : restorable_) f.attention += ops_[j].flops;
  for (std::size_t j : split_ops_) f.split += ops_[j].flops;
  for (const auto& op : ops_) f.total += op.flops;
  return f;
}

BlockRecord BlockTable::record(double forward_seconds) const noexcept {
  const ClassBytes b = bytes_by_class();
  const ClassFlops f = flops_by_class();
  BlockRecord r;
  r.input_bytes = b.input;
  r.attention_bytes = b.attention;
  r.split_bytes = b.split;
  r.cheap_bytes = b.cheap;
  r.split_flops = f.split;
  r.attention_flops = f.attention;
  r.total_flops = f.total;
  r.has_split_ops = !split_ops_.empty();
  r.forward_seconds = forward_seconds;
  return r;
}

std::string_view to_string(OpKind kind) noexcept {
  switch (kind) {
    case OpKind::kAttention: return "attention";
    case OpKind::kMatmul: return "matmul";
    case OpKind::kOther: return "other";
  }
  return "?";
}

OpKind parse_op_kind(std::string_view text) {
  for (auto k : {OpKind::kAttention, OpKind::kMatmul, OpKind::kOther})
    if (to_string(k) == text) return k;
  throw config_error("op kind '" + std::string(text) + "'; accepted: attention, matmul, other");
}

OpKind attention_kind(double dropout_p) noexcept { return dropout_p > 0 ? OpKind::kOther : OpKind::kAttention; }

double attention_flops(std::int64_t q_elements, std::int64_t key_length, bool causal) noexcept {
  return 4.0 * static_cast<double>(q_elements) * static_cast<double>(key_length) * (causal ? 0.5 : 1.0);
}

RowMatmul row_matmul(const MatmulOperand& m1, const MatmulOperand& m2, bool output_contiguous_at_zero) {
  if (m1.sizes.size() < 2 || m2.sizes.size() < 2) throw logic_error("row_matmul: m1 and m2 must be 2-D");
  RowMatmul out;
  out.flops = 2.0 * static_cast<double>(m1.sizes[0]) * static_cast<double>(m1.sizes[1]) *
              static_cast<double>(m2.sizes[1]);
  const bool row_major = m1.sizes.size() == 2 && m1.strides.size() == 2 && m1.strides[1] == 1 &&
                         m1.strides[0] == m1.sizes[1];
  if (row_major && m1.sizes[0] >= 2 && m2.parameter_derived && !m1.parameter_derived && output_contiguous_at_zero) {
    out.kind = OpKind::kMatmul;
    out.rows = m1.sizes[0];
  }
  return out;
}

double batched_matmul_flops(std::int64_t a_elements, std::int64_t b_last) noexcept {
  return 2.0 * static_cast<double>(a_elements) * static_cast<double>(b_last);
}

}  // namespace tierflow::tiering
