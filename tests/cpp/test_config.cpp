#include <gtest/gtest.h>

#include <cstdlib>
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
  expect_error({{"TIERFLOW_OFFLOAD_PARAMS", "auto"}}, {}, {"TIERFLOW_OFFLOAD_PARAMS", "none, host, nvme"});
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
