#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>

#include <sys/stat.h>
#include <unistd.h>
#include <set>
#include <string>

#include "tierflow/core/config.hpp"
#include "tierflow/core/error.hpp"

using namespace tierflow;

namespace {

// Expects parse() to throw config_error whose message contains every needle.
void expect_error(const std::map<std::string, std::string>& vars,
                  const std::map<std::string, std::string>& overrides,
                  std::initializer_list<std::string> needles) {
  try {
    Config::parse(vars, overrides);
    FAIL() << "no error";
  } catch (const config_error& e) {
    std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg << " lacks " << n;
  }
}

// Sets an environment variable for one scope and restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace

TEST(Config, DefaultsComeFromTheTable) {
  Config c = Config::defaults();
  auto strings = c.to_strings();
  for (const auto& e : config_table()) {
    ASSERT_TRUE(strings.count(std::string(e.name))) << e.name << " has no to_strings() entry";
  }
  EXPECT_EQ(strings.size(), config_table().size());
  EXPECT_EQ(c.offload_activations, OffloadTarget::kAuto);  // the planner (Note [Activation planner])
  EXPECT_EQ(c.offload_optimizer, OffloadTarget::kHost);
  EXPECT_EQ(c.offload_params, OffloadTarget::kNone);
  EXPECT_TRUE(c.host_memory.is_fraction);
  EXPECT_EQ(c.cpu_threads, 0);
  EXPECT_EQ(c.min_offload_bytes, 64u * 1024);
}

TEST(Config, EveryRequiredVariableIsInTheTable) {
  std::set<std::string> names;
  for (const auto& e : config_table()) names.insert(std::string(e.name));
  for (const char* n : {"TIERFLOW_GPU_MEMORY", "TIERFLOW_HOST_MEMORY", "TIERFLOW_NVME_PATHS",
                        "TIERFLOW_NVME_MEMORY", "TIERFLOW_OFFLOAD_ACTIVATIONS",
                        "TIERFLOW_OFFLOAD_PARAMS", "TIERFLOW_OFFLOAD_OPTIMIZER",
                        "TIERFLOW_CPU_THREADS", "TIERFLOW_LOG_LEVEL", "TIERFLOW_REPORT"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
}

TEST(Config, ParsesEveryKind) {
  Config c = Config::parse({{"TIERFLOW_GPU_MEMORY", "10GiB"},
                            {"TIERFLOW_HOST_MEMORY", "75%"},
                            {"TIERFLOW_NVME_PATHS", "/mnt/a, /mnt/b"},
                            {"TIERFLOW_OFFLOAD_ACTIVATIONS", "AUTO"},
                            {"TIERFLOW_OFFLOAD_OPTIMIZER", "none"},
                            {"TIERFLOW_CPU_THREADS", "2"},
                            {"TIERFLOW_LOG_LEVEL", "debug"},
                            {"TIERFLOW_REPORT", "/tmp/r.json"},
                            {"TIERFLOW_PREFETCH_BYTES", "8MiB"}});
  EXPECT_EQ(c.gpu_memory.bytes, 10ULL << 30);
  EXPECT_DOUBLE_EQ(c.host_memory.fraction, 0.75);
  ASSERT_EQ(c.nvme_paths.size(), 2u);
  EXPECT_EQ(c.nvme_paths[1], "/mnt/b");
  EXPECT_EQ(c.offload_activations, OffloadTarget::kAuto);
  EXPECT_EQ(c.offload_optimizer, OffloadTarget::kNone);
  EXPECT_EQ(c.cpu_threads, 2);
  EXPECT_EQ(c.log_level, LogLevel::kDebug);
  EXPECT_EQ(c.report_path, "/tmp/r.json");
  EXPECT_EQ(c.prefetch_bytes, 8ULL << 20);
}

TEST(Config, ToStringsParsesBack) {
  Config c = Config::parse({{"TIERFLOW_HOST_MEMORY", "3GiB"}, {"TIERFLOW_CPU_THREADS", "3"},
                            {"TIERFLOW_NVME_PATHS", "/a,/b"}, {"TIERFLOW_MAX_GRAD_NORM", "0.1"}});
  Config again = Config::parse(c.to_strings());
  EXPECT_EQ(again.to_strings(), c.to_strings());
}

TEST(Config, OffloadParamsParsesEveryTierAndAuto) {
  EXPECT_EQ(Config::parse({{"TIERFLOW_OFFLOAD_PARAMS", "none"}}).offload_params, OffloadTarget::kNone);
  EXPECT_EQ(Config::parse({{"TIERFLOW_OFFLOAD_PARAMS", "host"}}).offload_params, OffloadTarget::kHost);
  EXPECT_EQ(Config::parse({{"TIERFLOW_OFFLOAD_PARAMS", " NVMe "}}).offload_params, OffloadTarget::kNvme);
  EXPECT_EQ(Config::parse({{"TIERFLOW_OFFLOAD_PARAMS", "auto"}}).offload_params, OffloadTarget::kAuto);
  EXPECT_EQ(Config::parse({}, {{"offload_params", "auto"}}).offload_params, OffloadTarget::kAuto);
  // The optimizer still takes no auto.
  expect_error({{"TIERFLOW_OFFLOAD_OPTIMIZER", "auto"}}, {}, {"TIERFLOW_OFFLOAD_OPTIMIZER", "one of none, host, nvme"});
}

TEST(Config, UnknownVariableNamesTheClosest) {
  expect_error({{"TIERFLOW_HOST_MEMROY", "1GiB"}}, {},
               {"TIERFLOW_HOST_MEMROY", "did you mean TIERFLOW_HOST_MEMORY"});
  expect_error({{"TIERFLOW_CPU_THREAD", "1"}}, {}, {"TIERFLOW_CPU_THREADS"});
}

TEST(Config, UnknownKeywordNamesTheClosest) {
  expect_error({}, {{"host_memroy", "1GiB"}}, {"host_memroy", "did you mean 'host_memory'"});
}

TEST(Config, VariablesWithoutThePrefixAreIgnored) {
  EXPECT_NO_THROW(Config::parse({{"PATH", "/usr/bin"}, {"TIERFLOWX", "1"}}));
}

TEST(Config, BadValuesNameVariableValueAndForms) {
  expect_error({{"TIERFLOW_HOST_MEMORY", "12XB"}}, {},
               {"TIERFLOW_HOST_MEMORY", "'12XB'", "MiB", "percentage"});
  expect_error({{"TIERFLOW_GPU_MEMORY", "150%"}}, {}, {"TIERFLOW_GPU_MEMORY", "150%", "100%"});
  expect_error({{"TIERFLOW_NVME_MEMORY", ""}}, {}, {"TIERFLOW_NVME_MEMORY"});
  expect_error({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "disk"}}, {},
               {"TIERFLOW_OFFLOAD_ACTIVATIONS", "'disk'", "none, host, nvme, recompute, auto"});
  expect_error({{"TIERFLOW_OFFLOAD_PARAMS", "recompute"}}, {},
               {"TIERFLOW_OFFLOAD_PARAMS", "'recompute'", "one of none, host, nvme, auto"});
  expect_error({{"TIERFLOW_OFFLOAD_OPTIMIZER", "gpu"}}, {}, {"TIERFLOW_OFFLOAD_OPTIMIZER", "'gpu'"});
  expect_error({{"TIERFLOW_CPU_THREADS", "0"}}, {}, {"TIERFLOW_CPU_THREADS", "'0'", "auto or an integer"});
  expect_error({{"TIERFLOW_CPU_THREADS", "two"}}, {}, {"TIERFLOW_CPU_THREADS", "'two'"});
  expect_error({{"TIERFLOW_CPU_THREADS", "2.5"}}, {}, {"TIERFLOW_CPU_THREADS"});
  expect_error({{"TIERFLOW_LOG_LEVEL", "loud"}}, {}, {"TIERFLOW_LOG_LEVEL", "error, warn, info, debug"});
  expect_error({{"TIERFLOW_NVME_PATHS", "/a,,/b"}}, {}, {"TIERFLOW_NVME_PATHS", "no empty entries"});
  expect_error({{"TIERFLOW_PREFETCH_BYTES", "0"}}, {}, {"TIERFLOW_PREFETCH_BYTES", "at least 1 byte"});
  expect_error({{"TIERFLOW_PINNED_SLAB_BYTES", "4KiB"}}, {}, {"TIERFLOW_PINNED_SLAB_BYTES", "64KiB"});
  expect_error({{"TIERFLOW_MIN_OFFLOAD_BYTES", "-1"}}, {}, {"TIERFLOW_MIN_OFFLOAD_BYTES"});
  expect_error({{"TIERFLOW_CPU_ISA", "sse9"}}, {}, {"TIERFLOW_CPU_ISA", "'sse9'", "auto, avx512, avx2, portable"});
  expect_error({{"TIERFLOW_MAX_GRAD_NORM", "-1"}}, {}, {"TIERFLOW_MAX_GRAD_NORM", "none or a positive number"});
  expect_error({{"TIERFLOW_MAX_GRAD_NORM", "inf"}}, {}, {"TIERFLOW_MAX_GRAD_NORM"});
  expect_error({{"TIERFLOW_GRAD_ACCUMULATION_STEPS", "0"}}, {}, {"TIERFLOW_GRAD_ACCUMULATION_STEPS", "from 1"});
  expect_error({{"TIERFLOW_OVERLAP_STEP", "yes"}}, {}, {"TIERFLOW_OVERLAP_STEP", "on or off"});
  expect_error({{"TIERFLOW_SKIP_NONFINITE", "1"}}, {}, {"TIERFLOW_SKIP_NONFINITE", "on or off"});
  expect_error({{"TIERFLOW_GPU_OPTIMIZER_FRACTION", "1.5"}}, {}, {"TIERFLOW_GPU_OPTIMIZER_FRACTION", "from 0 to 1"});
  expect_error({{"TIERFLOW_GRAD_BUCKET_BYTES", "1KiB"}}, {}, {"TIERFLOW_GRAD_BUCKET_BYTES", "auto or a size"});
  expect_error({{"TIERFLOW_WEIGHTS_RETURN", "later"}}, {}, {"TIERFLOW_WEIGHTS_RETURN", "step or forward"});
  expect_error({{"TIERFLOW_OFFLOAD_GRADIENTS", "yes"}}, {}, {"TIERFLOW_OFFLOAD_GRADIENTS", "on or off"});
  expect_error({{"TIERFLOW_AIO_BLOCK_SIZE", "1000"}}, {}, {"TIERFLOW_AIO_BLOCK_SIZE", "multiple of 4KiB"});
  expect_error({{"TIERFLOW_AIO_BLOCK_SIZE", "128MiB"}}, {}, {"TIERFLOW_AIO_BLOCK_SIZE"});
  expect_error({{"TIERFLOW_AIO_QUEUE_DEPTH", "0"}}, {}, {"TIERFLOW_AIO_QUEUE_DEPTH", "from 1 to 1024"});
  expect_error({{"TIERFLOW_NVME_CHECKSUM", "maybe"}}, {}, {"TIERFLOW_NVME_CHECKSUM", "on or off"});
  expect_error({{"TIERFLOW_MIMALLOC", "maybe"}}, {}, {"TIERFLOW_MIMALLOC", "on or off"});
}

TEST(Config, OptimizerStreamingSettings) {
  Config d = Config::defaults();
  EXPECT_TRUE(d.gpu_optimizer_fraction_auto);
  EXPECT_EQ(d.grad_bucket_bytes, 0u);  // auto
  EXPECT_FALSE(d.weights_return_in_forward);
  EXPECT_FALSE(d.offload_gradients);
  Config c = Config::parse({{"TIERFLOW_GPU_OPTIMIZER_FRACTION", "0.25"}, {"TIERFLOW_GRAD_BUCKET_BYTES", "16MiB"},
                            {"TIERFLOW_WEIGHTS_RETURN", "forward"}, {"TIERFLOW_OFFLOAD_GRADIENTS", "on"}});
  EXPECT_TRUE(c.offload_gradients);
  EXPECT_EQ(c.to_strings().at("TIERFLOW_OFFLOAD_GRADIENTS"), "on");
  EXPECT_FALSE(c.gpu_optimizer_fraction_auto);
  EXPECT_DOUBLE_EQ(c.gpu_optimizer_fraction, 0.25);
  EXPECT_EQ(c.grad_bucket_bytes, 16u << 20);
  EXPECT_TRUE(c.weights_return_in_forward);
  EXPECT_EQ(c.to_strings().at("TIERFLOW_GRAD_BUCKET_BYTES"), std::to_string(16u << 20));
  EXPECT_EQ(d.to_strings().at("TIERFLOW_GPU_OPTIMIZER_FRACTION"), "auto");
}

TEST(Config, OverridesWinOverVariables) {
  Config c = Config::parse({{"TIERFLOW_HOST_MEMORY", "1GiB"}, {"TIERFLOW_CPU_THREADS", "4"}},
                           {{"host_memory", "2GiB"}, {"TIERFLOW_CPU_THREADS", "1"}});
  EXPECT_EQ(c.host_memory.bytes, 2ULL << 30);
  EXPECT_EQ(c.cpu_threads, 1);
}

TEST(Config, FromEnvironmentReadsTheProcessEnvironment) {
  ScopedEnv a("TIERFLOW_LOG_LEVEL", "info");
  ScopedEnv b("TIERFLOW_CPU_THREADS", "3");
  Config c = Config::from_environment({{"cpu_threads", "5"}});
  EXPECT_EQ(c.log_level, LogLevel::kInfo);
  EXPECT_EQ(c.cpu_threads, 5);
  ScopedEnv bad("TIERFLOW_OFFLOAD_ACTIVATION", "host");
  EXPECT_THROW(Config::from_environment(), config_error);
}

TEST(Config, ClosestName) {
  EXPECT_EQ(closest_config_name("TIERFLOW_REPROT"), "TIERFLOW_REPORT");
  EXPECT_EQ(closest_config_name("TIERFLOW_NVME_PATH"), "TIERFLOW_NVME_PATHS");
}

TEST(Config, RecomputeIsForActivationsOnly) {
  EXPECT_EQ(Config::parse({{"TIERFLOW_OFFLOAD_ACTIVATIONS", "recompute"}}).offload_activations,
            OffloadTarget::kRecompute);
  EXPECT_EQ(Config::parse({{"TIERFLOW_PROFILE", " /tmp/p.json "}}).profile_path, "/tmp/p.json");
  try {
    Config::parse({{"TIERFLOW_OFFLOAD_OPTIMIZER", "recompute"}});
    FAIL() << "recompute accepted for the optimizer";
  } catch (const tierflow::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("one of none, host, nvme"), std::string::npos) << e.what();
  }
}

// ---- issue 16: every value parses exactly or is refused in one line naming the variable ----

namespace {

// The one-line message of a refused value.
std::string refusal(const std::string& name, const std::string& value) {
  try {
    Config::parse({{name, value}});
  } catch (const config_error& e) {
    return e.what();
  }
  ADD_FAILURE() << name << "='" << value << "' accepted";
  return {};
}

}  // namespace

TEST(ConfigIssue16, HexInfAndNanNumbersAreRefused) {
  // strtod took these: TIERFLOW_MAX_GRAD_NORM=0x100 was 256, TIERFLOW_GPU_OPTIMIZER_FRACTION=0x0.8p0 was 0.5.
  for (const char* v : {"0x100", "0X1p0", "inf", "nan", "1e999", "1,0", "1_0"}) {
    EXPECT_NE(refusal("TIERFLOW_MAX_GRAD_NORM", v).find("TIERFLOW_MAX_GRAD_NORM"), std::string::npos) << v;
  }
  for (const char* v : {"0x0.8p0", "0x1", "nan", "-inf", ".5e", "0.5.0"}) {
    EXPECT_NE(refusal("TIERFLOW_GPU_OPTIMIZER_FRACTION", v).find("from 0 to 1"), std::string::npos) << v;
  }
  EXPECT_DOUBLE_EQ(Config::parse({{"TIERFLOW_MAX_GRAD_NORM", "1e-2"}}).max_grad_norm, 0.01);
  EXPECT_DOUBLE_EQ(Config::parse({{"TIERFLOW_GPU_OPTIMIZER_FRACTION", ".5"}}).gpu_optimizer_fraction, 0.5);
}

TEST(ConfigIssue16, IntegersAreDecimalDigitsOnly) {
  for (const char* name : {"TIERFLOW_AIO_QUEUE_DEPTH", "TIERFLOW_CPU_THREADS", "TIERFLOW_GRAD_ACCUMULATION_STEPS"}) {
    for (const char* v : {"0x10", "+4", "-4", "4.0", "1e2", "99999999999999999999999", "4 4"}) {
      EXPECT_NE(refusal(name, v).find(name), std::string::npos) << name << "=" << v;
    }
  }
  for (const char* v : {"-1", "+1", "0x1", "9223372036854775809", "18446744073709551616"}) {
    EXPECT_NE(refusal("TIERFLOW_EMULATED_SEED", v).find("from 0 to 2^63"), std::string::npos) << v;
  }
  EXPECT_EQ(Config::parse({{"TIERFLOW_EMULATED_SEED", "9223372036854775808"}}).emulated_seed, 1ULL << 63);
}

TEST(ConfigIssue16, SizesAreExactOrRefused) {
  // llround past 2^63 made this 9223372036854775808.
  EXPECT_EQ(Config::parse({{"TIERFLOW_HOST_MEMORY", "10000000TB"}}).host_memory.bytes, 10000000000000000000ULL);
  EXPECT_NE(refusal("TIERFLOW_HOST_MEMORY", "20000000TB").find("TIERFLOW_HOST_MEMORY='20000000TB'"),
            std::string::npos);
  EXPECT_NE(refusal("TIERFLOW_PREFETCH_BYTES", "18446744073709551616").find("TIERFLOW_PREFETCH_BYTES"),
            std::string::npos);
  EXPECT_EQ(Config::parse({{"TIERFLOW_PREFETCH_BYTES", "18446744073709551615"}}).prefetch_bytes, UINT64_MAX);
}

TEST(ConfigIssue16, ListItemsAreNeverDropped) {
  for (const char* v : {"/a,", ",/a", "/a,,/b", "/a, ,/b", ",", " , ", "/a,/b,"}) {
    const std::string msg = refusal("TIERFLOW_NVME_PATHS", v);
    EXPECT_NE(msg.find("TIERFLOW_NVME_PATHS"), std::string::npos) << v;
    EXPECT_NE(msg.find("is empty"), std::string::npos) << msg;
  }
  EXPECT_TRUE(Config::parse({{"TIERFLOW_NVME_PATHS", ""}}).nvme_paths.empty());
  EXPECT_TRUE(Config::parse({{"TIERFLOW_NVME_PATHS", "   "}}).nvme_paths.empty());
  EXPECT_EQ(Config::parse({{"TIERFLOW_NVME_PATHS", " /a "}}).nvme_paths, std::vector<std::string>{"/a"});
  EXPECT_EQ(Config::parse({{"TIERFLOW_NVME_PATHS", "/a,/b,/c"}}).nvme_paths.size(), 3u);
}

TEST(ConfigIssue16, ZeroDeviceAndHostBudgetsAreRefusedHere) {
  for (const char* name : {"TIERFLOW_GPU_MEMORY", "TIERFLOW_HOST_MEMORY"}) {
    for (const char* v : {"0", "0B", "0GiB", "0.0MiB"}) {
      const std::string msg = refusal(name, v);
      EXPECT_NE(msg.find(std::string(name) + "='" + v + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("0 bytes"), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(Config::parse({{"TIERFLOW_GPU_MEMORY", "1"}}).gpu_memory.bytes, 1u);
}

TEST(ConfigIssue16, ReportAndProfileMustNotBeDirectories) {
  for (const char* name : {"TIERFLOW_REPORT", "TIERFLOW_PROFILE"}) {
    for (const char* v : {"/tmp", "/tmp/", ".", "/no/such/dir/"}) {
      const std::string msg = refusal(name, v);
      EXPECT_NE(msg.find(name), std::string::npos) << msg;
      EXPECT_NE(msg.find("directory"), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(Config::parse({{"TIERFLOW_REPORT", "/tmp/tierflow-report-test.json"}}).report_path,
            "/tmp/tierflow-report-test.json");
}

TEST(ConfigIssue16, ValuesThatAreNotUtf8AreRefusedInOneLine) {
  for (const char* name : {"TIERFLOW_REPORT", "TIERFLOW_NVME_PATHS", "TIERFLOW_HOST_MEMORY", "TIERFLOW_LOG_LEVEL"}) {
    const std::string msg = refusal(name, "/tmp/\xff\xfe.json");
    EXPECT_NE(msg.find(std::string(name) + "='/tmp/\\xff\\xfe.json'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not UTF-8"), std::string::npos) << msg;
  }
  // Overlong forms and surrogates are not UTF-8 either; NUL is no text.
  for (const char* v : {"\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"}) refusal("TIERFLOW_REPORT", v);
  EXPECT_NE(refusal("TIERFLOW_REPORT", std::string("a\0b", 3)).find("'a\\x00b'"), std::string::npos);
  EXPECT_EQ(Config::parse({{"TIERFLOW_REPORT", "/tmp/r\xc3\xa9sum\xc3\xa9.json"}}).report_path,
            "/tmp/r\xc3\xa9sum\xc3\xa9.json");
}

TEST(ConfigIssue16, MessagesAreOneLineWhateverTheValueHolds) {
  for (const std::string v : {"1\nGiX", "x\r\n", "\x85", "\xe2\x80\xa8", "\x0b\x0c\x1c", "it's", "a\\b"}) {
    const std::string msg = refusal("TIERFLOW_HOST_MEMORY", v);
    EXPECT_EQ(msg.find_first_of("\n\r\x0b\x0c\x1c\x1d\x1e"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("\xe2\x80\xa8"), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("TIERFLOW_HOST_MEMORY='", 0), 0u) << msg;
  }
  EXPECT_EQ(quote_config_value("1\nGiB"), "'1\\nGiB'");
  EXPECT_EQ(quote_config_value("\xc2\x85"), "'\\u0085'");
  EXPECT_EQ(quote_config_value("\xe2\x80\xa8"), "'\\u2028'");
  EXPECT_EQ(quote_config_value("it's"), "'it\\'s'");
  EXPECT_EQ(quote_config_value("\xff"), "'\\xff'");
  // Unknown names are quoted too.
  expect_error({{"TIERFLOW_X\nY", "1"}}, {}, {"'TIERFLOW_X\\nY'"});
}

TEST(ConfigIssue16, ParseSettingValidatesAsTheTableAndNamesTheLabel) {
  EXPECT_EQ(parse_setting("TIERFLOW_PREFETCH_BYTES", "8MiB"), std::to_string(8 << 20));
  EXPECT_EQ(parse_setting("gpu_memory", "90%"), "90%");
  try {
    parse_setting("TIERFLOW_PREFETCH_BYTES", "0", "--prefetch");
    FAIL() << "--prefetch 0 accepted";
  } catch (const config_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("--prefetch='0' is not valid; accepted: a size of at least 1 byte", 0), 0u)
        << e.what();
  }
  EXPECT_THROW(parse_setting("TIERFLOW_NO_SUCH", "1"), config_error);
}

TEST(Config, RemembersWhichVariablesWereGiven) {
  // `python -m tierflow plan` tells a budget that was set from one left at its default.
  const auto c = tierflow::Config::parse({{"TIERFLOW_GPU_MEMORY", "8GiB"}, {"OTHER", "x"}}, {{"host_memory", "1GiB"}});
  EXPECT_EQ(c.given, (std::set<std::string>{"TIERFLOW_GPU_MEMORY", "TIERFLOW_HOST_MEMORY"}));
  EXPECT_TRUE(tierflow::Config::defaults().given.empty());
  EXPECT_TRUE(tierflow::Config::parse({}).given.empty());
}

// ---- Note [Settings a mode ignores] and the paths checked when parsed (issue 37) ----------------------------------

namespace {

tierflow::IgnoredSettings ignored_on(const std::map<std::string, std::string>& overrides, bool cuda) {
  return tierflow::ignored_settings(tierflow::Config::parse({}, overrides), tierflow::ModelFacts{cuda});
}

std::string ignored(const std::map<std::string, std::string>& overrides) { return ignored_on(overrides, false).refusal; }

// The one warning line naming `variable`, or "" (and a failure) when there is not exactly one such line.
std::string warned(const std::map<std::string, std::string>& overrides, const std::string& variable,
                   bool cuda = false) {
  const auto r = ignored_on(overrides, cuda);
  EXPECT_EQ(r.refusal, "") << variable;
  std::string line;
  int n = 0;
  for (const auto& w : r.warnings)
    if (w.find(variable + "=") != std::string::npos) line = w, ++n;
  EXPECT_EQ(n, 1) << variable;
  return line;
}

std::string parse_error(const std::map<std::string, std::string>& overrides) {
  try {
    tierflow::Config::parse({}, overrides);
  } catch (const tierflow::config_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ConfigIgnored, WhatChangesResultsOrMemoryWithOffloadOptimizerNoneIsRefusedNamingBoth) {
  const std::string why = ignored({{"offload_optimizer", "none"}, {"skip_nonfinite", "on"}});
  EXPECT_NE(why.find("TIERFLOW_SKIP_NONFINITE='on' (keyword skip_nonfinite) is ignored with "
                     "TIERFLOW_OFFLOAD_OPTIMIZER=none (keyword offload_optimizer)"), std::string::npos) << why;
  EXPECT_NE(why.find("accepted:"), std::string::npos) << why;
  EXPECT_NE(why.find("GradScaler"), std::string::npos) << why;
  const std::string clip = ignored({{"offload_optimizer", "none"}, {"max_grad_norm", "1.0"}});
  EXPECT_NE(clip.find("TIERFLOW_MAX_GRAD_NORM"), std::string::npos) << clip;
  EXPECT_NE(clip.find("clip_grad_norm_"), std::string::npos) << clip;
  for (const char* key : {"offload_gradients", "partition_optimizer"}) {
    const std::string why = ignored({{"offload_optimizer", "none"}, {key, "on"}});
    EXPECT_NE(why.find(std::string("(keyword ") + key + ") is ignored with TIERFLOW_OFFLOAD_OPTIMIZER=none"),
              std::string::npos) << why;
    EXPECT_NE(why.find("accepted: TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme"), std::string::npos) << why;
    EXPECT_EQ(ignored({{"offload_optimizer", "host"}, {key, "on"}}), "") << key;
  }
  // A refusal wins over the warnings beside it.
  EXPECT_NE(ignored({{"offload_optimizer", "none"}, {"overlap_step", "off"}, {"max_grad_norm", "1"}})
                .find("TIERFLOW_MAX_GRAD_NORM"), std::string::npos);
}

TEST(ConfigIgnored, TheCpuOptimizersSpeedSettingsWithOffloadOptimizerNoneWarnOnceEach) {
  const std::map<std::string, std::string> values = {
      {"overlap_step", "off"}, {"grad_bucket_bytes", "8MiB"}, {"weights_return", "forward"},
      {"grad_accumulation_steps", "4"}, {"gpu_optimizer_fraction", "0.5"}, {"cpu_threads", "2"},
      {"cpu_isa", "portable"}};
  for (const auto& [key, value] : values) {
    std::string variable = "TIERFLOW_" + key;
    std::transform(variable.begin(), variable.end(), variable.begin(), ::toupper);
    const std::string line = warned({{"offload_optimizer", "none"}, {key, value}}, variable, /*cuda=*/true);
    EXPECT_NE(line.find("(keyword " + key + ") is ignored with TIERFLOW_OFFLOAD_OPTIMIZER=none "
                        "(keyword offload_optimizer)"), std::string::npos) << line;
    EXPECT_NE(line.find("it would act with TIERFLOW_OFFLOAD_OPTIMIZER=host or nvme"), std::string::npos) << line;
    EXPECT_TRUE(ignored_on({{"offload_optimizer", "host"}, {key, value}}, true).warnings.empty()) << key;
  }
  // Several ignored settings: one line each.
  EXPECT_EQ(ignored_on({{"offload_optimizer", "none"}, {"overlap_step", "off"}, {"cpu_threads", "2"}}, true)
                .warnings.size(), 2u);
}

TEST(ConfigIgnored, DefaultsAndSettingsTheModeUsesAreLetThroughSilently) {
  EXPECT_EQ(ignored({}), "");
  EXPECT_TRUE(ignored_on({}, false).warnings.empty());
  EXPECT_TRUE(ignored_on({{"offload_optimizer", "none"}}, false).warnings.empty());
  // Given, but at its default: changes nothing either way.
  const auto at_default = ignored_on({{"offload_optimizer", "none"}, {"skip_nonfinite", "off"},
                                      {"max_grad_norm", "none"}, {"overlap_step", "on"}, {"gpu_memory", "90%"}},
                                     false);
  EXPECT_EQ(at_default.refusal, "");
  EXPECT_TRUE(at_default.warnings.empty());
  EXPECT_EQ(ignored({{"offload_optimizer", "host"}, {"skip_nonfinite", "on"}, {"max_grad_norm", "1"}}), "");
  EXPECT_EQ(ignored({{"offload_optimizer", "nvme"}, {"nvme_paths", "/x"}, {"max_grad_norm", "1"}}), "");
  EXPECT_TRUE(ignored_on({{"gpu_memory", "1GiB"}, {"profile", "/tmp/p.json"}, {"min_offload_bytes", "0"},
                          {"gpu_optimizer_fraction", "0.5"}}, true).warnings.empty());
  // A parsed config remembers nothing as given: nothing is ignored.
  EXPECT_TRUE(tierflow::ignored_settings(tierflow::Config::defaults(), {}).warnings.empty());
}

TEST(ConfigIgnored, TheStreamsSettingsWithoutStepsDuringBackwardWarn) {
  const std::string off = warned({{"overlap_step", "off"}, {"grad_bucket_bytes", "8MiB"}}, "TIERFLOW_GRAD_BUCKET_BYTES");
  EXPECT_NE(off.find("TIERFLOW_GRAD_BUCKET_BYTES='8388608' (keyword grad_bucket_bytes) is ignored with "
                     "TIERFLOW_OVERLAP_STEP=off (keyword overlap_step)"), std::string::npos) << off;
  const std::string nvme = warned({{"offload_optimizer", "nvme"}, {"nvme_paths", "/x"}, {"weights_return", "forward"}},
                                  "TIERFLOW_WEIGHTS_RETURN");
  EXPECT_NE(nvme.find("TIERFLOW_WEIGHTS_RETURN='forward' (keyword weights_return) is ignored with "
                      "TIERFLOW_OFFLOAD_OPTIMIZER=nvme"), std::string::npos) << nvme;
  warned({{"offload_optimizer", "nvme"}, {"nvme_paths", "/x"}, {"overlap_step", "off"}}, "TIERFLOW_OVERLAP_STEP");
  warned({{"overlap_step", "off"}, {"grad_accumulation_steps", "4"}}, "TIERFLOW_GRAD_ACCUMULATION_STEPS");
}

TEST(ConfigIgnored, NvmePlannerSwapHostAndGpuShareSettingsWithoutTheirUseWarn) {
  for (const char* key : {"nvme_checksum", "nvme_memory", "aio_block_size", "aio_queue_depth"}) {
    const std::map<std::string, std::string> values = {
        {"nvme_checksum", "off"}, {"nvme_memory", "1GiB"}, {"aio_block_size", "4KiB"}, {"aio_queue_depth", "8"}};
    std::string variable = std::string("TIERFLOW_") + key;
    std::transform(variable.begin(), variable.end(), variable.begin(), ::toupper);
    const std::string line = warned({{key, values.at(key)}}, variable);
    EXPECT_NE(line.find("is ignored with TIERFLOW_NVME_PATHS=(empty) (keyword nvme_paths)"), std::string::npos)
        << line;
    EXPECT_TRUE(ignored_on({{key, values.at(key)}, {"nvme_paths", "/x"}}, false).warnings.empty()) << key;
  }
  const std::string replan = warned({{"offload_activations", "host"}, {"replan", "off"}}, "TIERFLOW_REPLAN");
  EXPECT_NE(replan.find("TIERFLOW_REPLAN='off' (keyword replan) is ignored with TIERFLOW_OFFLOAD_ACTIVATIONS=host"),
            std::string::npos) << replan;
  warned({{"offload_activations", "none"}, {"profile", "/tmp/p.json"}}, "TIERFLOW_PROFILE");
  warned({{"offload_activations", "recompute"}, {"profile", "/tmp/p.json"}}, "TIERFLOW_PROFILE");
  EXPECT_TRUE(ignored_on({{"offload_activations", "auto"}, {"replan", "off"}}, false).warnings.empty());
  for (const char* key : {"min_offload_bytes", "prefetch_bytes"}) {
    std::string variable = std::string("TIERFLOW_") + key;
    std::transform(variable.begin(), variable.end(), variable.begin(), ::toupper);
    warned({{"offload_activations", "none"}, {key, "8MiB"}}, variable);
    EXPECT_TRUE(ignored_on({{"offload_activations", "host"}, {key, "8MiB"}}, false).warnings.empty()) << key;
  }
  // The GPU share: off CUDA, every state steps on the CPU.
  const std::string share = warned({{"gpu_optimizer_fraction", "0.5"}}, "TIERFLOW_GPU_OPTIMIZER_FRACTION");
  EXPECT_NE(share.find("not on a CUDA GPU"), std::string::npos) << share;
  EXPECT_TRUE(ignored_on({{"gpu_optimizer_fraction", "0.5"}}, true).warnings.empty());
  // Nothing goes to the host.
  warned({{"offload_activations", "none"}, {"offload_optimizer", "none"}, {"host_memory", "1GiB"}},
         "TIERFLOW_HOST_MEMORY");
  EXPECT_TRUE(ignored_on({{"offload_activations", "none"}, {"host_memory", "1GiB"}}, false).warnings.empty());
}

TEST(ConfigIgnored, TheDeviceBudgetInAFixedActivationModeWarnsUnlessSomethingElseReadsIt) {
  for (const char* mode : {"none", "host", "recompute"}) {
    const std::string line = warned({{"offload_activations", mode}, {"gpu_memory", "1KiB"}}, "TIERFLOW_GPU_MEMORY");
    EXPECT_NE(line.find(std::string("is ignored with TIERFLOW_OFFLOAD_ACTIVATIONS=") + mode), std::string::npos)
        << line;
    EXPECT_NE(line.find("does not plan by the device budget"), std::string::npos) << line;
  }
  // The parameters' residency and the GPU share's choice read it.
  EXPECT_TRUE(ignored_on({{"offload_activations", "none"}, {"offload_params", "host"}, {"gpu_memory", "1GiB"}}, false)
                  .warnings.empty());
  EXPECT_TRUE(ignored_on({{"offload_activations", "none"}, {"gpu_memory", "1GiB"}}, true).warnings.empty());
  warned({{"offload_activations", "none"}, {"gpu_memory", "1GiB"}, {"gpu_optimizer_fraction", "0"}},
         "TIERFLOW_GPU_MEMORY", /*cuda=*/true);
}

TEST(ConfigNvmePaths, AFileOrTheSameDirectoryTwiceIsRefusedWhenParsed) {
  char dir_template[] = "/tmp/tierflow-config-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template, file = dir + "/a-file", link = dir + "-link";
  { std::FILE* f = std::fopen(file.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  ASSERT_EQ(::symlink(dir.c_str(), link.c_str()), 0);
  const std::string as_file = parse_error({{"nvme_paths", file}});
  EXPECT_NE(as_file.find("TIERFLOW_NVME_PATHS="), std::string::npos) << as_file;
  EXPECT_NE(as_file.find("a-file': Not a directory"), std::string::npos) << as_file;
  EXPECT_NE(as_file.find("accepted:"), std::string::npos) << as_file;
  const std::string twice = parse_error({{"nvme_paths", dir + "," + dir + "/"}});
  EXPECT_NE(twice.find("are the same directory"), std::string::npos) << twice;
  const std::string linked = parse_error({{"nvme_paths", dir + "," + link}});
  EXPECT_NE(linked.find("are the same directory"), std::string::npos) << linked;
  EXPECT_EQ(parse_error({{"nvme_paths", dir}}), "");
  EXPECT_EQ(parse_error({{"nvme_paths", dir + "/missing-yet"}}), "");  // the runtime names a missing one
  ::unlink(link.c_str());
  ::unlink(file.c_str());
  ::rmdir(dir.c_str());
}

TEST(ConfigReport, AReportUnderAFileIsRefusedWhenParsed) {
  char dir_template[] = "/tmp/tierflow-report-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template, file = dir + "/a-file";
  { std::FILE* f = std::fopen(file.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  const std::string why = parse_error({{"report", file + "/sub/r.json"}});
  EXPECT_NE(why.find("TIERFLOW_REPORT='" + file + "/sub/r.json' is not valid ('" + file +
                     "' on its way is not a directory)"), std::string::npos) << why;
  EXPECT_EQ(parse_error({{"report", dir + "/new/dirs/r.json"}}), "");  // made when the report is written
  EXPECT_EQ(parse_error({{"report", "r.json"}}), "");  // the working directory
  ::unlink(file.c_str());
  ::rmdir(dir.c_str());
}

TEST(ConfigKeywords, AListIsTheValueOfAListSettingOnly) {
  EXPECT_EQ(collection_value_refusal("nvme_paths", true, "list", "['/a', '/b']"), "");
  EXPECT_EQ(collection_value_refusal("TIERFLOW_NVME_PATHS", true, "tuple", "('/a',)"), "");
  EXPECT_EQ(collection_value_refusal("no_such_setting", false, "set", "{1}"), "") << "parse names the closest one";
  const std::string paths_set = collection_value_refusal("nvme_paths", false, "set", "{'/a'}");
  EXPECT_EQ(paths_set.rfind("nvme_paths={'/a'} (TIERFLOW_NVME_PATHS) is a set, where one value is expected; accepted: ",
                            0), 0u) << "a set has no order to join: " << paths_set;
  const std::string host = collection_value_refusal("host_memory", true, "list", "['1GiB', '2GiB']");
  EXPECT_EQ(host.rfind("host_memory=['1GiB', '2GiB'] (TIERFLOW_HOST_MEMORY) is a list, where one value is expected; "
                       "accepted: ", 0), 0u) << host;
  EXPECT_NE(host.find("accepted: a size"), std::string::npos) << host;
}

TEST(Config, ParseLogLevelReadsEveryNameTheSettingAccepts) {
  // The one reader of a level's name (the settings table, _C.log and _core's copy of the level).
  EXPECT_EQ(parse_log_level("error"), LogLevel::kError);
  EXPECT_EQ(parse_log_level(" WARN "), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("warning"), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("Info"), LogLevel::kInfo);
  EXPECT_EQ(parse_log_level("debug\n"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("verbose"), std::nullopt);
  EXPECT_EQ(parse_log_level(""), std::nullopt);
  for (LogLevel l : {LogLevel::kError, LogLevel::kWarn, LogLevel::kInfo, LogLevel::kDebug})
    EXPECT_EQ(parse_log_level(to_string(l)), l);
  Config c = Config::parse({{"TIERFLOW_LOG_LEVEL", "Warning"}}, {});
  EXPECT_EQ(c.log_level, LogLevel::kWarn);
  EXPECT_THROW(Config::parse({{"TIERFLOW_LOG_LEVEL", "verbose"}}, {}), config_error);
}
