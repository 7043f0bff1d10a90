// The configuration table: every TIERFLOW_* variable, its type, default and
// meaning, in one place. See Note [One configuration table].
//
// Note [One configuration table]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each setting is read from the environment once, typed and validated here,
// and nowhere else. Python keyword arguments use the same names, lower case
// without the prefix, and override the environment. An unknown TIERFLOW_*
// variable or keyword is an error naming the closest known name (a typo must
// not silently change nothing); a malformed value is an error naming the
// variable, the value and the accepted forms. Defaults are stored as text and
// parsed by the same parser as user input, so the table in
// docs/configuration.md, the table returned by `config_table()` and the
// behaviour cannot drift apart (tests/python/test_readme.py checks the page
// against this table).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "tierflow/core/state_format.hpp"
#include "tierflow/core/size.hpp"

namespace tierflow {

/// Where a kind of training state is placed.
/// kRecompute and kAuto apply to activations only (Note [Activation plans]).
enum class OffloadTarget : std::uint8_t { kNone, kHost, kNvme, kAuto, kRecompute };

/// Name used in configuration values ("none", "host", "nvme", "auto", "recompute").
std::string_view to_string(OffloadTarget t) noexcept;

/// Which GPU tier a runtime drives: a CUDA GPU, or the emulated device.
enum class DeviceChoice : std::uint8_t { kAuto, kCuda, kEmulated };

/// Name used in configuration values ("auto", "cuda", "emulated").
std::string_view to_string(DeviceChoice d) noexcept;

/// How the emulated device behaves; see Note [Adversarial emulated device].
enum class EmulationMode : std::uint8_t { kPolite, kAdversarial };

/// Name used in configuration values ("polite", "adversarial").
std::string_view to_string(EmulationMode m) noexcept;

/// Verbosity of tierflow's own log lines on stderr.
enum class LogLevel : std::uint8_t { kError, kWarn, kInfo, kDebug };

/// Name used in configuration values ("error", "warn", "info", "debug").
std::string_view to_string(LogLevel l) noexcept;
/// The level `text` names (TIERFLOW_LOG_LEVEL's values: error, warn or warning, info, debug; case and surrounding
/// white space ignored); nothing for any other text. The one reader of a level's name: the settings table, _C.log
/// and _core's copy of the level all use it.
std::optional<LogLevel> parse_log_level(std::string_view text);

/// TIERFLOW_NVME_MEMORY=auto, held as a byte budget of this many bytes: the
/// NVMe engine grows its files while the file system keeps a share free (Note
/// [NVMe space] in swap/include/tierflow/swap/nvme_engine.hpp). No size parses
/// to it: parse_size stops at 2^64-1 and the table refuses that value.
inline constexpr std::uint64_t kNvmeAutoBytes = ~std::uint64_t{0};

/// Every setting, typed. Field names are the variable names without the prefix.
struct Config {
  Budget gpu_memory;                      ///< TIERFLOW_GPU_MEMORY
  Budget host_memory;                     ///< TIERFLOW_HOST_MEMORY
  std::vector<std::string> nvme_paths;    ///< TIERFLOW_NVME_PATHS
  Budget nvme_memory;                     ///< TIERFLOW_NVME_MEMORY
  std::uint64_t aio_block_size = 0;       ///< TIERFLOW_AIO_BLOCK_SIZE
  int aio_queue_depth = 0;                ///< TIERFLOW_AIO_QUEUE_DEPTH
  bool nvme_checksum = true;              ///< TIERFLOW_NVME_CHECKSUM
  OffloadTarget offload_activations{};    ///< TIERFLOW_OFFLOAD_ACTIVATIONS
  OffloadTarget offload_params{};         ///< TIERFLOW_OFFLOAD_PARAMS
  OffloadTarget offload_optimizer{};      ///< TIERFLOW_OFFLOAD_OPTIMIZER
  int cpu_threads = 0;                    ///< TIERFLOW_CPU_THREADS; 0 means all cores
  std::string cpu_isa;                    ///< TIERFLOW_CPU_ISA: auto, avx512, avx2 or portable
  StateFormat optimizer_states{};         ///< TIERFLOW_OPTIMIZER_STATES
  LogLevel log_level{};                   ///< TIERFLOW_LOG_LEVEL
  double stall_timeout_seconds = 0.0;     ///< TIERFLOW_STALL_TIMEOUT; 0 means no limit (Note [Stall timeout])
  std::string report_path;                ///< TIERFLOW_REPORT; empty means no file
  std::string trace_path;                 ///< TIERFLOW_TRACE; empty means no trace (Note [Trace])
  std::string profile_path;               ///< TIERFLOW_PROFILE; empty means measure every run
  bool replan = true;                     ///< TIERFLOW_REPLAN (Note [Re-plan])
  std::uint64_t min_offload_bytes = 0;    ///< TIERFLOW_MIN_OFFLOAD_BYTES
  std::uint64_t prefetch_bytes = 0;       ///< TIERFLOW_PREFETCH_BYTES
  std::uint64_t pinned_slab_bytes = 0;    ///< TIERFLOW_PINNED_SLAB_BYTES
  bool mimalloc = true;                   ///< TIERFLOW_MIMALLOC
  DeviceChoice device{};                  ///< TIERFLOW_DEVICE
  EmulationMode emulated_device{};        ///< TIERFLOW_EMULATED_DEVICE
  std::uint64_t emulated_seed = 0;        ///< TIERFLOW_EMULATED_SEED
  bool overlap_step = true;               ///< TIERFLOW_OVERLAP_STEP
  bool partition_optimizer = false;       ///< TIERFLOW_PARTITION_OPTIMIZER (Note [Partitioned optimizer])
  int grad_accumulation_steps = 1;        ///< TIERFLOW_GRAD_ACCUMULATION_STEPS
  double max_grad_norm = 0.0;             ///< TIERFLOW_MAX_GRAD_NORM; 0 means none
  bool skip_nonfinite = false;            ///< TIERFLOW_SKIP_NONFINITE
  double gpu_optimizer_fraction = 0.0;    ///< TIERFLOW_GPU_OPTIMIZER_FRACTION (when not auto)
  bool gpu_optimizer_fraction_auto = true;  ///< TIERFLOW_GPU_OPTIMIZER_FRACTION=auto
  std::uint64_t grad_bucket_bytes = 0;    ///< TIERFLOW_GRAD_BUCKET_BYTES; 0 means auto
  bool weights_return_in_forward = false;  ///< TIERFLOW_WEIGHTS_RETURN=forward
  bool offload_gradients = false;         ///< TIERFLOW_OFFLOAD_GRADIENTS
  /// The variables set (environment or overrides), full names; the rest hold their defaults.
  std::set<std::string> given;

  /// All defaults, as listed in the table.
  static Config defaults();
  /// Reads every TIERFLOW_* variable of the process environment, then applies
  /// `overrides` (keys: lower-case names without the prefix, or full names).
  static Config from_environment(const std::map<std::string, std::string>& overrides = {});
  /// Same as from_environment with an explicit variable map instead of environ.
  static Config parse(const std::map<std::string, std::string>& variables,
                      const std::map<std::string, std::string>& overrides = {});

  /// Current values as text, keyed by full variable name; parses back to *this.
  std::map<std::string, std::string> to_strings() const;
};

/// Note [Settings a mode ignores]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Some settings act only in some modes: the CPU optimizer's (clip, skip,
/// buckets, accumulation, threads, ...) do nothing with
/// TIERFLOW_OFFLOAD_OPTIMIZER=none, which leaves the user's optimizer as it is;
/// the gradient stream's (buckets, weights' return, accumulation) nothing
/// without steps during backward (states on NVMe, TIERFLOW_OVERLAP_STEP=off);
/// the GPU share nothing for a model off CUDA; the NVMe engine's nothing without
/// TIERFLOW_NVME_PATHS; the activation planner's (profile, re-plan) nothing
/// in a fixed activation mode (recompute's plan is forced); the activation
/// swaps' (smallest size, prefetch window) nothing with
/// TIERFLOW_OFFLOAD_ACTIVATIONS=none; the device budget nothing in
/// a fixed activation mode with the parameters on the device and no GPU share
/// choosing by it; the host pool's nothing when nothing goes to the host.
/// Only a setting given explicitly (environment or keyword) a value other than
/// its default counts: at its default it changes nothing either way. Then, when
/// the runtime is attached (tierflow.wrap):
///  - refused, naming both settings and what would make it act, when ignoring
///    it changes results or breaks a promise about memory: max_grad_norm and
///    skip_nonfinite (a user who asked for a clip must not train unclipped
///    without a word), offload_gradients=on and partition_optimizer=on (each
///    promises gradients or states off the device) with offload_optimizer=none;
///    and a device budget below what the parameters and their gradients take on
///    the device, in any activation mode (checked in tierflow.wrap, where the
///    shapes are known);
///  - otherwise (speed only, or the integrity of a tier not in use: settings
///    that users set globally, in a cluster's environment or a Makefile) let
///    through with one warning line per setting naming it, the mode that
///    ignores it and what would make it act.
/// The emulated device's settings (TIERFLOW_EMULATED_DEVICE, _SEED) are a test
/// suite's, set for whole suites whatever the device, and are let through.
/// docs/configuration.md lists every case and its kind.

/// What tierflow.wrap knows of the model being wrapped.
struct ModelFacts {
  bool cuda = false;  ///< its parameters are on a CUDA GPU (the GPU share applies)
};

/// The given settings `config`'s modes ignore (Note [Settings a mode ignores]).
struct IgnoredSettings {
  std::string refusal;  ///< the first refused one (both variables and keywords, what is accepted), or empty
  std::vector<std::string> warnings;  ///< one line for each let-through one
};
IgnoredSettings ignored_settings(const Config& config, const ModelFacts& model);

/// One row of the configuration table.
struct ConfigEntry {
  std::string_view name;           ///< full variable name, e.g. "TIERFLOW_HOST_MEMORY"
  std::string_view default_value;  ///< default, in the same syntax a user writes
  std::string_view accepted;       ///< accepted forms, as quoted in errors
  std::string_view doc;            ///< one-line meaning
};

/// The whole table, in documentation order.
const std::vector<ConfigEntry>& config_table();

/// Closest known variable name to `name` (edit distance), for error messages.
std::string closest_config_name(std::string_view name);

/// Why keyword `key` (a setting's lower-case name, or its variable) cannot take a collection of Python type
/// `type_name` written `value_repr`: a list or tuple (`sequence`) joins with commas only for a setting whose
/// accepted forms are a list (TIERFLOW_NVME_PATHS); given for a size or a word it would be refused as a malformed
/// value the user never wrote. "" when it can, or when the table does not know `key` (parse names the closest).
std::string collection_value_refusal(std::string_view key, bool sequence, std::string_view type_name,
                                     std::string_view value_repr);

/// Parses `value` for one setting (`name`: full or keyword) exactly as the table does and returns its
/// canonical text (as Config::to_strings gives it). Throws config_error naming `label` (default: the
/// variable), e.g. a command-line flag that stands for the variable, so both are validated alike.
std::string parse_setting(std::string_view name, std::string_view value, std::string_view label = {});

/// `value` in single quotes for a one-line message: control characters, line separators, quotes,
/// backslashes and bytes that are not UTF-8 escaped (\n, \x85, \u2028).
std::string quote_config_value(std::string_view value);

}  // namespace tierflow
