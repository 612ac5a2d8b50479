// What tests, benchmarks and examples need besides the layer (library mok::mok_testing):
// the fp64 CPU reference of the whole layer (the oracle), synthetic routings and problems,
// and the named presets of bench/presets.csv. Not part of <mok/mok.hpp>.
#pragma once

#include "mok/presets.hpp"
#include "mok/problem.hpp"
#include "mok/reference.hpp"
#include "mok/routing.hpp"
