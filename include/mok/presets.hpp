// Named layer shapes (bench/presets.csv, compiled in): the benchmark presets and the
// small CPU-sized cases of the examples.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/types.hpp"

namespace mok {

struct Preset {
  std::string name;
  std::int64_t tokens = 0;  // local tokens
  MoeShape shape;           // one GPU's share: num_experts == num_local_experts
  std::int64_t model_experts = 0, model_ep = 1;
  std::string note;
};

const std::vector<Preset>& presets();
// Throws mok::Error listing the known names if `name` is not one of them.
const Preset& find_preset(const std::string& name);

}  // namespace mok
