// Host cost of the CUDA calls a layer call makes, and of mok::forward's pieces, with the GPU
// busy (a spin kernel queued ahead, as when a training step runs ahead of the GPU): what the
// 40-120 µs of one forward's enqueue is made of (issue 21). Medians of N calls, µs.
//
//   launch_cost [--preset qwen3-30b-a3b,deepseek-v3] [--calls 400]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "mok_bench/layer.cuh"

namespace {

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
__global__ void empty_small(int) {}
struct Big {
  unsigned char bytes[2048];  // about a forward kernel's params (tensor maps)
};
__global__ void empty_big(Big) {}

// Median host µs of f(), called in batches of 16 behind ~1 ms of spin (the queue never runs dry
// and never fills).
template <typename F>
double median_us(cudaStream_t stream, int calls, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < calls; i += 16) {
    spin<<<1, 1, 0, stream>>>(2'000'000);
    for (int j = 0; j < 16; ++j) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> presets{"qwen3-30b-a3b", "deepseek-v3"};
  int calls = 400;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--preset") presets = mok_bench::split(argv[i + 1]);
    else if (a == "--calls") calls = std::stoi(argv[i + 1]);
    else throw mok::Error("usage: launch_cost [--preset NAME,...] [--calls N]");
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Big big{};
  void* buffer = nullptr;
  CUDA_OK(cudaMalloc(&buffer, 1 << 20));
  cudaEvent_t event;
  CUDA_OK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  // A graph of six empty launches (the forward's count).
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 5; ++i) empty_small<<<1, 32, 0, stream>>>(i);
  empty_big<<<132, 384, 0, stream>>>(big);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));

  auto row = [](const char* what, double us) { std::printf("  %-58s %8.2f us\n", what, us); };
  std::printf("== host cost with the GPU busy (medians of %d calls)\n", calls);
  int device = 0, sms = 0;
  cudaStreamCaptureStatus capturing;
  cudaPointerAttributes attributes;
  row("cudaGetDevice", median_us(stream, calls, [&] { cudaGetDevice(&device); }));
  row("cudaDeviceGetAttribute (SM count)",
      median_us(stream, calls, [&] { cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); }));
  row("cudaPointerGetAttributes", median_us(stream, calls, [&] { cudaPointerGetAttributes(&attributes, buffer); }));
  row("cudaStreamIsCapturing", median_us(stream, calls, [&] { cudaStreamIsCapturing(stream, &capturing); }));
  row("cudaGetLastError", median_us(stream, calls, [&] { (void)cudaGetLastError(); }));
  row("cudaEventRecord", median_us(stream, calls, [&] { cudaEventRecord(event, stream); }));
  row("cudaMemsetAsync (4 KB)", median_us(stream, calls, [&] { cudaMemsetAsync(buffer, 0, 4096, stream); }));
  row("launch: empty kernel, 4-byte params", median_us(stream, calls, [&] { empty_small<<<1, 32, 0, stream>>>(0); }));
  row("launch: empty kernel, 2 KB params", median_us(stream, calls, [&] { empty_big<<<132, 384, 0, stream>>>(big); }));
  row("six launches (5 small, 1 with 2 KB params)", median_us(stream, calls, [&] {
        for (int i = 0; i < 5; ++i) empty_small<<<1, 32, 0, stream>>>(i);
        empty_big<<<132, 384, 0, stream>>>(big);
      }));
  row("cudaGraphLaunch of the same six", median_us(stream, calls, [&] { cudaGraphLaunch(exec, stream); }));
  CUDA_OK(cudaGetLastError());

  for (const std::string& name : presets) {
    const mok::Preset& p = mok::find_preset(name);
    const mok::MoeShape& s = p.shape;
    auto ids = mok::make_routing(mok::RoutingKind::uniform, p.tokens, s.num_experts, s.top_k, 7);
    auto weights = mok::make_routing_weights(ids, s.top_k, 7);
    const mok_bench::Problem pr(p, 11, std::move(ids), std::move(weights), stream);
    mok::Config direct;
    direct.replay_launches = false;
    mok_bench::FusedLayer replaying(pr, "mok", "fwd", mok::Config{}, stream), launching(pr, "mok", "fwd", direct, stream);
    mok_bench::FusedLayer training(pr, "mok", "fwd+bwd", mok::Config{}, stream), training_direct(pr, "mok", "fwd+bwd", direct, stream);
    mok::DevicePlan plan(s, p.tokens);
    const auto ids_view = mok::TensorView::contiguous(pr.ids, mok::DType::i32, mok::Device::cuda(0), {p.tokens, s.top_k});
    std::printf("== %s (T = %lld)\n", name.c_str(), static_cast<long long>(p.tokens));
    row("mok::plan_device (checks + 4 launches)", median_us(stream, calls, [&] { mok::plan_device(ids_view, 0, plan, stream); }));
    row("mok::forward, launched (checks, maps, 6 launches)", median_us(stream, calls, [&] { launching.step(); }));
    row("mok::forward, replayed (checks, one graph launch)", median_us(stream, calls, [&] { replaying.step(); }));
    row("forward + backward, launched (mok_bench's fwd+bwd step)", median_us(stream, calls / 4, [&] { training_direct.step(); }));
    row("forward + backward, replayed", median_us(stream, calls / 4, [&] { training.step(); }));
    for (auto* l : {&replaying, &launching, &training, &training_direct}) l->check_status();
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaEventDestroy(event));
  CUDA_OK(cudaFree(buffer));
  CUDA_OK(cudaStreamDestroy(stream));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
