// MoK for Hopper: a deterministic Mixture-of-Experts training megakernel.
#pragma once

#include "mok/bf16.hpp"
#include "mok/device.hpp"
#include "mok/error.hpp"
#include "mok/plan.hpp"
#include "mok/types.hpp"
#include "mok/validate.hpp"
#include "mok/version.hpp"
#include "mok/device_plan.hpp"
#include "mok/forward.hpp"
#include "mok/backward.hpp"
#include "mok/ep.hpp"
#include "mok/fp8.hpp"
