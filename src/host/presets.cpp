#include "mok/presets.hpp"

#include <sstream>

#include "mok/error.hpp"
#include "presets_csv.hpp"  // generated from bench/presets.csv: kPresetsCsv

namespace mok {
namespace {

std::vector<Preset> parse(const char* csv) {
  std::vector<Preset> out;
  std::istringstream lines(csv);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f;
    std::istringstream cells(line);
    for (std::string cell; std::getline(cells, cell, ',');) f.push_back(cell);
    if (f.size() < 10) throw Error("mok::presets: malformed line in bench/presets.csv: " + line);
    Preset p;
    p.name = f[0];
    p.tokens = std::stoll(f[1]);
    p.shape.hidden = std::stoll(f[2]);
    p.shape.intermediate = std::stoll(f[3]);
    p.shape.num_experts = p.shape.num_local_experts = std::stoll(f[4]);
    p.shape.top_k = std::stoll(f[5]);
    p.shape.shared_intermediate = std::stoll(f[6]);
    if (const float limit = std::stof(f[7]); limit > 0) p.shape.swiglu_limit = limit;
    p.model_experts = std::stoll(f[8]);
    p.model_ep = std::stoll(f[9]);
    p.note = f.size() > 10 ? f[10] : "";
    validate(p.shape);
    out.push_back(p);
  }
  return out;
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> table = parse(kPresetsCsv);
  return table;
}

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const Preset& p : presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw_argument_error("mok::find_preset", "name", "unknown preset '", name, "'; known: ", known);
}

}  // namespace mok
