// See Note [Finding blocks] in block_finder.hpp.
#include "tierflow/tiering/block_finder.hpp"

#include <algorithm>
#include <string>
#include <utility>

#include "tierflow/core/error.hpp"

namespace tierflow::tiering {

namespace {

using Group = std::vector<std::size_t>;

// Each stack: two or more children of one module, of one class, each holding parameters; `leaves`: only a
// container's children (the attribute stacks are looked for only when there are none).
std::vector<Group> stacks(const std::vector<ModuleNode>& modules, bool leaves) {
  std::vector<Group> found;
  for (const ModuleNode& parent : modules) {
    const Group& children = parent.children;
    if (parent.container) {
      const bool one_class = std::all_of(children.begin(), children.end(), [&](std::size_t c) {
        return modules[c].type == modules[children.front()].type && modules[c].holds_parameters;
      });
      if (children.size() >= 2 && one_class) found.push_back(children);
    } else if (!leaves) {
      std::vector<std::pair<std::size_t, Group>> by_class;  // in the order the classes are met
      for (std::size_t c : children) {
        const ModuleNode& m = modules[c];
        if (m.container || m.children.empty() || !m.holds_parameters) continue;
        auto it = std::find_if(by_class.begin(), by_class.end(), [&](const auto& g) { return g.first == m.type; });
        if (it == by_class.end()) it = by_class.insert(by_class.end(), {m.type, {}});
        it->second.push_back(c);
      }
      for (auto& [type, group] : by_class)
        if (group.size() >= 2) found.push_back(std::move(group));
    }
  }
  return found;
}

// Every module under `member` (not itself), each once.
void mark_inside(const std::vector<ModuleNode>& modules, std::size_t member, std::vector<bool>& inside,
                 std::vector<bool>& seen) {
  for (std::size_t c : modules[member].children) {
    if (seen[c]) continue;
    seen[c] = true;
    inside[c] = true;
    mark_inside(modules, c, inside, seen);
  }
}

}  // namespace

std::vector<std::size_t> find_blocks(const std::vector<ModuleNode>& modules) {
  for (std::size_t i = 0; i < modules.size(); ++i)
    for (std::size_t c : modules[i].children)
      TIERFLOW_EXPECTS(c < modules.size(), "find_blocks: module " + std::to_string(i) + " has child " +
                                               std::to_string(c) + " of " + std::to_string(modules.size()));
  std::vector<Group> groups = stacks(modules, true);
  if (groups.empty()) groups = stacks(modules, false);
  // The outermost stacks: one inside a member of another (a block's experts) is part of that block.
  std::vector<bool> inside(modules.size(), false);
  for (const Group& group : groups) {
    for (std::size_t member : group) {
      std::vector<bool> seen(modules.size(), false);
      seen[member] = true;
      mark_inside(modules, member, inside, seen);
    }
  }
  std::vector<bool> chosen(modules.size(), false);
  for (const Group& group : groups)
    if (std::none_of(group.begin(), group.end(), [&](std::size_t m) { return inside[m]; }))
      for (std::size_t m : group) chosen[m] = true;
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < modules.size(); ++i)
    if (chosen[i]) out.push_back(i);
  return out;
}

}  // namespace tierflow::tiering
