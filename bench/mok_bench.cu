// Benchmark harness of the C++ layer. Two ways to run it:
//
//   mok_bench [--preset all|NAME,...] [--impl mok,mok-pp,mok-ep1,mok-fp8,cublas,plan] ...   (standalone)
//       times implementations on named presets, with its own inputs (uniform routing), and
//       writes records in the schema shared with bench/torch_baseline.py:
//       preset, impl, pass, tokens, ep, ms (median), ms_p10, ms_p90, tflops, peak_bytes,
//       gpu, commit, date, hidden, intermediate, experts, top_k, routing, iters
//   mok_bench --serve
//       the "mok" implementation of bench/layer_bench.py: reads one command a line on
//       stdin and answers one JSON line on stdout, so that the Python driver interleaves
//       it with the PyTorch implementations on the very same inputs:
//         load PRESET SEED IDS_FILE WEIGHTS_FILE  inputs: x, weights, dy from fill_bits
//                                                 (seeded as layer_bench.py's hash_fill),
//                                                 routing from the files (i32 / f32 [T, k])
//         check PASS [IMPL]                       one pass with poisoned outputs; answers the
//                                                 checksum of each output (y, dx, d_topk_weights,
//                                                 every weight gradient): the driver compares
//                                                 them with mok.moe's, which it checks against
//                                                 the PyTorch path at full size
//         time PASS WARMUP ITERS [IMPL]           each iteration's ms, L2 flushed before each,
//                                                 and its host time to enqueue the pass
//         time-queued PASS WARMUP ITERS [IMPL]    the same, every iteration enqueued before the
//                                                 first is waited for (time_iterations' queued)
//         peak PASS [IMPL]                        bytes one pass needs beyond inputs and weights
//                                                 (IMPL: mok, the default, or any mok-* impl below but mok-ep1)
//         quit
//   mok_bench --fill-sample SEED N                 (no GPU) the first N values fill_bits gives,
//                                                 for the CPU test of layer_bench's hash_fill
//
// impls (standalone):
//   cublas cuBLAS GEMMs with the layer's FLOPs as if every routed row went to one expert
//          (+ the shared expert's): the ceiling a grouped kernel is measured against
//   plan   the device planner alone (pass "plan"): its cost inside every pass
//   mok    the fused layer: "fwd" (forward, Training::off), "fwd+bwd" (forward saving the
//          pre-activations, then the fused backward into bf16 gradients); the forward is
//          checked first on sampled tokens against the fp64 CPU reference, the backward's
//          outputs for finiteness (the full-size check is layer_bench.py's)
//   mok-pp the same with Config::pingpong (the forward's ping-pong consumer warpgroups)
//   mok-ep1 the same layer through the expert-parallel machinery as an EP group of one rank
//   mok-fp8 Precision::fp8: the FP8 forward, and in fwd+bwd the backward with the FP8 dgrad;
//          weights quantized once beforehand; the forward checked on sampled tokens against the
//          FP8 recipe's fp64 reference
//   mok-fp8-bf16dgrad  the same forward, the backward's dgrad in bf16 (pass fwd+bwd)
//   mok-fp8-wgrad      mok-fp8 with the weight gradients in E4M3 too (pass fwd+bwd;
//                      BackwardArgs::fp8_weight_gradients)
//   mok-fp8-step       mok-fp8-wgrad with the routed weights quantized again in every pass (the
//                      forward's and the dgrad's): a training step with one micro-batch an
//                      optimizer step (pass fwd+bwd)
//   mok-recompute      mok with Training::recompute (pass fwd+bwd: nothing saved, GEMM1 again in
//                      the backward, which runs in two column blocks where I > H, else one; the
//                      same bits)
//   mok-1block         mok with Config::backward_column_blocks = 1 (the backward's x rows whole, in
//                      one launch; the same bits)
//   mok-fp8-wgrad-1block, mok-fp8-wgrad-2block  mok-fp8-wgrad with Config::backward_column_blocks = 1 / 2
//                      (pass fwd+bwd; the same bits; a Precision::fp8 workspace's default is one where
//                      H <= 2048, else two)
//   mok-fp8-2block     mok-fp8 with Config::backward_column_blocks = 2 (the same bits)
//   mok-fp8-bf16dgrad-2block  mok-fp8-bf16dgrad with Config::backward_column_blocks = 2 (pass fwd+bwd;
//                      the same bits)
//   mok-recompute-1block, mok-recompute-2block  mok-recompute with Config::backward_column_blocks
//                      = 1 / 2 (pass fwd+bwd; the recompute's GEMM1 on whole rows, then one or two
//                      column blocks; the same bits)
// peak_bytes (mok): the workspace + y + the high-water mark of what one pass allocates from
// a caching stream-ordered pool (scratch; fwd+bwd: saved tensor, dx, d_topk_weights, bf16
// weight gradients, allocated when the backward runs), as PyTorch's allocator would count it.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "mok/mok.hpp"
#include "mok_bench/layer.cuh"
#include "mok_bench/support.cuh"
#ifdef MOK_PHASE_TIMING
#include "kernels/common/phase_timing.cuh"
#endif

namespace mok_bench {

void write_json(const Options& o, const std::vector<Record>& records, const std::string& gpu) {
  std::ostringstream js;
  js << "[\n";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    js << "  {\"preset\": \"" << r.preset << "\", \"impl\": \"" << r.impl << "\", \"pass\": \"" << r.pass
       << "\", \"tokens\": " << r.tokens << ", \"ep\": " << r.ep << ", \"ms\": " << r.ms
       << ", \"ms_p10\": " << r.ms_p10 << ", \"ms_p90\": " << r.ms_p90 << ", \"tflops\": " << r.tflops
       << ", \"peak_bytes\": " << r.peak_bytes << ", \"gpu\": \"" << gpu << "\", \"commit\": \"" << o.commit
       << "\", \"date\": \"" << o.date << "\", \"hidden\": " << r.hidden << ", \"intermediate\": " << r.intermediate
       << ", \"experts\": " << r.experts << ", \"top_k\": " << r.top_k
       << ", \"shared_intermediate\": " << r.shared_intermediate
       << ", \"routing\": \"uniform\", \"iters\": " << r.iters << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  js << "]\n";
  std::ofstream(o.out) << js.str();
}

template <typename T>
std::vector<T> read_binary(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw mok::Error("mok_bench: cannot read " + path);
  const std::streamsize bytes = in.tellg();
  if (bytes % sizeof(T) != 0) throw mok::Error("mok_bench: " + path + " is not a whole number of elements");
  std::vector<T> v(bytes / sizeof(T));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), bytes);
  return v;
}

// The one-GPU layer's implementations (FusedLayer's; --serve takes these, --impl these and
// mok-ep1, cublas and plan), and a list of names for an error.
constexpr const char* kLayerImpls[] = {"mok",           "mok-fp8",      "mok-pp",        "mok-fp8-bf16dgrad",
                                       "mok-fp8-wgrad", "mok-fp8-step", "mok-recompute", "mok-1block",
                                       "mok-recompute-1block", "mok-recompute-2block", "mok-fp8-wgrad-1block",
                                       "mok-fp8-wgrad-2block", "mok-fp8-2block", "mok-fp8-bf16dgrad-2block"};
bool is_layer_impl(const std::string& impl) {
  return std::find(std::begin(kLayerImpls), std::end(kLayerImpls), impl) != std::end(kLayerImpls);
}
std::string impl_list(std::span<const char* const> list) {
  std::string s;
  for (const char* n : list) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

// --serve: the "mok" implementation of bench/layer_bench.py (see the top of this file).
int serve() {
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<Problem> problem;
  const auto& impls = kLayerImpls;
  std::unique_ptr<FusedLayer> layers[2 * std::size(impls)];  // each impl's fwd, fwd+bwd
  auto layer = [&](const std::string& pass, std::istringstream& in) -> FusedLayer& {
    if (!problem) throw mok::Error("mok_bench: 'load' a preset first");
    if (pass != "fwd" && pass != "fwd+bwd") throw mok::Error("mok_bench: pass must be fwd or fwd+bwd, got '" + pass + "'");
    std::string impl = "mok";
    in >> impl;  // (optional)
    const auto known = std::find(std::begin(impls), std::end(impls), impl);
    if (known == std::end(impls))
      throw mok::Error("mok_bench: impl must be one of " + impl_list(impls) + ", got '" + impl + "'");
    auto& l = layers[2 * (known - std::begin(impls)) + (pass == "fwd+bwd")];
    if (!l) l = std::make_unique<FusedLayer>(*problem, impl, pass, mok::Config{}, stream);
    return *l;
  };
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    std::string cmd, pass;
    in >> cmd;
    std::ostringstream reply;
    try {
      if (cmd == "quit") break;
      if (cmd == "load") {
        std::string preset, ids_path, weights_path;
        std::uint32_t seed = 0;
        if (!(in >> preset >> seed >> ids_path >> weights_path)) throw mok::Error("mok_bench: load PRESET SEED IDS WEIGHTS");
        for (auto& l : layers) l.reset();
        problem.reset();
        problem = std::make_unique<Problem>(mok::find_preset(preset), seed, read_binary<std::int32_t>(ids_path),
                                            read_binary<float>(weights_path), stream);
        reply << "{\"ok\": true}";
      } else if (cmd == "check") {
        in >> pass;
        FusedLayer& l = layer(pass, in);
        l.step(/*keep=*/true);
        l.check_status();
        reply << "{\"checksums\": {";
        const auto outs = l.outputs();
        for (std::size_t i = 0; i < outs.size(); ++i)
          reply << (i ? ", " : "") << "\"" << outs[i].first << "\": \""
                << checksum(outs[i].second.first, outs[i].second.second, stream) << "\"";
        reply << "}}";
        l.release_kept();
      } else if (cmd == "time" || cmd == "time-queued") {  // (time_iterations' synced or queued loop)
        int warmup = 0, iters = 0;
        if (!(in >> pass >> warmup >> iters) || iters < 1)
          throw mok::Error("mok_bench: " + cmd + " PASS WARMUP ITERS [IMPL]");
        FusedLayer& l = layer(pass, in);
        std::vector<double> host_ms;
        const auto ms = time_iterations(warmup, iters, stream, [&] { l.step(); }, &host_ms, cmd == "time-queued");
        l.check_status();
        reply << "{\"ms\": [";
        for (std::size_t i = 0; i < ms.size(); ++i) reply << (i ? ", " : "") << ms[i];
        reply << "], \"host_ms\": [";
        for (std::size_t i = 0; i < host_ms.size(); ++i) reply << (i ? ", " : "") << host_ms[i];
        reply << "]}";
      } else if (cmd == "peak") {
        in >> pass;
        reply << "{\"peak_bytes\": " << layer(pass, in).peak_bytes() << "}";
      } else {
        throw mok::Error("mok_bench: unknown command '" + cmd + "' (load, check, time, time-queued, peak, quit)");
      }
    } catch (const std::exception& e) {
      reply.str("");
      reply << "{\"error\": \"" << json_escape(e.what()) << "\"}";
    }
    std::cout << reply.str() << std::endl;  // (endl flushes: the driver waits for the line)
  }
  for (auto& l : layers) l.reset();
  problem.reset();
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace mok_bench

using namespace mok_bench;

int main(int argc, char** argv) try {
  Options o;
  bool serving = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw mok::Error("mok_bench: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--fill-sample") {  // no GPU needed
      const auto seed = static_cast<std::uint32_t>(std::stoul(next()));
      const std::uint64_t n = std::stoull(next());
      for (std::uint64_t j = 0; j < n; ++j) std::printf("%u\n", fill_bits(j, seed));
      return 0;
    }
    if (a == "--serve") serving = true;
    else if (a == "--preset") o.presets = split(next());
    else if (a == "--impl") o.impls = split(next());
    else if (a == "--pass") o.passes = split(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--comm-sms") o.ep_config.comm_sms = std::stoi(next());
    else if (a == "--minibatch-rows") o.ep_config.minibatch_rows = std::stoll(next());
    else if (a == "--ring-rows") o.ep_config.ring_rows = std::stoll(next());
    else if (a == "--interleave-rows") o.ep_config.interleave_rows = std::stoll(next());
    else if (a == "--out") o.out = next();
    else if (a == "--commit") o.commit = next();
    else if (a == "--date") o.date = next();
    else if (a == "--no-check") o.check = false;
    else {
      std::printf("usage: mok_bench [--preset all|NAME,...] [--impl mok,mok-ep1,mok-fp8,cublas,plan] [--pass fwd,fwd+bwd]\n"
                  "                 [--iters N] [--warmup N] [--out FILE.json] [--commit C] [--date D] [--no-check]\n"
                  "                 [--comm-sms N] [--minibatch-rows N] [--ring-rows N]  (mok-ep1's Config)\n"
                  "                 [--interleave-rows N]  (both impls' forward task order)\n"
                  "       mok_bench --serve            (bench/layer_bench.py's mok implementation)\n"
                  "       mok_bench --fill-sample SEED N\n");
      return 2;
    }
  }
  if (o.iters < 1) throw mok::Error("mok_bench: --iters must be >= 1");
  if (mok::cuda_device_count() == 0) {
    std::fprintf(stderr, "mok_bench: no CUDA GPU found; the benchmark needs a Hopper GPU\n");
    return 3;
  }
  const mok::DeviceInfo dev = mok::query_device(0);
  if (!dev.is_hopper()) {
    std::fprintf(stderr, "mok_bench: GPU 0 is %s, not Hopper (sm_90)\n", dev.name.c_str());
    return 3;
  }
  if (serving) return serve();
  std::vector<const mok::Preset*> chosen;
  for (const mok::Preset& p : mok::presets())
    if (o.presets == std::vector<std::string>{"all"} ? p.model_ep > 1 || p.tokens >= 8192
                                                     : std::count(o.presets.begin(), o.presets.end(), p.name) > 0)
      chosen.push_back(&p);
  for (const std::string& name : o.presets)
    if (name != "all") mok::find_preset(name);  // unknown names are an error
  for (const std::string& impl : o.impls)
    if (!is_layer_impl(impl) && impl != "mok-ep1" && impl != "cublas" && impl != "plan")
      throw mok::Error("mok_bench: impl '" + impl + "' is not available (known: " + impl_list(kLayerImpls) +
                       ", mok-ep1, cublas, plan)");

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t handle;
  CUBLAS_OK(cublasCreate(&handle));
  std::vector<Record> records;
#ifdef MOK_PHASE_TIMING  // a diagnostic build: the kernels' consumer phases per record
  unsigned long long* phase_table = nullptr;  // [2][kPhases]: forward kernel, backward kernel
  CUDA_OK(cudaMalloc(&phase_table, sizeof(unsigned long long) * 2 * mok::kernels::kPhases));
  mok::kernels::set_forward_phase_table(phase_table);
  mok::kernels::set_forward_fp8_phase_table(phase_table);  // (one forward kernel runs per record)
  mok::kernels::set_backward_phase_table(phase_table + mok::kernels::kPhases);
#endif
  std::printf("%-16s %-7s %-8s %10s %9s\n", "preset", "impl", "pass", "ms", "TFLOP/s");
  for (const mok::Preset* p : chosen)
    for (const std::string& impl : o.impls) {
      std::vector<std::string> passes = impl == "plan" ? std::vector<std::string>{"plan"} : o.passes;
      for (const std::string& pass : passes) {
        const bool fp8 = impl.starts_with("mok-fp8");
        if (is_training_step(impl) && pass != "fwd+bwd") continue;
        if (fp8 && (p->shape.hidden % 128 != 0 || p->shape.intermediate % 128 != 0)) {
          std::printf("%-16s %-7s %-8s    (skipped: Precision::fp8 needs H and I multiples of 128)\n", p->name.c_str(),
                      impl.c_str(), pass.c_str());
          continue;
        }
#ifdef MOK_PHASE_TIMING
        CUDA_OK(cudaMemset(phase_table, 0, sizeof(unsigned long long) * 2 * mok::kernels::kPhases));
#endif
        if (impl.starts_with("mok")) records.push_back(bench_mok(o, *p, impl, pass, stream));
        else if (impl == "cublas") records.push_back(bench_dense(o, *p, pass, stream, handle));
        else records.push_back(bench_plan(o, *p, stream));
        const Record& r = records.back();
        std::printf("%-16s %-7s %-8s %10.4f %9.1f\n", r.preset.c_str(), r.impl.c_str(), r.pass.c_str(), r.ms, r.tflops);
#ifdef MOK_PHASE_TIMING
        {  // shares of each kernel's consumer cycles (every call of the record: checks, warm-up, timing)
          unsigned long long sums[2][mok::kernels::kPhases] = {};
          CUDA_OK(cudaMemcpy(sums, phase_table, sizeof(sums), cudaMemcpyDeviceToHost));
          for (int k = 0; k < 2; ++k) {
            unsigned long long total = 0;
            for (unsigned long long v : sums[k]) total += v;
            if (total == 0) continue;
            std::printf("  %s consumer cycles:", k == 0 ? "forward" : "backward");
            for (int i = 0; i < mok::kernels::kPhases; ++i)
              if (sums[k][i] > 0)
                std::printf(" %s %.1f%%", mok::kernels::phase_name(i), 100.0 * static_cast<double>(sums[k][i]) / total);
            std::printf("\n");
          }
        }
#endif
        std::fflush(stdout);
        // Rewritten after every record: a run cut short (a machine's time limit) keeps what it measured.
        if (!o.out.empty()) write_json(o, records, dev.name);
      }
    }
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
#ifdef MOK_PHASE_TIMING
  mok::kernels::set_forward_phase_table(nullptr);
  mok::kernels::set_forward_fp8_phase_table(nullptr);
  mok::kernels::set_backward_phase_table(nullptr);
  cudaFree(phase_table);
#endif
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
