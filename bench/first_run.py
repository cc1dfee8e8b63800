"""Why the first policy an engine run measures is slower than the same policy measured later (on
an H100 the full 256-request run's first policy made 3,100-3,900 tok/s and the same policy
measured second 5,600-7,300, whichever policy came first): the same policy served several times
in one process after the engine's warm-up, each run's seconds beside what the CUDA caching
allocator and the pinned host allocator did during it (new device segments are cudaMalloc
calls, which wait for the device; new pinned blocks are cudaHostAlloc calls).

    python bench/first_run.py --trace t256.csv --policy static --runs 3 --warmup first
    python bench/first_run.py ... --warmup longest    # the warm-up over the longest prompts

Prints one JSON object. A diagnostic for a GPU machine; on a CPU the allocator figures are null.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from allocator.serving.engine.cli import warmup_prompts
from allocator.serving.engine.serve import build_model, prompt_ids, serve
from allocator.serving.models import load_config
from allocator.trace import load_trace


def allocator_counts(device) -> dict:
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    out = {k: s.get(k) for k in ("segment.all.allocated", "num_alloc_retries",
                                 "num_device_alloc", "num_sync_all_streams")}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        h = host()
        out.update({"host " + k: h.get(k) for k in ("num_host_alloc", "allocations.allocated")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--policy", default="static")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--kv-pool-mb", type=float, default=4000)
    ap.add_argument("--max-model-len", type=int, default=2304)
    ap.add_argument("--warmup", choices=("first", "longest"), default="first")
    a = ap.parse_args()
    config, folder = load_config(a.model)
    model = build_model(config, a.dtype, a.device, 0, folder)
    trace = load_trace(a.trace)
    prompts = prompt_ids(len(trace.prompt), trace.prompt, config.vocab_size, 0)
    gen = [int(g) for g in trace.generated]
    common = dict(pool_bytes=int(a.kv_pool_mb * 1e6), max_model_len=a.max_model_len,
                  max_batch=a.max_batch)
    dev = next(model.parameters()).device
    warm = warmup_prompts(prompts, a.max_batch, longest=a.warmup == "longest")
    t0 = time.perf_counter()
    serve(model, warm, [1 + j % 4 for j in range(len(warm))], [0.0] * len(warm), a.policy,
          **common)
    out = {"warmup": a.warmup, "warmup_s": time.perf_counter() - t0, "runs": []}
    for _ in range(a.runs):
        before = allocator_counts(dev)
        run = serve(model, prompts, gen, np.zeros(len(prompts)), a.policy, **common)
        after = allocator_counts(dev)
        out["runs"].append({"seconds": run["seconds"], "output_tps": sum(gen) / run["seconds"],
                            **{k: (after[k] - before[k]) if after[k] is not None else None
                               for k in after}})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
