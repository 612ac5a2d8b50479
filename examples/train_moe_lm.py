#!/usr/bin/env python3
"""Train a small mixture-of-experts language model on synthetic data with the fused MoK
kernel and with the plain PyTorch path, eager and under torch.compile (same
initialisation, same data), and compare the loss curves and tokens/s.

    python examples/train_moe_lm.py                          # mok, torch, torch-compiled (Hopper GPU)
    python examples/train_moe_lm.py --backend mok,mok-compiled,torch,torch-compiled --out run.json
    python examples/train_moe_lm.py --backend torch --device cpu --size tiny --steps 60

Backends: `mok` (the experts on the fused kernel), `mok-fp8` (the same with the routed
experts' forward in FP8, `precision="fp8"`; --fp8-dgrad: its backward's dgrad GEMMs in FP8 too,
`auto` where mok.fp8.dgrad_pays; with the FP8 dgrad, the weight gradients' GEMMs run in FP8 too
unless --fp8-wgrad off, mok.set_fp8_weight_gradients), `mok-fp8-dgrad` (the FP8 forward with the
FP8 dgrad whatever --fp8-dgrad says: one run can hold both FP8 backwards beside bf16),
`mok-recompute` (mok with recompute=True: the layers keep no pre-activations for the backward,
which runs GEMM1 again; its losses must equal mok's bitwise, and the script says whether they do), `torch`
(mok.moe_torch, the same layer in plain PyTorch), and `-compiled` variants of each: the whole
model under torch.compile (graph breaks, if any, are counted and reported). --out writes the losses of every step and the
tokens/s of each backend as JSON (with the commit, GPU and PyTorch version).

The data is a random Markov chain over the vocabulary (each token has four possible
successors), so the loss falls from ln(vocab) towards the chain's entropy (< ln 4) as the
model learns the table. The script exits non-zero if the loss does not fall.

The recipe: AdamW at --lr after a linear warm-up (--lr-warmup steps), cosine decay to a tenth of
it, the gradients' global norm clipped to --clip, and PyTorch's deterministic algorithms
(--deterministic; the fused layer is deterministic by itself), so one seed gives the same losses
run after run and two backends' curves differ only by what the backends compute. "largest rise":
the highest a loss rose above the lowest before it after the warm-up (a spike's height). (Before
2026-12-05 the example ran a constant rate of 3e-3 without clipping or determinism: its bf16 runs moved by
up to 5 % between two runs of one seed and spiked mid-run; bench/NOTES.md.)
"""

import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import mok

SIZES = {  # vocab, hidden, layers, heads, expert intermediate, experts, top_k, sequence, batch
    "tiny": dict(vocab=256, hidden=128, layers=2, heads=4, inter=64, experts=8, top_k=2, seq=64, batch=8),
    "small": dict(vocab=4096, hidden=1024, layers=4, heads=8, inter=512, experts=16, top_k=4, seq=512, batch=16),
}


class Block(nn.Module):
    def __init__(self, c, backend, device, dtype, precision="bf16", fp8_dgrad=None, group=None, recompute=False):
        super().__init__()
        h = c["hidden"]
        self.heads = c["heads"]
        self.norm1 = nn.RMSNorm(h, device=device, dtype=dtype)
        self.qkv = nn.Linear(h, 3 * h, bias=False, device=device, dtype=dtype)
        self.proj = nn.Linear(h, h, bias=False, device=device, dtype=dtype)
        self.norm2 = nn.RMSNorm(h, device=device, dtype=dtype)
        # (group: a mok.ep.ExpertParallel; the layer then holds its rank's share of the experts,
        # examples/train_moe_ep.py)
        self.moe = mok.MoE(h, c["inter"], c["experts"], c["top_k"], backend=backend, load_balancing=True,
                           precision=precision, fp8_dgrad=fp8_dgrad if precision == "fp8" else None,
                           group=group, recompute=recompute, device=device, dtype=dtype)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.moe(self.norm2(x))


class MoeLM(nn.Module):
    def __init__(self, c, backend, device, dtype, precision="bf16", fp8_dgrad=None, group=None, recompute=False):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["hidden"], device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(c, backend, device, dtype, precision, fp8_dgrad, group, recompute)
                                    for _ in range(c["layers"]))
        self.norm = nn.RMSNorm(c["hidden"], device=device, dtype=dtype)
        self.head = nn.Linear(c["hidden"], c["vocab"], bias=False, device=device, dtype=dtype)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MarkovData:
    """Sequences from a fixed random chain: each token has four successors with fixed
    probabilities. Yields (inputs, targets) batches."""

    def __init__(self, vocab, seed, device):
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, 4), generator=g)
        self.probs = torch.softmax(torch.randn(vocab, 4, generator=g) * 1.5, dim=-1)
        self.entropy = float(-(self.probs * self.probs.log()).sum(-1).mean())
        self.vocab, self.gen, self.device = vocab, g, device

    def batches(self, steps, batch, seq):
        """steps batches of (inputs, targets), made in one pass (each step's sequences in a row)."""
        n = steps * batch
        tokens = torch.empty(n, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (n,), generator=self.gen)
        for t in range(seq):
            prev = tokens[:, t]
            choice = torch.multinomial(self.probs[prev], 1, generator=self.gen).squeeze(1)
            tokens[:, t + 1] = self.successors[prev, choice]
        tokens = tokens.to(self.device).view(steps, batch, seq + 1)
        return [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(steps)]


def lm_loss(model, inputs, targets, forward=None):
    """A batch's language-model loss (fp32 logits) through forward (default: the model itself,
    else e.g. its compiled twin), and the model's MoE layers' mean load-balancing loss."""
    logits = (model if forward is None else forward)(inputs)  # (a compiled module has no truth value)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, sum(block.moe.aux_loss for block in model.blocks) / len(model.blocks)


def add_run_args(ap):
    """The options both training examples take (size, device, steps, the optimizer's schedule,
    the load-balancing weight, the seed); read them back with run_args."""
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="peak learning rate (AdamW; 3e-3 until 2026-12-05, where this model's loss spikes after the "
                         "warm-up in bf16 too: bench/NOTES.md)")
    ap.add_argument("--lr-warmup", type=int, default=None,
                    help="steps of linear learning-rate warm-up (default: a tenth of --steps, at most 50); then "
                         "cosine decay to 0.1 x --lr at the last step")
    ap.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                    help="after the warm-up: cosine decay to 0.1 x --lr, or --lr throughout")
    ap.add_argument("--clip", type=float, default=1.0, help="clip the gradients' global norm to this (0: no clipping)")
    ap.add_argument("--balance", type=float, default=0.01, help="weight of the router load-balancing loss")
    ap.add_argument("--seed", type=int, default=0)


def run_args(ap):
    """ap's parsed arguments, --lr-warmup's default filled in and checked."""
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if not 0 < args.lr < math.inf:
        ap.error(f"--lr must be a finite positive number, got {args.lr}")
    if not 0 <= args.clip < math.inf:
        ap.error(f"--clip must be a finite number >= 0 (0: no clipping), got {args.clip}")
    if args.lr_warmup is None:
        args.lr_warmup = min(50, args.steps // 10)
    if args.lr_warmup < 0 or args.lr_warmup >= args.steps:
        ap.error(f"--lr-warmup must be in [0, --steps), got {args.lr_warmup} with --steps {args.steps}")
    return args


def learning_rate(step, args):
    """Linear warm-up over --lr-warmup steps, then cosine decay to 10 % of --lr at the last step
    (--schedule constant: --lr after the warm-up)."""
    if step < args.lr_warmup:
        return args.lr * (step + 1) / args.lr_warmup
    if args.schedule == "constant":
        return args.lr
    span = max(1, args.steps - args.lr_warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - args.lr_warmup) / span)))


def train(backend, args, c, device, dtype, batches, entropy):
    torch.manual_seed(args.seed)
    layer_backend, compiled = backend.removesuffix("-compiled"), backend.endswith("-compiled")
    precision = "fp8" if layer_backend.startswith("mok-fp8") else "bf16"
    fp8_dgrad = True if layer_backend == "mok-fp8-dgrad" else {"auto": None, "on": True, "off": False}[args.fp8_dgrad]
    recompute = layer_backend == "mok-recompute"
    layer_backend = "mok" if layer_backend.startswith("mok") else layer_backend
    model = MoeLM(c, layer_backend, device, dtype, precision, fp8_dgrad, recompute=recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    forward = torch.compile(model) if compiled else model
    tokens_per_step = c["batch"] * c["seq"]
    losses, grad_norms, timed_tokens, timed_seconds = [], [], 0, 0.0
    bar = tqdm(range(args.steps), desc=f"{backend:14s}", unit="step")
    for step in bar:
        inputs, targets = batches[step]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, balance = lm_loss(model, inputs, targets, forward)
        opt.zero_grad(set_to_none=True)
        (loss + args.balance * balance).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip if args.clip > 0 else float("inf"))
        opt.step()
        loss_value = loss.item()  # synchronises
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            timed_tokens += tokens_per_step
            timed_seconds += elapsed
        losses.append(loss_value)
        grad_norms.append(float(norm))
        rate = timed_tokens / timed_seconds if timed_seconds else float("nan")
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:,.0f}")
    if layer_backend == "mok":
        mok.check()  # raise now if a kernel flagged bad input
    return losses, timed_tokens / timed_seconds if timed_seconds else float("nan"), entropy, grad_norms


def largest_rise(losses, start):
    """The largest loss above the lowest one before it, from step `start` on (a spike's height)."""
    lowest, rise = float("inf"), 0.0
    for step, loss in enumerate(losses):
        if step >= start:
            rise = max(rise, loss - lowest)
        lowest = min(lowest, loss)
    return rise


def graph_breaks():
    """Graph breaks torch.compile has reported so far in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


BACKENDS = ("mok", "mok-compiled", "mok-fp8", "mok-fp8-compiled", "mok-fp8-dgrad", "mok-recompute",
            "mok-recompute-compiled", "torch", "torch-compiled")


def with_precision(backends, precision):
    """--precision: fp8 turns mok / mok-compiled into their FP8 twins; both adds each twin after it."""
    twins = {"mok": "mok-fp8", "mok-compiled": "mok-fp8-compiled"}
    chosen = []
    for b in backends:
        if precision == "bf16" or precision == "both" or b not in twins:
            chosen.append(b)
        if precision != "bf16" and b in twins:
            chosen.append(twins[b])
    return list(dict.fromkeys(chosen))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="mok,torch,torch-compiled",
                    help=f"comma-separated, among {', '.join(BACKENDS)} ('both' = mok,torch)")
    ap.add_argument("--precision", choices=("bf16", "fp8", "both"), default="bf16",
                    help="the routed experts' forward on the mok backends: fp8 turns mok / mok-compiled into "
                         "mok-fp8 / mok-fp8-compiled, both runs each beside its fp8 twin (same seed and data)")
    ap.add_argument("--fp8-dgrad", choices=("auto", "on", "off"), default="auto",
                    help="the mok-fp8 backends' backward dgrad GEMMs in FP8: on, off, or auto (mok.MoE's default: "
                         "where mok.fp8.dgrad_pays, intermediate >= 1024)")
    ap.add_argument("--fp8-wgrad", choices=("on", "off"), default="on",
                    help="with the FP8 dgrad, the mok-fp8 backends' weight-gradient GEMMs in FP8 too: on (mok's "
                         "default) or off (bf16; mok.set_fp8_weight_gradients)")
    add_run_args(ap)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    ap.add_argument("--deterministic", choices=("on", "off"), default="on",
                    help="torch.use_deterministic_algorithms (PyTorch's own kernels too, e.g. the attention's "
                         "backward): the same seed gives the same losses, bitwise, run after run")
    ap.add_argument("--out", default="", help="write the losses and tokens/s of every backend as JSON")
    ap.add_argument("--commit", default=os.environ.get("MOK_COMMIT", "unknown"))
    args = run_args(ap)
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup (steps left out of tokens/s) must be in [0, --steps), got {args.warmup} with --steps {args.steps}")
    if args.out:  # (checked before training: the results were lost after the whole run when the path was bad)
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            ap.error(f"--out {args.out}: the folder {folder} does not exist or is not writable")
    if args.deterministic == "on":  # (before cuBLAS starts: its workspace setting is read then)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    backends = ["mok", "torch"] if args.backend == "both" else args.backend.split(",")
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend '{b}'; known: {', '.join(BACKENDS)}")
    backends = with_precision(backends, args.precision)
    if any(b.startswith("mok") for b in backends) and device.type != "cuda":
        ap.error("the mok backends need a Hopper GPU (--device cuda); use --backend torch on the CPU")
    if any(b.startswith("mok") for b in backends):
        import mok

        mok.set_fp8_weight_gradients(args.fp8_wgrad == "on")  # (only where the FP8 dgrad runs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the fused kernel is bf16
    c = SIZES[args.size]
    print(f"{args.size}: vocab {c['vocab']}, hidden {c['hidden']}, {c['layers']} layers, {c['experts']} experts "
          f"(top-{c['top_k']}, intermediate {c['inter']}), {c['batch']}x{c['seq']} tokens a step, on {device}")
    data = MarkovData(c["vocab"], args.seed, device)
    batches = data.batches(args.steps, c["batch"], c["seq"])  # the same data for every backend
    results, breaks = {}, {}
    for b in backends:
        before = graph_breaks()
        results[b] = train(b, args, c, device, dtype, batches, data.entropy)
        breaks[b] = graph_breaks() - before
    print(f"\n{'backend':15s} {'first loss':>10s} {'final loss':>10s} {'largest rise':>12s} {'tokens/s':>12s} "
          f"{'graph breaks':>13s}")
    ok = True
    for b, (losses, rate, entropy, _) in results.items():
        final = sum(losses[-10:]) / len(losses[-10:])
        print(f"{b:15s} {losses[0]:10.3f} {final:10.3f} {largest_rise(losses, args.lr_warmup):12.3f} {rate:12,.0f} "
              f"{breaks[b] if b.endswith('compiled') else '':>13}")
        ok = ok and final < 0.8 * losses[0]
    print(f"(start ~ ln vocab = {math.log(c['vocab']):.2f}; the chain's entropy, the floor: {entropy:.2f})")
    for other in ("torch", "torch-compiled", "mok", "mok-compiled"):
        for mine in (b for b in BACKENDS if b.startswith("mok")):
            if mine == other:
                continue
            if mine in results and other in results:
                print(f"{mine} / {other} tokens/s: {results[mine][1] / results[other][1]:.3f}x")
    for saving, recomputing in (("mok", "mok-recompute"), ("mok-compiled", "mok-recompute-compiled")):
        if saving in results and recomputing in results:  # (the same bits by design: a difference is a bug)
            same = results[saving][0] == results[recomputing][0] and results[saving][3] == results[recomputing][3]
            print(f"{recomputing} losses and gradient norms bitwise {saving}'s: {same}")
            ok = ok and same
    for bf16, fp8 in (("mok", "mok-fp8"), ("mok", "mok-fp8-dgrad"), ("mok-compiled", "mok-fp8-compiled")):
        if bf16 in results and fp8 in results:  # issue 19's bar: within 2 % of bf16's final loss
            a, b = (sum(results[k][0][-10:]) / len(results[k][0][-10:]) for k in (bf16, fp8))
            print(f"{fp8} final loss vs {bf16}: {(b - a) / a:+.2%}")
    if args.out:
        record = dict(example="train_moe_lm", commit=args.commit, size=args.size, config=c, steps=args.steps, fp8_dgrad=args.fp8_dgrad,
                      fp8_wgrad=args.fp8_wgrad,
                      warmup_steps=args.warmup, seed=args.seed, lr=args.lr, lr_warmup=args.lr_warmup,
                      schedule=args.schedule, clip=args.clip,
                      deterministic=args.deterministic == "on", device=str(device),
                      gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      torch=torch.__version__,
                      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                      backends={b: dict(losses=losses, grad_norms=norms, tokens_per_s=rate,
                                        final_loss=sum(losses[-10:]) / len(losses[-10:]),
                                        largest_rise=largest_rise(losses, args.lr_warmup),
                                        graph_breaks=breaks[b] if b.endswith("compiled") else None)
                                for b, (losses, rate, _, norms) in results.items()},
                      entropy_floor=entropy)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if not ok:
        raise SystemExit("the loss did not fall below 0.8x its first value, or a recompute run differed from its "
                         "saving twin")


if __name__ == "__main__":
    main()
