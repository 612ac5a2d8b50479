// Public value types: the layer's shape, the run-time configuration, and the
// non-owning tensor views the API takes (pointer + dtype + device + shape + strides).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace mok {

// H, I and I_s must be multiples of this: one 128-byte bf16 K-slice of a wgmma
// tile (64 elements), which is also the TMA swizzle width.
inline constexpr std::int64_t kHiddenGranularity = 64;
// Row pointers of every tensor must be 16-byte aligned (bulk copies, vector loads).
inline constexpr std::size_t kPointerAlignment = 16;

enum class DType : std::uint8_t { bf16, f16, f32, f64, i32, i64, u8, e4m3 };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int index) { return {DeviceKind::cuda, index}; }
  friend bool operator==(const Device&, const Device&) = default;
};

std::string device_name(Device device);

// A strided view of someone else's memory; strides are in elements.
struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::bf16;
  Device device{};
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> stride{};

  // A row-major contiguous view.
  static TensorView contiguous(const void* data, DType dtype, Device device,
                               std::initializer_list<std::int64_t> dims);

  std::int64_t numel() const;
  bool is_contiguous() const;
  std::string shape_string() const;
  // Whether the byte spans of the two views intersect (empty views and views without data share
  // none). Conservative:
  // two interleaved views that share no element (the halves of [E, 2I, H]) count as overlapping.
  bool overlaps(const TensorView& other) const;
  // Whether a 3-D view has contiguous rows that overlap neither each other nor another expert's:
  // stride[2] == 1, stride[1] >= shape[2], stride[0] >= shape[1] * stride[1] (compared by
  // division: the product can wrap). Empty views have.
  bool rows_apart() const;
};

// The layer. Experts are numbered globally 0..num_experts-1; rank r of an EP group of
// size num_experts/num_local_experts owns experts [r*num_local_experts, (r+1)*num_local_experts).
struct MoeShape {
  std::int64_t hidden = 0;               // H
  std::int64_t intermediate = 0;         // I of each routed expert
  std::int64_t num_experts = 0;          // E, all ranks together
  std::int64_t num_local_experts = 0;    // E_l = E / EP
  std::int64_t top_k = 0;                // k
  std::int64_t shared_intermediate = 0;  // I_s of the one shared expert; 0 = no shared expert
  std::optional<float> swiglu_limit;     // gate <= limit, |up| <= limit; none = plain SwiGLU

  std::int64_t ep_size() const { return num_local_experts > 0 ? num_experts / num_local_experts : 0; }
  bool has_shared() const { return shared_intermediate > 0; }
};

// Throws mok::Error naming the first invalid field and its value.
void validate(const MoeShape& shape);

// The arithmetic of the routed experts' GEMMs. fp8: E4M3 operands with DeepSeek-V3's blockwise
// power-of-two scales (x and h per 1 x 128 of a row, weights per 128 x 128; mok/fp8.hpp), fp32
// accumulation promoted every 128 of K; the shared expert, outputs and gradients stay bf16 /
// fp32. fp8 needs H and I multiples of 128; it runs on one GPU and in EP groups (VirtualRanks,
// EpRank; not with the ring); the routed weights come quantized (ForwardArgs::fp8,
// mok::fp8::quantize_weights). Training (Training::save): the backward is the BF16 one, on the
// FP8 forward's saved pre-activations and the bf16 weights (reference::backward_fp8 with
// fp8_dgrad = false), or with BackwardArgs::fp8 its dgrad GEMMs in E4M3 too (fp8_dgrad = true;
// one GPU and EpRank), and with BackwardArgs::fp8_weight_gradients the weight-gradient GEMMs as
// well (docs/fp8.md).
enum class Precision { bf16, fp8 };
const char* precision_name(Precision precision);

// Run-time knobs of the fused kernels. Zero means "choose for me".
struct Config {
  Precision precision = Precision::bf16;
  int comm_sms = 0;                 // EP: comm SMs filling the ring; 0 = no ring unless ring_rows > 0
                                    // (rows pulled by every SM before the fused kernel)
  int compute_sms = 0;              // SMs given to GEMM tiles; 0 = all the rest
  std::int64_t minibatch_rows = 4096;  // grain of compute/communication overlap
  std::int64_t ring_rows = 0;          // EP: rows of the received-token ring; 0 = all routed rows
                                       // (if comm_sms > 0); > 0 turns the ring on (comm_sms: 1 in 32).
                                       // The backward's rings must hold every minibatch one expert's
                                       // rows touch: a call whose routing gives a local expert more than
                                       // ring_rows - minibatch_rows + 128 rows may fail (a clear error)
  std::int64_t interleave_rows = 0;    // forward task order: 0 = every routed GEMM1 tile before any
                                       // GEMM2 tile; > 0 (a multiple of 128, no ring): chunks of this
                                       // many plan rows, chunk c's GEMM2 tiles after chunk c + 1's GEMM1
                                       // tiles (spreads GEMM2's epilogues, EP's result pushes, over the
                                       // kernel). The same bits either way.
  bool pull_tokens_once = false;       // EpRank without the ring: pull each peer token once into a
                                       // local buffer ([EP, T, H] bf16 more memory), then gather the
                                       // routed rows locally (else: pulled once per (token, expert) pair)
  double capacity_factor = 0.0;        // plan capacity in units of T*k rows; 0 = worst case (EP*T*k)
  double timeout_seconds = 10.0;       // bound of every device-side wait (at most 3600)
  bool pingpong = false;               // one GPU: the forward's consumer warpgroups take alternate
                                       // 128 x 128 tasks (one's epilogue under the other's MMAs)
                                       // instead of sharing 128 x 256 ones; the same bits. Not with
                                       // the ring; EP ranks keep the cooperative kernel
  int backward_column_blocks = 0;      // one GPU: the backward's gathered x rows (and the dx rows over
                                       // them) one block of H's columns at a time, a launch of the
                                       // backward kernel each for the dW_gate|up, dx and combine work of
                                       // its columns (the first also doing the dh, dW_down and
                                       // shared-expert work). Training::save: that buffer, the backward
                                       // scratch's largest, at 1 / blocks of its bytes; 0 = 2 (1 for
                                       // Precision::fp8 where H <= 2048: measured faster there); 1 = whole
                                       // rows in one launch. Training::recompute: 0 = 2 where I > H, else
                                       // 1; blocks keep the buffer's size there (the recompute's GEMM1
                                       // reads whole rows; the first block's columns are gathered again
                                       // after it) and save DRAM traffic when I > H. Blocks are whole
                                       // 256-column tiles. The same bits either way
  bool pull_fp8_rows = false;          // EP ranks of Precision::fp8, rows pulled before the kernel (no
                                       // ring, not pull_tokens_once): each rank quantizes its own tokens
                                       // once (the exchange; virtual ranks: a kernel) and its peers pull
                                       // E4M3 rows and scale bytes, H x 129 / 128 bytes a row where bf16 rows
                                       // take 2H; false: bf16 rows pulled, quantized by the puller. The
                                       // same bits either way (a row's bytes are its token's alone); not
                                       // yet measured, hence off
  bool fp8_dgrad = false;              // EP ranks of Precision::fp8 with Training::save: hold the FP8
                                       // dgrad's rows from construction (E4M3 dy and dgate|dup rows and
                                       // their scale bytes, capacity x (H + 2I) x 129 / 128 bytes, the FP8
                                       // weight gradients' exponents, and where w h^T misses the E4M3
                                       // dy rows' room — I above about H — capacity x I bytes more for
                                       // it), so that their backward may take BackwardArgs::fp8 (EpRank;
                                       // an allocation between the ranks' launches could wait for a
                                       // kernel that waits for a peer; VirtualRanks refuse it). One
                                       // GPU's calls take them from their scratch
  bool replay_launches = true;         // one GPU: a call whose pointers, shapes and T repeat (a training
                                       // loop's) is enqueued as one launch of a CUDA graph of its
                                       // launches, captured the second time it is seen (the same
                                       // kernels and bits; src/host/launch_cache.hpp). false: every
                                       // call launches its kernels one by one
};

void validate(const Config& config);

// Rows of the plan table for T local tokens: every routed row, plus per-expert padding
// to block_m. With capacity_factor 0 this is the worst case and can never overflow.
std::int64_t plan_capacity_rows(const MoeShape& shape, const Config& config, std::int64_t tokens,
                                std::int64_t block_m);

// docs/design.md's FLOP convention (§2): forward = 6*H*(routed_pairs*I + tokens*I_s); backward = 2x.
double forward_flops(const MoeShape& shape, std::int64_t routed_pairs, std::int64_t tokens);

}  // namespace mok
