// Where one call's row buffers lie: in the caller's scratch (one GPU; the backward's dy rows
// and w h in the W_gate / W_up gradient buffers where they fit, and on in dx) or in an EP
// rank's own buffers.
#include "layer_launch.hpp"

#include <algorithm>
#include <optional>

#include "mok/error.hpp"

namespace mok {

namespace {
// The widest H at which a Precision::fp8 workspace's Training::save backward defaults to one column block.
constexpr std::int64_t kOneBlockFp8MaxHidden = 2048;
}  // namespace

// (Training::recompute: mixtral-8x7b's two-block recompute backward 0.967 of its one-block one,
// deepseek-v3's 1.016, qwen3-30b-a3b's 1.070. Precision::fp8 with H <= 2048, one block against two,
// forward+backward with FP8 weight gradients: qwen3-30b-a3b 0.931, olmoe-1b-7b 0.954; with bf16 weight
// gradients 0.945 / 0.956, with the bf16 dgrad 0.947 / 0.958; qwen3.5-397b (H 4096) 0.993 and 0.973 in
// two runs, mixtral-8x7b slower in one block — H100, 2026-12-07)
int default_backward_column_blocks(const MoeShape& shape, Training training, Precision precision) {
  if (training == Training::recompute) return shape.intermediate > shape.hidden ? detail::kBackwardColumnBlocks : 1;
  if (training != Training::save) return 1;
  return precision == Precision::fp8 && shape.hidden <= kOneBlockFp8MaxHidden ? 1 : detail::kBackwardColumnBlocks;
}

}  // namespace mok

namespace mok::detail {

namespace {

std::uint16_t* at(void* base, std::int64_t byte) { return reinterpret_cast<std::uint16_t*>(static_cast<char*>(base) + byte); }
std::int64_t padded_512(std::int64_t bytes) { return (bytes + 511) / 512 * 512; }

// E4M3 rows (the FP8 kernels' A operands: h, dy, dgate|dup, an EP rank's x) with a power-of-two
// scale per row and 128 columns, in one region: [values rows x cols][the scales' E8M0 bytes cols /
// 128 x rows, padded to 512 bytes]; rows a multiple of 128, so each part starts 512-byte aligned.
std::int64_t fp8_rows_bytes(std::int64_t rows, std::int64_t cols) {
  return rows * cols + padded_512(cols / kernels::kFp8BlockK * rows);
}
void place_fp8_rows(std::uint8_t* at, std::int64_t rows, std::int64_t cols, std::uint8_t*& values, std::uint8_t*& exps) {
  values = at;
  exps = at + rows * cols;
}

}  // namespace

ScratchShape scratch_shape(const Workspace& ws, std::int64_t tokens) {
  return {ws.shape(),    tokens, ws.capacity_rows(tokens), ws.saved_elements(tokens), ws.training(), ws.config().precision,
          backward_block_columns(ws.shape(), ws.config(), ws.training())};
}

std::int64_t backward_block_columns(const MoeShape& shape, const Config& config, Training training) {
  const std::int64_t H = shape.hidden, tile = kernels::kBlockN;
  if (training == Training::off || config.comm_sms > 0 || config.ring_rows > 0) return H;
  const std::int64_t blocks = config.backward_column_blocks > 0 ? config.backward_column_blocks
                                                                : default_backward_column_blocks(shape, training, config.precision);
  const std::int64_t tiles = (H + tile - 1) / tile;
  return std::min(H, (tiles + blocks - 1) / blocks * tile);
}

// [bf16 slots (capacity + T_pad) x H, x rows = its first capacity rows (each x row under its
// own slot row)][h capacity x I][shared h T_pad x I_s]
// Precision::fp8: [bf16 slots (capacity + T_pad) x H, E4M3 x rows = its bytes [capacity H,
// 2 capacity H)][x's scale bytes H / 128 x capacity, padded to 512 bytes][E4M3 h capacity x I with
// its scale bytes (fp8_rows_bytes)][shared h T_pad x I_s] (each a multiple of 512 bytes: capacity is
// one of 128).
CallBuffers forward_buffers(const ScratchShape& shape, void* scratch) {
  const MoeShape& s = shape.shape;
  const std::int64_t cap = shape.capacity, Tpad = shared_tiles(s, shape.tokens) * kTileRows;
  const std::int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
  CallBuffers b;
  b.slots = static_cast<std::uint16_t*>(scratch);
  const std::int64_t slot_bytes = 2 * (cap + Tpad) * H;
  if (shape.precision == Precision::fp8) {
    b.x_fp8 = reinterpret_cast<std::uint8_t*>(at(scratch, cap * H));
    std::int64_t used = slot_bytes;
    b.x_exps = reinterpret_cast<std::uint8_t*>(at(scratch, used));
    used += padded_512((H / kernels::kFp8BlockK) * cap);
    place_fp8_rows(reinterpret_cast<std::uint8_t*>(at(scratch, used)), cap, I, b.h_fp8, b.h_exps);
    used += fp8_rows_bytes(cap, I);
    b.shared_hidden = at(scratch, used);
    b.bytes = used + 2 * Tpad * Is;
    return b;
  }
  b.x_rows = at(scratch, 0);
  b.hidden = at(scratch, slot_bytes);
  b.shared_hidden = at(scratch, slot_bytes + 2 * cap * I);
  b.bytes = slot_bytes + 2 * (cap * I + Tpad * Is);
  return b;
}

namespace {

// A tensor map's strides are below 2^40 bytes.
constexpr std::int64_t kMaxRegionStride = std::int64_t{1} << 40;

// Where the routed dy rows go outside the scratch: into `room` elements at `at` (of the
// gradient buffers), or there and, from a 128-row tile on, into dx (T rows). The lower address
// holds the first rows (one tensor map of two regions: BackwardParams::dy_split). None: they do
// not fit.
struct DyPlace {
  std::uint16_t *lo = nullptr, *hi = nullptr;
  std::int64_t split = kernels::kNoSplit;
};
std::optional<DyPlace> place_dy(std::uint16_t* at, std::int64_t room, std::uint16_t* dx, std::int64_t tokens,
                                std::int64_t cap, std::int64_t H) {
  if (cap * H <= room) return DyPlace{at, nullptr, kernels::kNoSplit};
  if (dx == nullptr) return std::nullopt;
  // (rows past dx's split rounded up to a tile whichever comes first: the same figure either way)
  const std::int64_t in_grads = room / H / kTileRows * kTileRows;
  const std::int64_t in_dx = (cap - in_grads + kTileRows - 1) / kTileRows * kTileRows;
  if (in_dx > tokens) return std::nullopt;
  if (in_grads == 0) return DyPlace{dx, nullptr, kernels::kNoSplit};
  const DyPlace d = at < dx ? DyPlace{at, dx, in_grads} : DyPlace{dx, at, in_dx};
  if (d.hi == d.lo + d.split * H) return DyPlace{d.lo, nullptr, kernels::kNoSplit};  // (the two abut)
  if ((d.hi - d.lo) * 2 >= kMaxRegionStride) return std::nullopt;
  return d;
}

}  // namespace

// [dy rows capacity x H, unless in the gradients][x rows, then dx rows, capacity x W (one column
// block's columns: shape.block_columns; Training::recompute: room for capacity x H, the
// recompute's whole rows)][shared dx rows T_pad x H, unless in dx][w h capacity x I, unless in
// the gradients][shared w h T_pad x I_s][recomputed pre-activations]. In the gradients: row space a (E_l I H elements) takes the
// dy rows and b the w h where each fits; when b directly follows a (one block of 2 E_l I H: a concatenated
// [E, 2I, H] gradient, or two halves the caller allocated together) the dy rows take its start
// and the w h follow them. Where the dy rows miss the gradients and dx_space is given, they
// continue in dx (split at a 128-row tile). Of the arrangements, the one leaving the least in the
// scratch, and of equal ones the first: dy then w h in the block; the larger that fits there; w h
// first in the block, the dy rows after it and on in dx; the dy rows in the block and on in dx.
// The FP8 dgrad (fp8_dgrad, Precision::fp8): then [E4M3 dy rows capacity x H][their scale bytes H / 128 x
// capacity], unless in the room the bf16 rows leave in the gradients, [E4M3 dgate|dup capacity x 2I][their
// scale bytes 2I / 128 x capacity] (fp8_rows_bytes each). With the FP8 weight gradients (fp8_wgrad) their operands too,
// in rooms dead by the time they are made where they fit (below; saved_space: the saved tensor's
// data, Training::save).
// The recompute's GEMM1 runs the forward kernel on this layout before the dy rows are gathered:
// its x rows are the backward's, its h the w h buffer (wherever that lies: the gradients are
// written last), its slots unused; so Training::recompute keeps rows in the gradients and dx as
// Training::save does.
CallBuffers backward_buffers(const ScratchShape& shape, void* scratch, void* row_space_a, void* row_space_b,
                             void* dx_space, bool fp8_dgrad, bool fp8_wgrad, void* saved_space) {
  const MoeShape& s = shape.shape;
  const std::int64_t cap = shape.capacity, Tpad = shared_tiles(s, shape.tokens) * kTileRows;
  const std::int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate, El = s.num_local_experts;
  const bool in_grads = shape.training != Training::off && row_space_a != nullptr && row_space_b != nullptr;
  auto* a = static_cast<std::uint16_t*>(row_space_a);
  auto* dx = static_cast<std::uint16_t*>(dx_space);
  const std::int64_t half = El * I * H, dy = cap * H, hw = cap * I;
  DyPlace dy_at;                   // lo null: in the scratch
  std::uint16_t* hw_at = nullptr;  // null: in the scratch
  if (in_grads && static_cast<std::uint16_t*>(row_space_b) == a + half) {  // one block of 2 half
    const std::int64_t room = 2 * half;
    std::int64_t left = dy + hw;  // elements in the scratch of the arrangement chosen
    auto consider = [&](std::optional<DyPlace> d, std::uint16_t* h) {
      const std::int64_t l = (d ? 0 : dy) + (h ? 0 : hw);
      if (l < left) left = l, dy_at = d.value_or(DyPlace{}), hw_at = h;
    };
    if (dy + hw <= room) consider(DyPlace{a, nullptr, kernels::kNoSplit}, a + dy);
    if (dy <= room) consider(DyPlace{a, nullptr, kernels::kNoSplit}, nullptr);
    if (hw <= room) {
      consider(std::nullopt, a);
      consider(place_dy(a + hw, room - hw, dx, shape.tokens, cap, H), a);
    }
    consider(place_dy(a, room, dx, shape.tokens, cap, H), nullptr);
  } else if (in_grads) {
    dy_at = place_dy(a, half, dx, shape.tokens, cap, H).value_or(DyPlace{});
    if (hw <= half) hw_at = static_cast<std::uint16_t*>(row_space_b);
  }
  // The FP8 dgrad's E4M3 dy rows and their scale bytes in the room the bf16 rows leave in the gradient
  // buffers where they fit (512-byte aligned), else in the scratch: only the dh tasks read them,
  // and with rows in the gradients every routed dW_gate|up tile waits for every dW_down tile,
  // each of which waited for its expert's dh tiles (rows_in_grads, as for the bf16 dy rows).
  std::uint8_t* dy_fp8_at = nullptr;
  if (fp8_dgrad && shape.precision == Precision::fp8 && in_grads) {
    const std::int64_t need = fp8_rows_bytes(cap, H);  // (bytes)
    const std::int64_t dy_lo_rows = dy_at.split == kernels::kNoSplit ? cap : dy_at.split;
    const auto room = [&](std::uint16_t* lo, std::int64_t n) {  // the first free aligned element of [lo, lo + n)
      std::int64_t end = 0;
      const auto take = [&](const std::uint16_t* p, std::int64_t len) {
        if (p != nullptr && p >= lo && p < lo + n) end = std::max(end, static_cast<std::int64_t>(p - lo) + len);
      };
      take(dy_at.lo, dy_lo_rows * H);
      take(dy_at.hi, (cap - dy_lo_rows) * H);
      take(hw_at, hw);
      end = (end + 255) / 256 * 256;
      return 2 * (n - end) >= need ? reinterpret_cast<std::uint8_t*>(lo + end) : nullptr;
    };
    auto* b_space = static_cast<std::uint16_t*>(row_space_b);
    if (b_space == a + half) dy_fp8_at = room(a, 2 * half);
    else if (!(dy_fp8_at = room(a, half))) dy_fp8_at = room(b_space, half);
  }
  CallBuffers b;
  std::int64_t used = 0;
  b.slots = static_cast<std::uint16_t*>(scratch);
  b.dy_rows = dy_at.lo ? dy_at.lo : at(scratch, used);
  b.dy_rows_hi = dy_at.hi, b.dy_split = dy_at.split;
  if (!dy_at.lo) used += 2 * cap * H;
  // (in column blocks: one block's columns at a time; a recompute's room holds whole rows, its GEMM1's)
  const std::int64_t W = shape.block_columns > 0 ? shape.block_columns : H;
  b.row_columns = W;
  b.x_rows = b.dx_rows = at(scratch, used);
  used += 2 * cap * (shape.training == Training::recompute ? H : W);
  // The shared expert's dx rows in dx itself (token order; the combine adds the routed rows to
  // each in place) unless dy rows are there.
  const bool shared_in_dx = dx != nullptr && Tpad > 0 && dy_at.lo != dx && dy_at.hi != dx;
  b.shared_dx_rows = shared_in_dx ? dx : at(scratch, used);
  if (!shared_in_dx) used += 2 * Tpad * H;
  b.hidden = hw_at ? hw_at : at(scratch, used);
  if (!hw_at) used += 2 * cap * I;
  b.shared_hidden = at(scratch, used);
  used += 2 * Tpad * Is;
  if (shape.training == Training::recompute) {
    b.recompute = at(scratch, used);
    used += 2 * shape.saved_elements;
  }
  if (fp8_dgrad && shape.precision == Precision::fp8) {  // (each a multiple of 512 bytes)
    if (dy_fp8_at) {
      place_fp8_rows(dy_fp8_at, cap, H, b.dy_fp8, b.dy_exps);
    } else {
      place_fp8_rows(reinterpret_cast<std::uint8_t*>(at(scratch, used)), cap, H, b.dy_fp8, b.dy_exps);
      used += fp8_rows_bytes(cap, H);
    }
    place_fp8_rows(reinterpret_cast<std::uint8_t*>(at(scratch, used)), cap, 2 * I, b.dgu_fp8, b.dgu_exps);
    used += fp8_rows_bytes(cap, 2 * I);
    if (fp8_wgrad) {
      // dgate|dup^T and its scale bytes take the E4M3 dgate|dup rows' and theirs (the same sizes; made
      // after the dgrad launches, when the dx tiles have read those). dy^T, x^T and w h^T (with
      // its exponents), made after dgate|dup^T, first-fit into the rooms dead by then, in this
      // order, else the scratch: the bf16 dy rows' 2 capacity H bytes where they are in the
      // scratch (this path never fills them); the x rows' (the dx rows': 2 capacity W); the
      // routed pre-activations' 4 capacity I (saved_space, or the recompute's rows), read only by
      // the dgrad launches and by the dgate|dup^T pass; the E4M3 dy rows' and their scale bytes' where
      // those are in the scratch. (Not the gradients' rooms: the weight-gradient launch writes
      // them while it reads the operands.) The figure does not depend on where saved_space lies.
      const std::int64_t row_blocks = cap / kernels::kFp8BlockK, exponent_row = kernels::wgrad_exponent_stride(cap);
      const auto padded = [](std::int64_t bytes) { return (bytes + 511) / 512 * 512; };  // (the exponents' rows)
      const auto take = [&](std::int64_t bytes) {
        void* p = at(scratch, used);
        used += padded(bytes);
        return static_cast<std::uint8_t*>(p);
      };
      b.dgu_t = b.dgu_fp8;
      b.dgu_t_exps = b.dgu_exps;  // ((2I / 128) cap bytes either way)
      struct Room {
        std::uint8_t* base;
        std::int64_t bytes, used;
      };
      // (the saved tensor is 16-byte aligned, check_saved; the offsets in a room are multiples of 512)
      if (shape.training == Training::save && scratch != nullptr && saved_space == nullptr)
        throw Error("mok internal: backward_buffers needs the saved tensor's address for the FP8 weight gradients");
      auto* preact = static_cast<std::uint8_t*>(shape.training == Training::save ? saved_space : b.recompute);
      Room rooms[] = {{reinterpret_cast<std::uint8_t*>(b.dy_rows), dy_at.lo ? 0 : 2 * cap * H, 0},
                      {reinterpret_cast<std::uint8_t*>(b.x_rows), 2 * cap * W, 0},
                      {preact, 4 * cap * I, 0},
                      {b.dy_fp8, dy_fp8_at ? 0 : fp8_rows_bytes(cap, H), 0}};
      const auto place = [&](std::int64_t bytes) {
        for (Room& r : rooms)
          if (r.bytes - r.used >= bytes) {
            std::uint8_t* p = r.base + r.used;
            r.used += padded(bytes);
            return p;
          }
        return take(bytes);
      };
      b.dy_t = place(cap * H);
      b.x_t = place(cap * H);
      const std::int64_t hw_exponents_at = padded(cap * I);
      b.hw_t = place(hw_exponents_at + 4 * (I / kernels::kFp8BlockK) * exponent_row);
      b.hw_t_exponents = reinterpret_cast<std::int32_t*>(b.hw_t + hw_exponents_at);
      b.dy_t_exps = take(row_blocks * H);  // (not the dy rows' own: the E4M3 dy rows' room may hold operands)
      b.tile_order = reinterpret_cast<std::int32_t*>(take(4 * row_blocks));
      b.x_t_exponents = reinterpret_cast<std::int32_t*>(take(4 * (H / kernels::kFp8BlockK) * exponent_row));
    }
  }
  b.rows_in_grads = dy_at.lo || hw_at || dy_fp8_at;
  b.bytes = used;
  return b;
}

namespace {

// An EP rank's FP8 rows (Workspace::rank_fp8_dgrad_rows), `rows` its allocated ones (a multiple of
// 128: every part below a multiple of 512 bytes): the E4M3 dy rows (rows x H) and dgate|dup rows
// (rows x 2I), each with its scale bytes (fp8_rows_bytes) for the FP8 dgrad,
// then for the FP8 weight gradients [x^T's exponents H / 128 x stride i32][w h^T rows x I and its
// exponents I / 128 x stride i32, unless they fit in the E4M3 dy rows' room, dead by then].
struct RankFp8Parts {
  std::int64_t dgrad, x_exponents, hw_exponents_at, hw_t;
  bool hw_t_in_dy_rows;
};

RankFp8Parts rank_fp8_parts(std::int64_t rows, std::int64_t H, std::int64_t I) {
  RankFp8Parts p{};
  const std::int64_t stride = kernels::wgrad_exponent_stride(rows);  // (>= the plan's: capacity <= rows)
  p.dgrad = fp8_rows_bytes(rows, H) + fp8_rows_bytes(rows, 2 * I);
  p.x_exponents = padded_512(4 * (H / kernels::kFp8BlockK) * stride);
  p.hw_exponents_at = padded_512(rows * I);
  p.hw_t = padded_512(p.hw_exponents_at + 4 * (I / kernels::kFp8BlockK) * stride);
  p.hw_t_in_dy_rows = p.hw_t <= rows * H;
  return p;
}

}  // namespace

std::int64_t rank_fp8_dgrad_bytes(std::int64_t rows, std::int64_t H, std::int64_t I) {
  const RankFp8Parts p = rank_fp8_parts(rows, H, I);
  return p.dgrad + p.x_exponents + (p.hw_t_in_dy_rows ? 0 : p.hw_t);
}

void rank_fp8_dgrad_buffers(CallBuffers& b, std::int64_t rows, std::int64_t H, std::int64_t I, void* base) {
  auto* at = static_cast<std::uint8_t*>(base);
  place_fp8_rows(at, rows, H, b.dy_fp8, b.dy_exps);
  place_fp8_rows(at + fp8_rows_bytes(rows, H), rows, 2 * I, b.dgu_fp8, b.dgu_exps);
}

void rank_fp8_wgrad_buffers(CallBuffers& b, std::int64_t rows, std::int64_t H, std::int64_t I, void* base,
                            void* dx_rows) {
  const RankFp8Parts p = rank_fp8_parts(rows, H, I);
  rank_fp8_dgrad_buffers(b, rows, H, I, base);
  b.dgu_t = b.dgu_fp8, b.dgu_t_exps = b.dgu_exps;  // (the same sizes)
  b.dy_t_exps = b.dy_exps;                         // ([rows / 128, H] in [H / 128, rows]'s bytes)
  auto* dx = static_cast<std::uint8_t*>(dx_rows);  // (2 rows H bytes)
  b.dy_t = dx, b.x_t = dx + rows * H;
  std::uint8_t* extra = static_cast<std::uint8_t*>(base) + p.dgrad;
  b.x_t_exponents = reinterpret_cast<std::int32_t*>(extra);
  b.hw_t = p.hw_t_in_dy_rows ? b.dy_fp8 : extra + p.x_exponents;
  b.hw_t_exponents = reinterpret_cast<std::int32_t*>(b.hw_t + p.hw_exponents_at);
}

void rank_fp8_forward_buffers(CallBuffers& b, std::int64_t rows, std::int64_t H, std::int64_t I) {
  place_fp8_rows(reinterpret_cast<std::uint8_t*>(b.x_rows), rows, H, b.x_fp8, b.x_exps);
  place_fp8_rows(reinterpret_cast<std::uint8_t*>(b.hidden), rows, I, b.h_fp8, b.h_exps);
}

std::int64_t rank_fp8_dgrad_bytes(const Workspace& ws) {
  return rank_fp8_dgrad_bytes(ws.plan().allocated_rows(), ws.shape().hidden, ws.shape().intermediate);
}
void rank_fp8_dgrad_buffers(CallBuffers& b, const Workspace& ws, void* base) {
  rank_fp8_dgrad_buffers(b, ws.plan().allocated_rows(), ws.shape().hidden, ws.shape().intermediate, base);
}
void rank_fp8_wgrad_buffers(CallBuffers& b, const Workspace& ws, void* base) {
  rank_fp8_wgrad_buffers(b, ws.plan().allocated_rows(), ws.shape().hidden, ws.shape().intermediate, base, ws.dx_rows());
}

RankSlotRows rank_slot_rows(const MoeShape& shape, Training training, Precision precision, std::int64_t capacity,
                            std::int64_t padded_tokens) {
  if (training == Training::off) return {capacity + padded_tokens, -1, 0};
  const bool keeps_dx = shape.ep_size() == 1 || precision == Precision::fp8;
  const std::int64_t shared = (keeps_dx ? 2 : 1) * capacity;
  return {shared + padded_tokens, keeps_dx ? capacity : -1, shared};
}

CallBuffers rank_buffers(const Workspace& ws) {
  CallBuffers b;
  b.slots = ws.slots();
  b.x_rows = static_cast<std::uint16_t*>(ws.x_routed());
  b.hidden = static_cast<std::uint16_t*>(ws.hidden());
  const std::int64_t rows = ws.plan().allocated_rows();
  b.shared_hidden = b.hidden ? b.hidden + rows * ws.shape().intermediate : nullptr;
  if (ws.config().precision == Precision::fp8 && b.x_rows && b.hidden)
    rank_fp8_forward_buffers(b, rows, ws.shape().hidden, ws.shape().intermediate);
  b.dy_rows = static_cast<std::uint16_t*>(ws.dy_routed());
  b.dx_rows = static_cast<std::uint16_t*>(ws.dx_rows());
  b.shared_dx_rows = static_cast<std::uint16_t*>(ws.shared_dx_rows());
  b.recompute = static_cast<std::uint16_t*>(ws.recompute_buffer());
  return b;
}

}  // namespace mok::detail
