"""What the engine itself costs on a device, measured for a card: the rate its attention kernel
reads KV runs at, by run length (the card's engine_run_gbps), and the time of its own decode,
prefill and chunked-prefill steps over the batches and contexts it serves (fitted into the
card's overheads by fit.py).

Both run the engine's code as it serves: Runner steps over KVPool blocks of a policy's
allocator, and decode_attention over run tables with the backend the engine picks on the device
(Triton on CUDA, the batched torch path elsewhere).
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from allocator.serving.cards.fit import nnls
from allocator.serving.cards.measure import (Effort, graphed, per_linear, synchronizer,
                                             time_in_turns)

FIT_POLICY = "static"                  # contiguous blocks, as the engine's odma and static keep
READ_LAYERS = 4                        # layers of the pool the read measurement cycles through
ACCELERATOR_READS = (64, (1024, 4096))  # requests, and the two contexts, on an accelerator
# untimed steps after a round's anchors. With none, a tiny model's first step took a third
# longer; with one, the first shapes of the round (2 layers, context 17) still took 1.11-1.19x
# the same steps at context 257 in three quick calibrations on a 2-core EPYC, and 0.90-0.97x
# with five (largest residual of the fit 0.079-0.107, then 0.063-0.085)
SETTLE_STEPS = 5


def _quartiles(t: list) -> dict:
    q1, _, q3 = statistics.quantiles(t, n=4) if len(t) > 1 else (t[0], t[0], t[0])
    return {"step_s": statistics.median(t), "step_min_s": min(t), "step_max_s": max(t),
            "step_q1_s": q1, "step_q3_s": q3}


# ------------------------------------------------------------------ the attention's read rate
def read_tables(torch, device, dtype, run_tokens: int, batch: int, context: int, kv_heads: int,
                head_dim: int, rng):
    """(pool, RunTable): `batch` requests of `context` tokens, each in regions of `run_tokens`
    tokens (the last partly filled) laid out head-major for READ_LAYERS layers as the engine's
    KVPool lays them out, the regions in random order; random KV."""
    from allocator.serving.engine import run_attention as ra

    per_region = READ_LAYERS * 2 * kv_heads * run_tokens * head_dim     # elements
    per_req = -(-context // run_tokens)
    slots = rng.permutation(batch * per_req)
    pool = torch.randn(batch * per_req * per_region, dtype=torch.float32).to(device, dtype)
    requests = [[(int(slots[b * per_req + j]) * per_region, run_tokens,
                  min(run_tokens, context - j * run_tokens)) for j in range(per_req)]
                for b in range(batch)]
    runs = ra.RunTable.from_requests(requests, device, max_context=context,
                                     align=16 // pool.element_size())
    return pool, runs


def read_shape(effort: Effort, device) -> tuple[int, tuple]:
    """(requests, (short, long context)) of the read measurement on `device`: an accelerator
    reads a CPU's working set in microseconds, so there more of it (ACCELERATOR_READS)."""
    return ((effort.read_batch, effort.read_contexts) if device.type == "cpu"
            else ACCELERATOR_READS)


def measure_engine_reads(torch, dev: dict, dtype: str, config, effort: Effort,
                         seed: int) -> dict:
    """The engine's attention reading KV in runs of each of effort.read_run_tokens tokens (a
    page of that many tokens; a contiguous block is one run of its whole context), for
    `config`'s heads: one step's decode_attention over READ_LAYERS layers of effort.read_batch
    requests (ACCELERATOR_READS on an accelerator), the step's run table fresh each time (the
    torch path rebuilds its gather index every step, as the engine's steps do; on CUDA the step
    is a graph replay, as the engine's decode steps are), timed at two contexts. The rate is
    the KV bytes the longer context adds over the time it adds: what each further token costs,
    the step's fixed costs (launches, the table's set-up) cancelled, which the step overheads
    carry instead; none where the longer context did not take longer (noise).
    Returns {"gbps": {run bytes: GB/s}, "points": [...], "backend": ...}; a run's bytes are
    run tokens x head_dim x the element size: one (layer, K or V, KV head) run, as the
    simulator's step timer sizes runs."""
    from allocator.serving.engine import run_attention as ra
    from allocator.serving.models import head_dim

    device = dev["device"]
    tdtype = getattr(torch, dtype)
    kvh, heads, D = config.num_key_value_heads, config.num_attention_heads, head_dim(config)
    backend = ra.attention_backend(device)
    rng = np.random.default_rng(seed)
    B, (short, long) = read_shape(effort, device)
    q = torch.randn(B, heads, D, dtype=torch.float32).to(device, tdtype)
    calls, shapes = [], []
    with torch.no_grad():
        for tokens in (*effort.read_run_tokens, long):
            for context in (short, long):
                pool, runs = read_tables(torch, device, tdtype, min(tokens, context), B,
                                         context, kvh, D, rng)

                def step(pool=pool, runs=runs):
                    runs.reset()         # the torch path's index, rebuilt each step
                    for layer in range(READ_LAYERS):
                        ra.decode_attention(q, pool, runs, layer, kvh, D, D ** -0.5,
                                            backend=backend)
                calls.append(graphed(torch, device, step))
                shapes.append((tokens, context))
        times = [_quartiles(t) for t in time_in_turns(synchronizer(torch, device), calls,
                                                      effort.fit_warmup, effort.fit_reps)]
    element = torch.empty((), dtype=tdtype).element_size()
    added = B * (long - short) * READ_LAYERS * 2 * kvh * D * element
    gbps, points = {}, []
    for k in range(0, len(shapes), 2):
        tokens = shapes[k][0]
        dt = times[k + 1]["step_s"] - times[k]["step_s"]
        rate = added / dt / 1e9 if dt > 0 else None
        run_bytes = tokens * D * element
        if rate is not None:
            gbps[run_bytes] = rate
        points.append({"run_tokens": tokens, "run_bytes": run_bytes, "batch": B,
                       "contexts": [short, long], "short_s": times[k]["step_s"],
                       "long_s": times[k + 1]["step_s"], "gbps": rate,
                       "whole_context": tokens == long})
    return {"gbps": dict(sorted(gbps.items())), "points": points, "backend": backend,
            "layers": READ_LAYERS, "kv_heads": kvh, "head_dim": D, "dtype": dtype}


# ------------------------------------------------------------------ the engine's steps
def _engine(torch, dev, dtype, config, layers, blocks, max_len, max_batch, seed):
    """(allocator, Runner) of `config` cut to `layers` layers, random weights, a static pool of
    `blocks` blocks of max_len tokens (twice that: room for the allocator's alignment), the
    attention backend and CUDA graphs the engine serves with by default on the device."""
    from allocator.config import AllocatorConfig
    from allocator.policies import make_allocator
    from allocator.serving.engine import run_attention
    from allocator.serving.engine.kv_runs import KVPool
    from allocator.serving.engine.runner import Runner, make_graphs
    from allocator.serving.engine.serve import build_model, use_graphs
    from allocator.serving.models import head_dim, kv_bytes_per_token, with_layers

    config = with_layers(config, layers)
    model = build_model(config, dtype, str(dev["device"]), seed)
    bpt = kv_bytes_per_token(config, dtype)
    alloc_config = AllocatorConfig(background_refresh=False)
    alloc = make_allocator(FIT_POLICY, dev["spec"], 2 * blocks * max_len * bpt, bpt, max_len,
                           alloc_config)
    backend = run_attention.attention_backend(dev["device"])
    runner = Runner(model, KVPool(alloc, config, getattr(torch, dtype), head_dim(config)),
                    backend)
    if use_graphs("auto", dev["device"], backend):
        unit = alloc_config.token_alignment
        make_graphs(runner, max_batch, max_batch * (-(-max_len // unit) + 1))
    return alloc, runner


DEEP_ENOUGH = 6      # the deeper fit depth at least: the fit tells a step's own cost from its
                     # layers' by the difference between two depths


def step_contexts(config, effort: Effort) -> list:
    """The decode steps' contexts: effort.fit_contexts within the model's positions."""
    return [c for c in effort.fit_contexts if c < config.max_position_embeddings]


def chunk_shapes(config, effort: Effort) -> list:
    """effort.chunk_shapes whose decodes' context is one the decode steps run at."""
    contexts = step_contexts(config, effort)
    return [s for s in effort.chunk_shapes
            if s[1] in contexts and s[2] + s[3] < config.max_position_embeddings]


def pool_shape(config, effort: Effort) -> tuple[int, int]:
    """(blocks, tokens a block) of the static pool measure_steps serves its steps from: a block
    for each request of the largest batch at each context, for each prompt of the prefills
    and for each chunked step's prompt."""
    contexts = step_contexts(config, effort)
    chunks = chunk_shapes(config, effort)
    max_len = max(max(contexts), max(p for _, p in effort.prefill_shapes),
                  *(tokens + start for _, _, tokens, start in chunks)) + 1
    return (max(effort.fit_batches) * len(contexts)
            + sum(b for b, _ in effort.prefill_shapes) + len(chunks)), max_len


def steps_bytes(spec, config, dtype: str, layers: int, effort: Effort) -> int:
    """What measure_steps holds for its engine at `layers` layers: the weights and the pool
    (_engine's, twice the blocks' tokens)."""
    from allocator.serving.models import DTYPES, kv_bytes_per_token, with_layers

    blocks, max_len = pool_shape(config, effort)
    weights = dataclasses.replace(spec, layers=layers).params * DTYPES[dtype]
    return weights + 2 * blocks * max_len * kv_bytes_per_token(with_layers(config, layers),
                                                                dtype)


def own_depth(spec) -> int:
    """The depth that None in Effort.fit_layers asks for: the model's own, at least
    DEEP_ENOUGH."""
    return max(spec.layers, DEEP_ENOUGH)


def step_depths(effort: Effort, spec, config, dtype: str, free_bytes) -> tuple:
    """effort.fit_layers with None made own_depth(spec), or the deepest that `free_bytes`
    (None: unknown) hold beside the other depths' engines: every depth's engine lives until
    the steps are timed."""
    if None not in effort.fit_layers:
        return tuple(effort.fit_layers)
    shallow = [d for d in effort.fit_layers if d is not None]
    held = sum(steps_bytes(spec, config, dtype, d, effort) for d in shallow)
    deep = own_depth(spec)
    while (free_bytes is not None and deep > DEEP_ENOUGH
           and held + steps_bytes(spec, config, dtype, deep, effort) > free_bytes):
        deep -= 1
    return tuple(sorted({*shallow, deep}))


def measure_steps(torch, dev: dict, dtype: str, config, effort: Effort, seed: int,
                  anchors: tuple = ((), ())) -> dict:
    """Median seconds of the engine's own steps on `config` cut to each of effort.fit_layers
    layers: decode steps (Runner.decode, then the argmax of every row read back once, as the
    serving loop takes a step's tokens) at each batch of effort.fit_batches x context of
    effort.fit_contexts, every request that many tokens into its static block (re-decoding the
    same position, so every timed step has the same shape); and whole-prompt prefill steps
    (Runner.prefill) of effort.prefill_shapes (requests x prompt tokens); chunked-prefill
    steps of effort.chunk_shapes (Runner.forward of decodes and a chunk); the attention and
    CUDA graphs as the engine serves by default on the device. Shapes take turns
    (time_in_turns), and so do `anchors`, (calls, keys) of measure.linear_calls: a few matrix
    products timed among the steps, so that the products' table can be set to the speed the
    machine ran the steps at. {"decode": [...], "prefill": [...], "chunked": [...],
    "anchors": per_linear of the anchors}, each point its shape and times."""
    from allocator.serving.models import head_dim

    contexts = step_contexts(config, effort)
    most = max(effort.fit_batches)
    blocks, max_len = pool_shape(config, effort)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    allocs, calls, shapes = [], [], []
    try:
        for layers in effort.fit_layers:
            alloc, runner = _engine(torch, dev, dtype, config, layers, blocks, max_len, most,
                                    seed)
            allocs.append(alloc)
            vocab = config.vocab_size
            for k, context in enumerate(contexts):
                # requests of their own per context, their KV random (written as a swap-in
                # writes it: prefilling 32 prompts of 1,024 tokens through 24 layers took
                # minutes of a 2-core CPU's calibration, for numbers whose values no timing
                # depends on)
                ids = list(range(k * most, (k + 1) * most))
                kv = torch.randn((layers, 2, config.num_key_value_heads, context,
                                  head_dim(config)), generator=gen).to(getattr(torch, dtype))
                for i in ids:
                    alloc.reserve(i, context, 1, 0.0)
                    runner.kv.load(i, kv)
                for batch in effort.fit_batches:
                    tokens = rng.integers(3, vocab, batch).tolist()
                    calls.append(_decode_call(runner, tokens, context, base=k * most))
                    shapes.append(("decode", layers, batch, context + 1))
            base = len(contexts) * most          # the prefills' requests come after
            for batch, prompt in effort.prefill_shapes:
                calls.append(_prefill_call(torch, runner, alloc, rng, vocab, base, batch,
                                           prompt))
                base += batch
                shapes.append(("prefill", layers, batch, prompt))
            for decodes, context, tokens, start in chunk_shapes(config, effort):
                cached = torch.randn((layers, 2, config.num_key_value_heads, start,
                                      head_dim(config)), generator=gen).to(getattr(torch, dtype))
                calls.append(_chunked_call(runner, alloc, rng, vocab, cached, base, tokens,
                                           decodes, context, contexts.index(context) * most))
                base += 1
                shapes.append(("chunked", layers, decodes, (context + 1, tokens, start)))
        anchor_calls, anchor_keys = anchors
        # after the anchors, whose weights stream through the caches, the round's first step
        # SETTLE_STEPS times more, untimed: the next round's first steps then find the machine
        # as every other step does
        with torch.no_grad():
            times = time_in_turns(synchronizer(torch, dev["device"]),
                                  [*calls, *anchor_calls], effort.fit_warmup, effort.fit_reps,
                                  settle=calls[:1] * SETTLE_STEPS if anchor_calls else [])
    finally:
        for alloc in allocs:
            alloc.close()
    out = {"decode": [], "prefill": [], "chunked": [],
           "anchors": per_linear(anchor_keys, times[len(calls):])}
    for (kind, layers, batch, tokens), t in zip(shapes, map(_quartiles, times)):
        if kind == "chunked":
            context, chunk, start = tokens
            shape = {"context": context, "chunk": chunk, "start": start}
        else:
            shape = {"context" if kind == "decode" else "prompt": tokens}
        out[kind].append({"layers": layers, "batch": batch, **shape, **t})
    return out


def _decode_call(runner, tokens, context: int, base: int):
    """One decode step of requests base .. base + len(tokens) - 1, each at position `context`."""
    batch = len(tokens)
    ids = list(range(base, base + batch))
    positions = [context] * batch

    def step():
        runner.decode(tokens, positions, ids).argmax(-1).tolist()
    return step


def _prefill_call(torch, runner, alloc, rng, vocab: int, base: int, batch: int, prompt: int):
    """One whole-prompt prefill step of `batch` prompts of `prompt` tokens, into blocks
    reserved for them (requests base ..), rewritten every call."""
    ids = list(range(base, base + batch))
    for i in ids:
        alloc.reserve(i, prompt, 1, 0.0)
    prompts = [(i, torch.from_numpy(rng.integers(3, vocab, prompt))) for i in ids]

    def step():
        runner.prefill(prompts).argmax(-1).tolist()
    return step



def _chunked_call(runner, alloc, rng, vocab: int, cached, chunk_id: int, tokens: int,
                  decodes: int, context: int, base: int):
    """One chunked-prefill step: a chunk of `tokens` prompt tokens of request chunk_id after
    its first cached.shape[3] tokens (their KV `cached`), beside decode steps of requests
    base .. base + decodes - 1 at position `context`; the chunk is rewritten every call."""
    start = cached.shape[3]
    alloc.reserve(chunk_id, start + tokens, 1, 0.0)
    if start:
        runner.kv.load(chunk_id, cached)
    batch = [(base + b, [t], context) for b, t in enumerate(rng.integers(3, vocab, decodes))]
    batch.append((chunk_id, rng.integers(3, vocab, tokens).tolist(), start))

    def step():
        runner.forward(batch).argmax(-1).tolist()
    return step


# ------------------------------------------------------------------ the serving loop
LOOP_PROMPT, LOOP_OUTPUT = 16, 64       # each request of the loop's runs: prompt, tokens made


def measure_loop(torch, dev: dict, dtype: str, config, effort: Effort, seed: int,
                 decode: list) -> dict:
    """What the engine's serving loop adds to its steps (scheduling, the allocator, taking each
    step's tokens): the engine serves `batch` requests of LOOP_PROMPT prompt tokens making
    LOOP_OUTPUT tokens each, all at once, in static blocks, at the fewest of effort.fit_layers
    layers, for the smallest and the largest of effort.fit_batches; each run's seconds per step
    less the Runner's decode step of that batch at the shortest context (`decode`, from
    measure_steps) is the loop's, fitted as per step + batch x per request (>= 0). The first
    step, the prompts', is left out of both."""
    from allocator.serving.engine.serve import build_model, serve
    from allocator.serving.models import kv_bytes_per_token, with_layers

    layers = min(effort.fit_layers)
    short = min(q["context"] for q in decode)
    cut = with_layers(config, layers)
    model = build_model(cut, dtype, str(dev["device"]), seed)
    rng = np.random.default_rng(seed)
    points = []
    for batch in sorted({min(effort.fit_batches), max(effort.fit_batches)}):
        prompts = [torch.from_numpy(rng.integers(3, config.vocab_size, LOOP_PROMPT))
                   for _ in range(batch)]
        pool = 2 * batch * (LOOP_PROMPT + LOOP_OUTPUT) * kv_bytes_per_token(cut, dtype)
        runs = []
        for _ in range(2):                  # the first: compile, capture; the second timed
            runs.append(serve(model, prompts, [LOOP_OUTPUT] * batch, [0.0] * batch,
                              FIT_POLICY, pool_bytes=pool, max_batch=batch,
                              max_model_len=LOOP_PROMPT + LOOP_OUTPUT, seed=seed))
        run = runs[-1]
        first = min(float(r.first_token) for r in run["requests"])
        step = (run["seconds"] - first) / max(1, run["steps"] - 1)
        runner = next(q["step_s"] for q in decode
                      if (q["layers"], q["batch"], q["context"]) == (layers, batch, short))
        points.append({"batch": batch, "layers": layers, "steps": run["steps"],
                       "step_s": step, "runner_step_s": runner, "loop_s": step - runner})
    A = np.array([[1.0, p["batch"]] for p in points])
    y = np.array([p["loop_s"] for p in points])
    k, b = (float(v) for v in nnls(A, y)) if len(points) > 1 else (max(0.0, y[0]), 0.0)
    return {"step_s": k, "request_s": b, "points": points,
            "prompt": LOOP_PROMPT, "output": LOOP_OUTPUT}
