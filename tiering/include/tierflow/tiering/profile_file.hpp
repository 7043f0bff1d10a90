// The profile file: a model's recorded block profiles, links and fixed device
// bytes, as JSON; written and read by `auto` (TIERFLOW_PROFILE) and read by
// `python -m tierflow plan --profile`. Its format, its text and every check
// of a file read back live here (Note [Profile file]).
//
// Note [Profile file]
// ~~~~~~~~~~~~~~~~~~~
//     {"format": "tierflow-profile", "version": 1,
//      "blocks": [{"forward_seconds": f, "backward_seconds": f, "input_bytes": n, "whole_bytes": n,
//                  "split_bytes": n, "split_recompute_seconds": f, "cheap_bytes": n,
//                  "cheap_recompute_seconds": f, "splittable": b, "transient_bytes": n,
//                  "upload_bytes": n, "download_bytes": n, "parameter_bytes": n,
//                  "replayable": b}, ...],
//      "links": {"d2h": f, "h2d": f, "duplex": f, "nvme_write": f, "nvme_read": f,
//                "compute_share_during_copies": f, "copy_share_during_cpu_step": f},
//      "fixed_device_bytes": n}
//
// `blocks` are in forward order, one per repeated block (at most the `layers`
// limit of transformer_shape_limits()), fields as in BlockProfile (a missing
// field takes its default, an unknown one is an error); `links` are bytes per
// second (0: absent), but for the two measured shares of Links (fractions in
// (0, 1], 1 when left out); `fixed_device_bytes` is what the rest of training needs
// on the device. Times and bandwidths are finite numbers >= 0, byte counts
// integers from 0 to 2^64 - 1, `splittable` and `replayable` (Note [Replay side effects]) booleans; anything else is an
// error naming the field and showing the value as Python's repr shows it (the
// file is often written from Python). The reader accepts what Python's json
// accepts: NaN, Infinity and -Infinity (refused as values), integers of any
// size (refused past 2^64 - 1, shown in full). Other top-level keys (auto's
// measured_peak_bytes, rest_of_step_seconds, outside_saved_bytes, outside_largest_bytes) are allowed;
// those Note [Batch growth] reads are checked: batch_elements,
// measured_beside_bytes and the measured peaks integers as above, and
// batch_tensor_elements an object of the input tensors' places to integers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/tiering/planner.hpp"

namespace tierflow::tiering {

inline constexpr std::string_view kProfileFormat = "tierflow-profile";
inline constexpr int kProfileVersion = 1;

/// The fields of a block, in the file's order.
const std::vector<std::string_view>& profile_block_fields();
/// The fields of `links`, in the file's order.
const std::vector<std::string_view>& profile_link_fields();

/// A recorded profile: the blocks, the links and the device bytes the rest of training needs.
struct ProfileFile {
  std::vector<BlockProfile> blocks;
  Links links;
  std::uint64_t fixed_device_bytes = 0;
  std::uint64_t outside_saved_bytes = 0;  ///< auto's measured tensors saved outside the blocks (0: none, or a file without)
  /// The largest single one of them (Budgets::outside_largest_bytes; 0: not measured, or a file without).
  std::uint64_t outside_largest_bytes = 0;
};

/// The profile file's text (Note [Profile file]).
std::string profile_to_json(const std::vector<BlockProfile>& blocks, const Links& links,
                            std::uint64_t fixed_device_bytes);

/// Parses a profile file's text; throws config_error saying what is wrong, one line starting "profile: ".
ProfileFile profile_from_json(std::string_view text);

/// The checks of a profile auto reads back (TIERFLOW_PROFILE=path) for a model of `model_blocks` blocks:
/// config_error naming the path when it is not a profile or profiles another count of blocks.
ProfileFile profile_for_model(std::string_view path, std::string_view text, std::size_t model_blocks);

/// The error text of a TIERFLOW_PROFILE that is not a profile, for the reason `why` (a read error, say).
std::string not_a_profile(std::string_view path, std::string_view why);

/// A value as Python's repr shows a number: 1.0, 1e+30, inf, nan.
std::string python_float_repr(double value);

}  // namespace tierflow::tiering
