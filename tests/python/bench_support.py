"""What the benchmark tools' CPU tests share: bench/ on sys.path, where mok_bench was built, and
a small preset."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

MOK_BENCH = next((p for p in (os.path.join(ROOT, d, "bench", "mok_bench")
                              for d in (os.environ.get("MOK_BUILD_DIR", "build"), "build-gpu")) if os.path.exists(p)),
                 os.path.join(ROOT, "build", "bench", "mok_bench"))


def small_preset(shared=0, limit=0.0, tokens=96, experts=8, top_k=2):
    return dict(name="test", tokens=tokens, hidden=128, intermediate=64, experts=experts, top_k=top_k,
                shared_intermediate=shared, swiglu_limit=limit)
