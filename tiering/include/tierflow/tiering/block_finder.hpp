// Which modules of a model are its repeated blocks, the ones the activation plans act on (Note [Finding blocks]).
// Torch-free: the bindings describe the model's module tree (bindings/python/tierflow/activations/blocks.py).
//
// Note [Finding blocks]
// ~~~~~~~~~~~~~~~~~~~~~
// A block is one repetition of a model's stack of layers: what the activation
// plans act on. The stacks people write come as containers (nn.ModuleList:
// HF's decoders; nn.Sequential; nn.ModuleDict: torchtitan's layers) whose
// children are two or more modules of one class holding parameters, or, with no
// such container, as attributes of one module (self.block0, self.block1, ...):
// two or more children of one class that hold parameters and have submodules of
// their own (two nn.Linear or nn.Embedding side by side are layers, not a
// stack). Every such stack is taken, not only the largest: an encoder-decoder
// (T5, nn.Transformer) has two, and all four of a ResNet's stages are stacks.
// A stack inside a member of another stack is part of that member (Mixtral's
// experts are part of its decoder layer), so only the outermost stacks give
// blocks, listed in the order the model registers them (its forward order in
// every model of the zoo, tests/python/test_model_zoo.py). Blocks differ in
// class and size across stacks; each gets its own profile and plan. With no
// stack, there are no blocks: auto keeps every saved tensor where it fits and
// swaps them all where it does not (Note [Activation plans], AutoPlanner).
#pragma once

#include <cstddef>
#include <vector>

namespace tierflow::tiering {

/// One module of a model, as model.modules() lists them (the model first, each module once).
struct ModuleNode {
  std::size_t type = 0;                ///< its class: the same number for the same class
  bool container = false;              ///< nn.ModuleList, nn.Sequential or nn.ModuleDict
  bool holds_parameters = false;       ///< it or a submodule holds a parameter
  std::vector<std::size_t> children;   ///< its children's indices in the list, in registration order
};

/// The indices of the model's blocks in `modules` (Note [Finding blocks]), in the list's order; none without a
/// stack. logic_error for a child index outside the list.
std::vector<std::size_t> find_blocks(const std::vector<ModuleNode>& modules);

}  // namespace tierflow::tiering
