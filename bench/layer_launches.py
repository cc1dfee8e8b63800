"""Kernel launches of one decode step, by decoder layer and for the rest of the step, with the
fused layers and with transformers' modules, for the shipped model configs (random weights,
small sizes: the count does not depend on them). Counted on the CPU with the Triton
kernels under TRITON_INTERPRET=1 (set here), or on a GPU: the same operators and kernels run.
--prefill N counts a step of N whole prompts instead, also with the fused layers and the prompts
over the run tables (--prompt-attention runs).

    .venv/bin/python bench/layer_launches.py [--models tiny-qwen2,qwen2.5-0.5b] [--prefill 8]

At a decode batch each launch costs a GPU a few microseconds whatever it computes, inside a
CUDA graph too: a layer's launches are what it costs there beside its weight reads.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-llama,tiny-qwen2,tiny-mistral,qwen2.5-0.5b",
                   help="the engine's model configs (shipped names or config.json paths)")
    p.add_argument("--device", default="cpu",
                   help="cpu (the Triton kernels interpreted) or a CUDA device (compiled)")
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="count a step of N whole prompts of 9 tokens (default: a decode step)")
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from allocator.serving import models
    from allocator.serving.engine.launches import step_launches
    from odma_cli.errors import BadArgument

    try:
        configs = [(name, models.load_config(name)[0]) for name in a.models.split(",")]
    except BadArgument as exc:
        print(f"layer_launches.py: {exc}", file=sys.stderr)
        sys.exit(2)
    ways = [("off", "dense", "modules"), ("on", "dense", "fused")]
    if a.prefill:
        ways.append(("on", "runs", "fused, prompts over runs"))
    step, batch = ("prefill", a.prefill) if a.prefill else ("decode", 4)
    names = " / ".join(w[2] for w in ways)
    print(f"| model | layers | a layer: {names} | rest of the step | the step |")
    print("|---|---|---|---|---|")
    for name, cfg in configs:
        layers = cfg.num_hidden_layers
        small = _shrunk(cfg)
        counts = [step_launches(small, "triton", fused, a.device, batch, step, prompts)[:2]
                  for fused, prompts, _ in ways]
        steps = [per_layer * layers + rest for per_layer, rest in counts]
        print(f"| {name} | {layers} | {' / '.join(str(c[0]) for c in counts)} | "
              f"{' / '.join(str(c[1]) for c in counts)} | {' / '.join(map(str, steps))} "
              f"({steps[0] / steps[-1]:.1f}x) |")


def _shrunk(cfg):
    """The config with its grouped-query ratio, biases and activation kept and its sizes cut,
    so that a CPU runs it in seconds."""
    import copy

    small = copy.deepcopy(cfg)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    group = heads // kv
    small.num_key_value_heads = min(kv, 2)
    small.num_attention_heads = small.num_key_value_heads * group
    small.head_dim = 16
    small.hidden_size = 64
    small.intermediate_size = 128
    return small


if __name__ == "__main__":
    main()
