// The Python extension mok._C: only registers. Tensors arrive through DLPack (any
// framework), the CUDA stream as an integer: nothing here links against PyTorch. The
// conversions live in convert.hpp.
#include "convert.hpp"

namespace nb = nanobind;
using namespace mok_python;

NB_MODULE(_C, m) {
  m.doc() = "MoK for Hopper: C++/CUDA core (see the mok package for the PyTorch API)";
  m.attr("__version__") = mok::kVersion;
  m.attr("MAX_EP_RANKS") = mok::kMaxEpRanks;  // ranks of one expert-parallel group

  // The library's error types as Python's, with the library's message: a wrong dtype is a
  // TypeError, any other wrong argument a ValueError, a failure of the device or the
  // library (CUDA error, timeout) a RuntimeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mok::DTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const mok::ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const mok::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("cuda_device_count", &mok::cuda_device_count);
  m.def("validate_shape", &make_shape, nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"),
        nb::arg("num_local_experts"), nb::arg("top_k"), nb::arg("shared_intermediate") = 0,
        nb::arg("swiglu_limit") = nb::none());

  // The host's FP8 quantization (mok/fp8.hpp), the oracle of mok.fp8's: [rows, cols] f32 ->
  // (E4M3 bytes [rows, cols], exponents [ceil(rows / block_rows), ceil(cols / block_cols)]).
  m.def(
      "fp8_quantize",
      [](nb::ndarray<float, nb::c_contig, nb::device::cpu> x, int block_rows, int block_cols) {
        if (x.ndim() != 2) throw nb::value_error("mok._C.fp8_quantize: x must be 2-D");
        const auto q = mok::fp8::quantize(x.data(), static_cast<int>(x.shape(0)), static_cast<int>(x.shape(1)),
                                          block_rows, block_cols);
        return std::make_pair(q.values, q.exponents);
      },
      nb::arg("x"), nb::arg("block_rows"), nb::arg("block_cols"));

  // The GPU's blockwise weight quantization (mok::fp8::quantize_weights) into given
  // tensors: w bf16 [E, rows, cols], values u8 [E, rows, cols], exponents i32 [E, ceil(rows /
  // 128), ceil(cols / 128)], on `stream` (transpose: w^T's, [E, cols, rows] and [E, ceil(cols /
  // 128), ceil(rows / 128)]); values_t and exponents_t (transpose false): w^T's as well, from the
  // same read.
  m.def(
      "fp8_quantize_weights",
      [](nb::ndarray<> w, nb::ndarray<> values, nb::ndarray<> exponents, std::uintptr_t stream, bool transpose,
         std::optional<nb::ndarray<>> values_t, std::optional<nb::ndarray<>> exponents_t) {
        const mok::TensorView wv = view_of(w), vv = view_of(values), ev = view_of(exponents);
        select_device(wv, "mok.fp8.quantize_weights");
        if (values_t.has_value() != exponents_t.has_value())
          throw nb::value_error("mok.fp8.quantize_weights: values_t and exponents_t go together");
        if (values_t && transpose) throw nb::value_error("mok.fp8.quantize_weights: values_t with transpose=True");
        if (values_t) {
          const mok::TensorView tv = view_of(*values_t), te = view_of(*exponents_t);
          nb::gil_scoped_release release;
          mok::fp8::quantize_weights(wv, vv, ev, tv, te, reinterpret_cast<cudaStream_t>(stream));
          return;
        }
        nb::gil_scoped_release release;
        mok::fp8::quantize_weights(wv, vv, ev, reinterpret_cast<cudaStream_t>(stream), transpose);
      },
      nb::arg("w"), nb::arg("values"), nb::arg("exponents"), nb::arg("stream"), nb::arg("transpose") = false,
      nb::arg("values_t") = nb::none(), nb::arg("exponents_t") = nb::none());

  // fp64 CPU references of the whole layer (the test oracles), weights of all E experts: the
  // exact layer, and the layer on the FP8 recipe's quantized operands (reference::forward_fp8).
  for (auto [name, reference] : {std::pair{"reference_forward", &mok::reference::forward},
                                 std::pair{"reference_forward_fp8", &mok::reference::forward_fp8}}) {
    const std::string where = std::string("mok.") + name;
    m.def(
        name,
        [where, reference](F64 x, I32 ids, F64 weights, F64 gate, F64 up, F64 down, std::optional<F64> shared_gate,
                           std::optional<F64> shared_up, std::optional<F64> shared_down, std::optional<float> limit) {
          if (x.ndim() != 2 || ids.ndim() != 2) throw nb::value_error((where + ": x and topk_ids must be 2-D").c_str());
          if (gate.ndim() != 3) throw nb::value_error((where + ": w_gate must be [E, I, H]").c_str());
          const std::int64_t T = x.shape(0), H = x.shape(1), E = gate.shape(0), I = gate.shape(1), k = ids.shape(1);
          const std::int64_t Is = shared_gate ? shared_gate->shape(0) : 0;
          const mok::MoeShape s = make_shape(H, I, E, E, k, Is, limit);
          mok::reference::Routing r{std::vector<std::int32_t>(ids.data(), ids.data() + ids.size()), vec_of(weights)};
          mok::reference::Weights w{vec_of(gate), vec_of(up), vec_of(down), vec_of(shared_gate), vec_of(shared_up),
                                    vec_of(shared_down)};
          return to_numpy(reference(s, T, span_of(x), r, w), {std::size_t(T), std::size_t(H)});
        },
        nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"), nb::arg("w_up"),
        nb::arg("w_down"), nb::arg("shared_gate") = nb::none(), nb::arg("shared_up") = nb::none(),
        nb::arg("shared_down") = nb::none(), nb::arg("swiglu_limit") = nb::none());
  }

  // The fused forward's workspace for one shape and up to max_tokens tokens (one GPU, EP = 1).
  nb::class_<mok::Workspace>(m, "Workspace")
      .def(
          "__init__",
          [](mok::Workspace* self, std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts,
             std::int64_t top_k, std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens,
             int device, int compute_sms, double timeout_seconds, bool training, const std::string& precision,
             bool replay_launches, int backward_column_blocks, bool recompute) {
            const mok::Precision prec = parse_precision("mok.Workspace", precision);
            const mok::Training mode = training_mode("mok.Workspace", training, recompute);
            if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
              throw nb::value_error(("mok.Workspace: cannot use CUDA device " + std::to_string(device) + ": " +
                                     cudaGetErrorString(err)).c_str());
            mok::Config config;
            config.compute_sms = compute_sms;
            config.timeout_seconds = timeout_seconds;
            config.precision = prec;
            config.replay_launches = replay_launches;
            config.backward_column_blocks = backward_column_blocks;
            new (self) mok::Workspace(make_shape(hidden, intermediate, num_experts, num_experts, top_k,
                                                 shared_intermediate, limit),
                                      tokens, config, mode);
          },
          nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("top_k"),
          nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("max_tokens"), nb::arg("device"),
          nb::arg("compute_sms") = 0, nb::arg("timeout_seconds") = 10.0, nb::arg("training") = false,
          nb::arg("precision") = "bf16", nb::arg("replay_launches") = true, nb::arg("backward_column_blocks") = 0,
          nb::arg("recompute") = false)
      .def_prop_ro("max_tokens", &mok::Workspace::max_tokens)
      // training with recompute=True: the backward runs GEMM1 again (Training::recompute), so
      // the forward saves nothing and the backward takes saved=None
      .def_prop_ro("recompute", [](const mok::Workspace& ws) { return ws.training() == mok::Training::recompute; })
      .def_prop_ro("replayed_calls", &mok::Workspace::replayed_calls)  // (Config::replay_launches)
      .def_prop_ro("compute_sms", [](const mok::Workspace& ws) { return ws.config().compute_sms; })
      .def_prop_ro("captured_calls", &mok::Workspace::captured_calls)
      .def(
          "saved_elements",
          [](const mok::Workspace& ws, std::optional<std::int64_t> tokens) {
            return ws.saved_elements(tokens.value_or(ws.max_tokens()));
          },
          nb::arg("tokens") = nb::none())
      .def(
          "forward_scratch_bytes",
          [](const mok::Workspace& ws, std::optional<std::int64_t> tokens) {
            return ws.forward_scratch_bytes(tokens.value_or(ws.max_tokens()));
          },
          nb::arg("tokens") = nb::none())
      .def(
          "backward_scratch_bytes",
          [](const mok::Workspace& ws, bool f32_grads, std::optional<std::int64_t> tokens, bool gate_up_adjacent,
             bool dx_apart, bool fp8_dgrad, bool fp8_wgrad) {
            return ws.backward_scratch_bytes(f32_grads ? mok::DType::f32 : mok::DType::bf16,
                                             tokens.value_or(ws.max_tokens()), gate_up_adjacent, dx_apart, fp8_dgrad,
                                             fp8_wgrad);
          },
          nb::arg("f32_grads") = false, nb::arg("tokens") = nb::none(), nb::arg("gate_up_adjacent") = false,
          nb::arg("dx_apart") = false, nb::arg("fp8_dgrad") = false, nb::arg("fp8_wgrad") = false)
      .def("check", [](mok::Workspace& ws, std::uintptr_t stream) { ws.check(reinterpret_cast<cudaStream_t>(stream)); })
      .def_prop_ro("bytes", &mok::Workspace::bytes);

  def_forward<mok::Workspace>(m, "forward", "workspace", "mok.forward",
                              [](mok::Workspace& ws, const mok::ForwardArgs& a, cudaStream_t stream,
                                 const std::optional<mok::TensorView>& saved,
                                 const std::optional<mok::TensorView>& scratch, bool rows_enqueued) {
                                mok::forward(a, ws, stream, saved, scratch, rows_enqueued);
                              });

  // The first enqueue of a forward in two (mok::forward_rows): the plan and x's routed rows
  // into the scratch; then forward(..., rows_enqueued=True) with the same x, topk_ids, scratch
  // and stream.
  m.def(
      "forward_rows",
      [](mok::Workspace& ws, nb::ndarray<> x, nb::ndarray<> ids, std::uintptr_t stream,
         std::optional<nb::ndarray<>> scratch) {
        const mok::TensorView x_view = view_of(x), ids_view = view_of(ids);
        select_device(x_view, "mok.forward_rows");
        const std::optional<mok::TensorView> scratch_view = optional_view(scratch);
        nb::gil_scoped_release release;
        mok::forward_rows(x_view, ids_view, ws, reinterpret_cast<cudaStream_t>(stream), scratch_view);
      },
      nb::arg("workspace"), nb::arg("x"), nb::arg("topk_ids"), nb::arg("stream"),
      nb::arg("scratch").none() = nb::none());

  // The FP8 forward (a Workspace made with precision="fp8"): the forward's arguments, then the
  // routed weights as mok.fp8.quantize_weights gives them: E4M3 values (u8) and block
  // exponents (i32) of gate, up and down; saved (training): the pre-activations to fill, which
  // the (bf16) mok._C.backward reads.
  def_forward_fp8<mok::Workspace>(m, "forward_fp8", "workspace", "mok.forward_fp8",
                                  [](mok::Workspace& ws, const mok::ForwardArgs& a, cudaStream_t stream,
                                     const std::optional<mok::TensorView>& saved,
                                     const std::optional<mok::TensorView>& scratch) {
                                    mok::forward(a, ws, stream, saved, scratch);
                                  });

  def_backward<mok::Workspace>(m, "backward", "workspace", "mok.backward",
                               [](mok::Workspace& ws, const mok::ForwardArgs& a, const mok::BackwardArgs& b,
                                  cudaStream_t stream, const std::optional<mok::TensorView>& saved,
                                  const std::optional<mok::TensorView>& scratch) {
                                 mok::backward(a, b, ws, stream, saved, scratch);
                               });

  // Expert parallelism: one rank of a group whose symmetric regions come from the caller
  // (PyTorch symmetric memory: the rendezvous' buffer_ptrs).
  m.def(
      "ep_region_bytes",
      [](std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts, std::int64_t num_local_experts,
         std::int64_t top_k, std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens) {
        return mok::EpRank::region_bytes(
            make_shape(hidden, intermediate, num_experts, num_local_experts, top_k, shared_intermediate, limit), tokens);
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("num_local_experts"),
      nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"));

  m.def(
      "default_backward_column_blocks",
      [](std::int64_t hidden, std::int64_t intermediate, bool recompute, const std::string& precision) {
        mok::MoeShape shape;
        shape.hidden = hidden, shape.intermediate = intermediate;
        return mok::default_backward_column_blocks(shape, recompute ? mok::Training::recompute : mok::Training::save,
                                                   parse_precision("mok.default_backward_column_blocks", precision));
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("recompute"), nb::arg("precision") = "bf16",
      "The column blocks a training workspace's backward_column_blocks = 0 stands for, by its precision (no GPU needed).");

  m.def(
      "ep_saved_elements",
      [](std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts, std::int64_t num_local_experts,
         std::int64_t top_k, std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens,
         double capacity_factor) {
        mok::Config config;
        config.capacity_factor = capacity_factor;
        return mok::saved_elements(
            make_shape(hidden, intermediate, num_experts, num_local_experts, top_k, shared_intermediate, limit), tokens,
            config);
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("num_local_experts"),
      nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"),
      nb::arg("capacity_factor") = 0.0,
      "bf16 elements of one EP rank's saved tensor (no GPU needed; capacity_factor: the rank's, 0 the worst case).");

  nb::class_<mok::EpRank>(m, "EpRank")
      .def(
          "__init__",
          [](mok::EpRank* self, std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts,
             std::int64_t num_local_experts, std::int64_t top_k, std::int64_t shared_intermediate,
             std::optional<float> limit, std::int64_t tokens, int rank, std::vector<std::uintptr_t> region_ptrs,
             int device, int compute_sms, double timeout_seconds, bool training, bool peers_on_other_gpus,
             int comm_sms, std::int64_t ring_rows, std::int64_t minibatch_rows, bool pull_tokens_once,
             std::int64_t interleave_rows, const std::string& precision, bool fp8_dgrad, bool pull_fp8_rows,
             bool recompute, double capacity_factor) {
            const mok::Precision prec = parse_precision("mok.EpRank", precision);
            const mok::Training mode = training_mode("mok.EpRank", training, recompute);
            if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
              throw nb::value_error(("mok.EpRank: cannot use CUDA device " + std::to_string(device) + ": " +
                                     cudaGetErrorString(err)).c_str());
            mok::Config config;
            config.precision = prec;
            config.fp8_dgrad = fp8_dgrad;  // (the FP8 dgrad's rows held from construction: Config::fp8_dgrad)
            config.pull_fp8_rows = pull_fp8_rows;  // (peers pull E4M3 rows: Config::pull_fp8_rows)
            config.compute_sms = compute_sms;
            config.timeout_seconds = timeout_seconds;
            config.comm_sms = comm_sms;  // comm_sms or ring_rows > 0: the ring of received rows (mok/types.hpp)
            config.ring_rows = ring_rows;
            config.minibatch_rows = minibatch_rows;
            config.pull_tokens_once = pull_tokens_once;
            config.interleave_rows = interleave_rows;
            config.capacity_factor = capacity_factor;  // (0: room for the worst case, EP * T * k rows)
            std::vector<void*> bases;
            for (std::uintptr_t p : region_ptrs) bases.push_back(reinterpret_cast<void*>(p));
            new (self) mok::EpRank(
                make_shape(hidden, intermediate, num_experts, num_local_experts, top_k, shared_intermediate, limit),
                tokens, rank, bases, config, mode, peers_on_other_gpus);
          },
          nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("num_local_experts"),
          nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"),
          nb::arg("rank"), nb::arg("region_ptrs"), nb::arg("device"), nb::arg("compute_sms") = 0,
          nb::arg("timeout_seconds") = 10.0, nb::arg("training") = false, nb::arg("peers_on_other_gpus") = true,
          nb::arg("comm_sms") = 0, nb::arg("ring_rows") = 0, nb::arg("minibatch_rows") = 4096,
          nb::arg("pull_tokens_once") = false, nb::arg("interleave_rows") = 0, nb::arg("precision") = "bf16",
          nb::arg("fp8_dgrad") = false, nb::arg("pull_fp8_rows") = false, nb::arg("recompute") = false,
          nb::arg("capacity_factor") = 0.0)
      .def_prop_ro("saved_elements", &mok::EpRank::saved_elements)
      // training with recompute=True: the forward saves nothing, the backward runs GEMM1 again
      .def_prop_ro("recompute", [](const mok::EpRank& r) { return r.training() == mok::Training::recompute; })
      .def("check", [](mok::EpRank& r, std::uintptr_t stream) { r.check(reinterpret_cast<cudaStream_t>(stream)); });

  def_forward<mok::EpRank>(m, "ep_forward", "rank", "mok.ep_forward",
                           [](mok::EpRank& rank, const mok::ForwardArgs& a, cudaStream_t stream,
                              const std::optional<mok::TensorView>& saved,
                              const std::optional<mok::TensorView>& scratch, bool rows_enqueued) {
                             if (scratch) throw mok::ArgumentError("mok.ep_forward: scratch: an EP rank owns its buffers; pass None");
                             if (rows_enqueued) throw mok::ArgumentError("mok.ep_forward: rows_enqueued: one GPU only");
                             rank.forward(a, stream, saved);
                           });

  // The FP8 forward of an EP rank made with precision="fp8" (its backward: ep_backward, in bf16 or,
  // given fp8_dgrad, with the FP8 dgrad and optionally FP8 weight gradients).
  def_forward_fp8<mok::EpRank>(m, "ep_forward_fp8", "rank", "mok.ep_forward_fp8",
                               [](mok::EpRank& rank, const mok::ForwardArgs& a, cudaStream_t stream,
                                  const std::optional<mok::TensorView>& saved,
                                  const std::optional<mok::TensorView>& scratch) {
                                 if (scratch) throw mok::ArgumentError("mok.ep_forward_fp8: scratch: an EP rank owns its buffers; pass None");
                                 rank.forward(a, stream, saved);
                               });

  def_backward<mok::EpRank>(m, "ep_backward", "rank", "mok.ep_backward",
                            [](mok::EpRank& rank, const mok::ForwardArgs& a, const mok::BackwardArgs& b,
                               cudaStream_t stream, const std::optional<mok::TensorView>& saved,
                               const std::optional<mok::TensorView>& scratch) {
                              if (scratch) throw mok::ArgumentError("mok.ep_backward: scratch: an EP rank owns its buffers; pass None");
                              rank.backward(a, b, stream, saved);
                            });

  m.def(
      "saved_elements",
      [](std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts, std::int64_t top_k,
         std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens) {
        return mok::saved_elements(make_shape(hidden, intermediate, num_experts, num_experts, top_k,
                                              shared_intermediate, limit),
                                   tokens);
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("top_k"),
      nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"),
      "bf16 elements of the tensor a training forward saves for the backward (no GPU needed).");
}
