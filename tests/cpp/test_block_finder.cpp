// tiering::find_blocks (Note [Finding blocks]): which modules of a model's tree are its repeated blocks.
#include <gtest/gtest.h>

#include <vector>

#include "tierflow/core/error.hpp"
#include "tierflow/tiering/block_finder.hpp"

using namespace tierflow;
using namespace tierflow::tiering;

namespace {
constexpr std::size_t kModel = 0, kList = 1, kLayer = 2, kLinear = 3, kExpert = 4, kNorm = 5;

ModuleNode node(std::size_t type, bool params, std::vector<std::size_t> children = {}, bool container = false) {
  return ModuleNode{type, container, params, std::move(children)};
}
}  // namespace

TEST(FindBlocks, AContainersChildrenOfOneClassAreTheBlocks) {
  // model(embedding, h = ModuleList(layer(linear), layer(linear), layer(linear)))
  const std::vector<ModuleNode> m = {
      node(kModel, true, {1, 2}),  node(kLinear, true),         node(kList, true, {3, 5, 7}, true),
      node(kLayer, true, {4}),     node(kLinear, true),         node(kLayer, true, {6}),
      node(kLinear, true),         node(kLayer, true, {8}),     node(kLinear, true)};
  EXPECT_EQ(find_blocks(m), (std::vector<std::size_t>{3, 5, 7}));
}

TEST(FindBlocks, AStackInsideABlockIsPartOfIt) {
  // layers = ModuleList(layer(experts = ModuleList(expert(linear), expert(linear))) x2): the experts are inside.
  std::vector<ModuleNode> m = {node(kModel, true, {1}), node(kList, true, {2, 8}, true)};
  for (std::size_t first : {2, 8}) {
    m.push_back(node(kLayer, true, {first + 1}));
    m.push_back(node(kList, true, {first + 2, first + 4}, true));
    m.push_back(node(kExpert, true, {first + 3}));
    m.push_back(node(kLinear, true));
    m.push_back(node(kExpert, true, {first + 5}));
    m.push_back(node(kLinear, true));
  }
  EXPECT_EQ(find_blocks(m), (std::vector<std::size_t>{2, 8}));
}

TEST(FindBlocks, WithoutAContainerAttributeStacksWithSubmodulesCount) {
  // model(block0(linear), block1(linear), norm, linear, linear): two Linears side by side are layers, not a stack.
  const std::vector<ModuleNode> m = {node(kModel, true, {1, 3, 5, 6, 7}), node(kLayer, true, {2}), node(kLinear, true),
                                     node(kLayer, true, {4}),             node(kLinear, true),     node(kNorm, true),
                                     node(kLinear, true),                 node(kLinear, true)};
  EXPECT_EQ(find_blocks(m), (std::vector<std::size_t>{1, 3}));
}

TEST(FindBlocks, AContainerOfMixedClassesOrWithoutParametersIsNoStack) {
  const std::vector<ModuleNode> mixed = {node(kModel, true, {1}), node(kList, true, {2, 3}, true),
                                         node(kLayer, true), node(kNorm, true)};
  EXPECT_TRUE(find_blocks(mixed).empty());
  const std::vector<ModuleNode> bare = {node(kModel, false, {1}), node(kList, false, {2, 3}, true),
                                        node(kLayer, false), node(kLayer, false)};
  EXPECT_TRUE(find_blocks(bare).empty());  // no parameters: no blocks, auto plans the model whole
}

TEST(FindBlocks, EveryOutermostStackIsTakenInRegistrationOrder) {
  // An encoder-decoder: two ModuleLists of different layer classes.
  const std::vector<ModuleNode> m = {node(kModel, true, {1, 4}), node(kList, true, {2, 3}, true),
                                     node(kLayer, true),          node(kLayer, true),
                                     node(kList, true, {5, 6}, true), node(kExpert, true),
                                     node(kExpert, true)};
  EXPECT_EQ(find_blocks(m), (std::vector<std::size_t>{2, 3, 5, 6}));
}

TEST(FindBlocks, AChildOutsideTheListIsRefused) {
  EXPECT_THROW(find_blocks({node(kModel, true, {3})}), logic_error);
}
