"""The fit behind a card's overheads: what the simulator's own step timer predicts of the
engine's measured steps without overheads (the floor), and the overhead terms fitted to what
remains, each >= 0.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from odma_cli.errors import BadArgument

from allocator.serving.cards.measure import set_tflops

# ----------------------------------------------------------------------------- the fit
def nnls(A, y) -> np.ndarray:
    """argmin ||A x - y|| over x >= 0, for a few columns: the least-squares solution on every
    subset of the columns (the others held at 0), the best of those that are nonnegative. The
    optimum is among them (on its own support it is the unconstrained least-squares solution),
    so this is exact for a matrix of full column rank; 2^n solves, meant for n <= 8 (scipy is
    not a dependency)."""
    A = np.asarray(A, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if A.ndim != 2 or y.shape != (A.shape[0],) or not 1 <= A.shape[1] <= 8:
        raise BadArgument(f"nnls needs an (m, n) matrix with 1 <= n <= 8 and m values, got "
                          f"{A.shape} and {y.shape}")
    if not (np.isfinite(A).all() and np.isfinite(y).all()):
        raise BadArgument("nnls: the matrix and the values must be finite")
    n = A.shape[1]
    best, best_cost = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = list(cols)
            x_sub = np.linalg.lstsq(A[:, sub], y, rcond=None)[0]
            if (x_sub < 0).any():
                continue
            x = np.zeros(n)
            x[sub] = x_sub
            r = A @ x - y
            cost = float(r @ r)
            if cost < best_cost * (1 - 1e-12):   # ties: the sparser solution found first
                best, best_cost = x, cost
    return best


def fit_relative(columns: dict, overhead, step, what: str) -> tuple[dict, np.ndarray]:
    """overhead ~ sum of each column times its coefficient (each >= 0), every point's error
    relative to its whole step time `step` (a 1 ms step and a 10 ms step count alike: a plain
    fit would give the short steps, where the overheads are most of the step, almost no say).
    ({name: coefficient}, each point's fitted overhead); BadArgument naming `what` for fewer
    points than columns + 1 or a step time that is not positive."""
    A = np.column_stack([np.asarray(c, dtype=np.float64) for c in columns.values()])
    o = np.asarray(overhead, dtype=np.float64)
    s = np.asarray(step, dtype=np.float64)
    if not (A.ndim == 2 and o.shape == s.shape == (A.shape[0],)
            and A.shape[0] > A.shape[1]):
        raise BadArgument(f"the {what} fit needs at least {A.shape[1] + 1} points, each with "
                          f"its shape, overhead and step time")
    if not (s > 0).all():
        raise BadArgument("step times must be positive")
    x = nnls(A / s[:, None], o / s)
    return dict(zip(columns, (float(v) for v in x))), A @ x


def fit_overheads(layers, batch, overhead, step) -> dict:
    """Fit a decode step's overhead ~ k + layers x a + layers x batch x c + batch x b (seconds,
    fit_relative). k is the step's own work outside the layers (embedding, rotary tables, final
    norm, LM head, the argmaxes, the step's tables): without it the fit would pass it off as
    per-layer and per-request cost, each then wrong for any other depth. Returns the
    coefficients in seconds and each point's fitted overhead."""
    L = np.asarray(layers, dtype=np.float64)
    B = np.asarray(batch, dtype=np.float64)
    got, fitted = fit_relative({"step_s": np.ones_like(L), "layer_s": L,
                                "layer_request_s": L * B, "request_s": B},
                               overhead, step, "overhead")
    return {**got, "fitted_s": fitted}


def fit_prefill_overheads(layers, prompts, overhead, step, chunks=None) -> dict:
    """Fit a prompt step's overhead ~ k + layers x a + layers x prompts x c (seconds,
    fit_relative): per step, per layer, per prompt per layer (the engine attends each whole
    prompt on its own); with `chunks` (each step's prompt pieces that start after cached
    tokens), + layers x chunks x d. The card's prefill_* keys (and chunk_layer_overhead_us),
    in microseconds."""
    L = np.asarray(layers, dtype=np.float64)
    P = np.asarray(prompts, dtype=np.float64)
    columns = {"prefill_step_overhead_us": np.ones_like(L), "prefill_layer_overhead_us": L,
               "prefill_layer_request_overhead_us": L * P}
    if chunks is not None:
        columns["chunk_layer_overhead_us"] = L * np.asarray(chunks, dtype=np.float64)
    got, _ = fit_relative(columns, overhead, step, "prefill overhead")
    return {k: v * 1e6 for k, v in got.items()}


def card_overheads(fit: dict) -> dict:
    """The card's four overheads (microseconds), as fitted: on --model itself at two depths,
    so each holds at the model's own depth."""
    return {"step_overhead_us": fit["step_s"] * 1e6,
            "layer_overhead_us": fit["layer_s"] * 1e6,
            "request_overhead_us": fit["request_s"] * 1e6,
            "layer_request_overhead_us": fit["layer_request_s"] * 1e6}


def timer(spec, layers: int, max_len: int, dtype: str, timing, tflops: float, matmul: dict,
          engine_gbps: dict | None, overheads: dict | None = None,
          layer_matmul: dict | None = None):
    """The simulator's StepTimer for `spec` cut to `layers` layers on a card of the figures
    just measured (`tflops` at the engine's `dtype`, the matmul table by rows and the layers'
    alone, the engine's run-read table), with `overheads` (card keys; none: all 0)."""
    from allocator.serving.cards.presets import Accelerator
    from allocator.serving.sim.replica import ServingSetup
    from allocator.serving.sim.steptime import StepTimer

    sim_dtype = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    over = {"layer_overhead_us": 0.0, "request_overhead_us": 0.0, **(overheads or {})}
    card = Accelerator("calibrating", timing.seq_gbps, 1e3, tflops, "ideal", 1.0, 0.0,
                       tflops_fp32=tflops, mfu=1.0, matmul_tflops=tuple(sorted(matmul.items())),
                       layer_matmul_tflops=tuple(sorted(layer_matmul.items())) if layer_matmul
                       else None,
                       engine_run_gbps=tuple(sorted(engine_gbps.items())) if engine_gbps
                       else None, **over)
    setup = ServingSetup(dataclasses.replace(spec, layers=layers), card, timing, dtype=sim_dtype,
                         max_model_len=max_len, mfu=1.0)
    return StepTimer(setup, "contiguous")


def predicted_floor(spec, layers: int, batch: int, context: int, dtype: str, timing,
                    tflops: float, matmul: dict, engine_gbps: dict | None = None) -> dict:
    """The simulator's own floor of one decode step (StepTimer.decode_terms: the products,
    then the attention, each at its roofline) of `spec` at `layers` layers, `batch` requests of
    `context` tokens each in contiguous blocks, with no overheads: what remains of a measured
    step is the overheads."""
    t = timer(spec, layers, context + 1, dtype, timing, tflops, matmul, engine_gbps)
    _decoding(t, batch, context)
    memory, compute, floor = t.decode_terms(batch, 0)
    return {"memory_s": memory, "compute_s": compute, "floor_s": floor}


def _decoding(t, batch: int, context: int) -> None:
    """Put `batch` requests of `context` tokens each into StepTimer t's running set."""
    from types import SimpleNamespace

    for _ in range(batch):
        r = SimpleNamespace()
        t.linearize(r, 0, context, None)
        t.add(r, +1)


def predicted_prefill(spec, layers: int, batch: int, prompt: int, dtype: str, timing,
                      tflops: float, matmul: dict, engine_gbps: dict | None,
                      overheads: dict, layer_matmul: dict | None = None) -> float:
    """The simulator's seconds of one whole-prompt prefill step of `batch` prompts of `prompt`
    tokens (StepTimer.prefill), with `overheads` (card keys; {}: none)."""
    t = timer(spec, layers, prompt + 1, dtype, timing, tflops, matmul, engine_gbps, overheads,
              layer_matmul)
    return t.prefill([(prompt, 0)] * batch)[0]


def predicted_chunked(spec, layers: int, batch: int, context: int, chunk: int, start: int,
                      dtype: str, timing, tflops: float, matmul: dict,
                      engine_gbps: dict | None, overheads: dict,
                      layer_matmul: dict | None = None) -> float:
    """The simulator's seconds of one chunked-prefill step (StepTimer.mixed_step): `batch`
    requests of `context` tokens decoding beside a chunk of `chunk` prompt tokens that starts
    at position `start`, with `overheads` (card keys; {}: none)."""
    t = timer(spec, layers, max(context, start + chunk) + 1, dtype, timing, tflops, matmul,
              engine_gbps, overheads, layer_matmul)
    _decoding(t, batch, context)
    return t.mixed_step(batch, 0, [(start, chunk)], collections.defaultdict(float))


def relative_residuals(points, measured: str, fitted: str) -> dict:
    """Each point's (measured - fitted) / measured, set as its "relative_residual"; the rms and
    the largest in size."""
    rel = []
    for q in points:
        q["residual_s"] = q[measured] - q[fitted]
        q["relative_residual"] = q["residual_s"] / q[measured]
        rel.append(q["relative_residual"])
    rel = np.array(rel)
    return {"rms_relative_residual": float(np.sqrt(np.mean(rel ** 2))) if rel.size else 0.0,
            "max_relative_residual": float(np.abs(rel).max()) if rel.size else 0.0}


def fit_steps(spec, dtype: str, steps: dict, timing, each: dict, prefill_rows: int,
              reads: dict, layers_apart: bool = True) -> dict:
    """The card's overheads fitted on the engine's steps (what the simulator's own memory and
    compute terms leave of each, KV reads at the engine's measured rate, the matrix products
    at the rate of the depth's own mix of them, from `each` product's rates by rows): decode
    steps' (per step, layer, request, request and layer) and the prompt steps' (prefill_*: per
    step, layer, prompt and layer) on whole-prompt and chunked steps together; each step's
    fitted time and residual. layers_apart=False prices a prompt step's products at the whole
    set's rate, as a card without layer_matmul_tflops does."""
    tables = {layers: set_tflops(each, dataclasses.replace(spec, layers=layers).decode_products)
              for layers in {q["layers"] for kind in ("decode", "prefill", "chunked")
                             for q in steps.get(kind, [])}}

    def rates(q):                     # (peak TFLOPS, the table by rows) at q's depth
        return tables[q["layers"]][prefill_rows], tables[q["layers"]]
    points = steps["decode"]
    for q in points:
        q.update(predicted_floor(spec, q["layers"], q["batch"], q["context"], dtype, timing,
                                 *rates(q), reads))
        q["overhead_s"] = q["step_s"] - q["floor_s"]
    got = fit_overheads([q["layers"] for q in points], [q["batch"] for q in points],
                        [q["overhead_s"] for q in points], [q["step_s"] for q in points])
    for q, f in zip(points, got.pop("fitted_s")):
        q["fitted_s"] = q["floor_s"] + float(f)
    got.update(relative_residuals(points, "step_s", "fitted_s"))
    over = card_overheads(got)
    # steps with prompt tokens in them, whole prompts alone and chunks beside decodes, share
    # the prefill_* terms (the simulator runs a chunked step as a prefill), and a chunk after
    # cached tokens pays chunk_layer_overhead_us besides; a chunked step's decodes pay the
    # decode fit's per-request terms, known by now
    prompts, chunked = steps["prefill"], steps.get("chunked", [])

    # prompt tokens go through the layers at the layers' own rate, each sequence's last
    # through the LM head too
    stack = set_tflops(each, spec.stack_products) if layers_apart else None

    def prefill_s(q, overheads):
        return predicted_prefill(spec, q["layers"], q["batch"], q["prompt"], dtype, timing,
                                 *rates(q), reads, overheads, stack)

    def chunked_s(q, overheads):
        return predicted_chunked(spec, q["layers"], q["batch"], q["context"], q["chunk"],
                                 q["start"], dtype, timing, *rates(q), reads, overheads, stack)
    for q in prompts:
        q["floor_s"] = prefill_s(q, {})
    for q in chunked:
        q["floor_s"] = chunked_s(q, {})
    decodes = [q["batch"] * (got["request_s"] + q["layers"] * got["layer_request_s"])
               for q in chunked]
    after_cache = [int(q["start"] > 0) for q in chunked]
    with_prompts = prompts + chunked
    over.update(fit_prefill_overheads(
        [q["layers"] for q in with_prompts], [q["batch"] for q in prompts] + [1] * len(chunked),
        [q["step_s"] - q["floor_s"] for q in prompts]
        + [q["step_s"] - q["floor_s"] - d for q, d in zip(chunked, decodes)],
        [q["step_s"] for q in with_prompts],
        # no chunk after cached tokens: no such column (all zeros, nothing to fit it on)
        [0] * len(prompts) + after_cache if any(after_cache) else None))
    for q in prompts:
        q["fitted_s"] = prefill_s(q, over)
    for q in chunked:
        q["fitted_s"] = chunked_s(q, over)
    got["prefill"] = relative_residuals(prompts, "step_s", "fitted_s")
    got["chunked"] = relative_residuals(chunked, "step_s", "fitted_s")
    return {"fit": got, "card": over}
