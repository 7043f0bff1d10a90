// See tiering/block_measures.hpp.
#include "tierflow/tiering/block_measures.hpp"

#include <algorithm>

namespace tierflow::tiering {

bool BlockMeasures::starts_forward(std::size_t block) noexcept {
  const bool new_forward = !started_ || block <= last_block_;
  started_ = true;
  last_block_ = block;
  return new_forward;
}

BlockMeasures::Block& BlockMeasures::at(std::size_t block) {
  if (blocks_.size() <= block) blocks_.resize(block + 1);
  return blocks_[block];
}

void BlockMeasures::forward(std::size_t block, std::uint64_t input_bytes, std::uint64_t parameter_bytes,
                            double seconds) {
  Block& b = at(block);
  b.record.input_bytes = input_bytes;
  b.record.parameter_bytes = parameter_bytes;
  b.record.forward_seconds = seconds;
  b.forward_seconds_sum += seconds;
}

void BlockMeasures::rerun(std::size_t block, std::uint64_t saved_bytes, double backward_seconds) {
  Block& b = at(block);
  b.record.attention_bytes = saved_bytes;
  b.record.backward_seconds = backward_seconds;
  b.backward_seconds_sum += backward_seconds;
}

void BlockMeasures::start_timing() noexcept {
  for (Block& b : blocks_) b.forward_seconds_sum = b.backward_seconds_sum = 0;
}

TimedStepMeasures BlockMeasures::timed_step() const {
  TimedStepMeasures m;
  for (const Block& b : blocks_) {
    m.blocks.push_back(b.record);
    m.blocks_forward_seconds += b.forward_seconds_sum;
    m.blocks_replay_seconds += b.forward_seconds_sum;
    m.blocks_backward_seconds += b.backward_seconds_sum;
  }
  return m;
}

std::uint64_t BlockMeasures::parameter_bytes(std::uint64_t model_bytes) const noexcept {
  std::uint64_t blocks = 0;
  for (const Block& b : blocks_) blocks += b.record.parameter_bytes;
  return std::max(model_bytes, blocks);
}

std::vector<std::size_t> split_blocks(const std::vector<BlockPlan>& blocks) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < blocks.size(); ++i)
    if (blocks[i].mode == BlockMode::kSplit) out.push_back(i);
  return out;
}

}  // namespace tierflow::tiering
