"""`odma-hw calibrate`: measure a torch device for a card file, so that `odma-hw simulate
--device CARD` predicts `odma-hw engine` on that device.

What it measures, in this order (each phase prints one progress line on stderr):

1. bandwidth: reads of random contiguous runs of S bytes (64 B .. 4 MiB), one long read and a
   streaming copy of the device's memory. By default (--memory auto) odma-hw's native probe
   measures them on the native device behind the torch device (torch:cpu -> host,
   torch:cuda:N -> cuda:N, torch:mlu:N -> mlu:N; measure_native_bandwidth), as the engine's
   own attention kernels read as those kernels do; where there is no native backend, or it is
   absent or fails here, torch's gather (index_select) measures them (measure_bandwidth,
   allocator/serving/sim/live.py's measure_run_bandwidth), and one line says so. --memory native
   or torch picks one. Written beside the card as an `odma-hw probe --json` document
   (CARD.probe.json, its "memory_source" naming what measured it); the card's timing is
   `probe:CARD.probe.json`, its bandwidth_gbps the sequential figure, and its source (and the
   output) say which measured them.
2. matmul throughput: F.linear over every shape of --model's matrix products (q, k, v, o, the
   gated MLP's three, the LM head) at the engine's dtype, weights cycled through enough copies
   to come from memory, not a cache; at each row count, all the products' FLOPs over the time
   they take together, each shape as often as a step runs it: at a prefill shape
   (--prefill-tokens rows) and at decode shapes (1 .. 64 rows). The prefill shape's throughput
   is the card's peak at that dtype with mfu = 1 (what the engine's matrix products reach);
   every row count's goes into the card's matmul_tflops table, by which the simulator costs
   each step's compute. The layers' shapes alone are timed at more rows besides (512 .. 2,048:
   a prompt's tokens; the LM head takes only each sequence's last) and make the card's
   layer_matmul_tflops. Every (shape, rows) is timed once a round, in turns (measure.py,
   linear_seconds).
   On CUDA each timed batch of products is a CUDA graph replay (measure.py,
   graphed), as the engine's decode steps are: eagerly a small product's launch outlasts it.
3. the engine's KV reads (engine_steps.py, measure_engine_reads): its attention
   kernel reading --model's KV in runs of a few page sizes and whole contexts, the rate being
   the bytes a longer context adds over the time it adds: the card's engine_run_gbps, which
   simulate reads a step's KV at.
4. the engine's steps (measure_steps): decode steps (Runner.decode, with the engine's decode
   graphs where it has them) of --model cut to 2 layers and at its own depth (step_depths)
   over batch x context, and whole-prompt prefill steps; the simulator's own memory and
   compute terms at each shape (the products at the depth's own mix, set_tflops) are
   taken away and the rest fitted (fit.py, nnls relative to each step): per step,
   per layer, per request, per request per layer for decodes; per step, per layer, per prompt
   per layer for prefills (the card's prefill_* keys).
5. the serving loop (measure_loop): the engine serving a few requests end to end; what its
   steps take beyond the Runner's is added to the per-step and per-request overheads.

Not measured: link_gbps and link_latency_us (one device has no peer here); the card carries
placeholders and says so.

There is no compute(): a sweep would run calibrations side by side on shared cores, and every
figure would measure the neighbours.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time

from odma_cli.errors import BadArgument, DeviceError, OdmaError, error_line

from allocator.serving.cards import engine_steps, fit, summary
from allocator.serving.cards.measure import (BUSY_OTHER_SHARE, FULL, MEMORY_MODES, QUICK,
                                             TORCH_SOURCE, Effort, OtherLoad, disturbed,
                                             engine_dtype, linear_calls, matmul_bytes,
                                             matmul_tflops, measure_memory, memory_plan,
                                             need_torch, open_torch_device, set_tflops,
                                             steps_speed)
from allocator.serving.cards.write import (byte_text, card_contents, card_json, card_paths,
                                           card_text, check_card, probe_document)

SCHEMA = "odma-hw.calibrate/1"
MAX_PREFILL_TOKENS = 65536             # a longer prompt is a chunked prefill's business


# ----------------------------------------------------------------------------- the command
def check(args) -> dict:
    """Every refusal before anything is measured or written: (paths, device, dtype, model
    shape)."""
    from allocator.serving.cards.presets import model_spec
    from allocator.serving.models import DTYPES, check_memory, load_config

    need_torch()                # before the model's config, which transformers reads with torch
    if args.name is not None and (not args.name.strip() or
                                  any(ord(c) < 0x20 or ord(c) == 0x7F for c in args.name)):
        raise BadArgument(f"--name must be a non-empty line of text, got {args.name!r}")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise BadArgument(f"unknown --dtype {args.dtype!r}: expected one of {', '.join(DTYPES)}")
    if not 1 <= args.prefill_tokens <= MAX_PREFILL_TOKENS:
        raise BadArgument(f"--prefill-tokens must be in [1, {MAX_PREFILL_TOKENS}], got "
                          f"{args.prefill_tokens}")
    memory = getattr(args, "memory", "auto")
    if memory not in MEMORY_MODES:
        raise BadArgument(f"unknown --memory {memory!r}: expected one of "
                          f"{', '.join(MEMORY_MODES)}")
    card, probe = card_paths(args.out)
    config, _ = load_config(args.model)  # a model the engine runs
    spec = model_spec(args.model)
    dev = open_torch_device(args.device)
    dtype = engine_dtype(dev["device"].type, args.dtype)
    native = memory_plan(dev["spec"], memory)     # --memory native needs a native backend...
    if memory == "native":
        from odma_hw import devices

        with devices.open(native):                 # ... that is here (auto falls back instead)
            pass
    # the products' measurement (all their weight copies at once: they are timed in turns),
    # before any of its weights exists
    rows = (args.prefill_tokens, *FULL.decode_rows)
    check_memory({f"{args.model}'s matmul measurement":
                  max(matmul_bytes(spec.decode_products, rows, DTYPES[dtype]),
                      matmul_bytes(spec.stack_products, FULL.prompt_rows, DTYPES[dtype]))},
                 dev["free_bytes"], dev["spec"])
    return {"card": card, "probe": probe, "device": dev, "dtype": dtype, "config": config,
            "spec": spec, "products": spec.decode_products, "layers": spec.layers,
            "memory": memory}


def calibrate(args, progress=None) -> dict:
    """Measure, fit, write the probe file and the card; the result object (SCHEMA)."""
    from allocator.serving.cards.presets import card_is_json
    from allocator.trace import write_file

    started = time.perf_counter()
    p = check(args)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    torch = need_torch()
    show = progress or (lambda text: None)
    effort = _effort(args, p, show)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    m = _measure(args, p, effort, torch, show)
    doc = probe_document(p["device"], m["bw"], effort.run_sizes)
    measured = doc["devices"][0].get("name")      # the device the card's probe file measured
    values, comments, header = card_contents(args, p, effort, m, when, measured,
                                             torch.__version__)
    text = card_json(values) if card_is_json(p["card"]) else card_text(values, comments, header)
    check_card(p["card"], text)
    # the probe file first: a card never names a file that is not there yet
    _write_probe(p["probe"], doc)
    write_file(p["card"], lambda f: f.write(text), "card", replace_links=True)
    return _result(args, p, effort, m, values, load_before, started)


def _effort(args, p: dict, show) -> Effort:
    """QUICK or FULL, the engine's steps timed at the depths that the memory free holds (a
    quarter kept for activations and graphs)."""
    from allocator.serving.models import DTYPES

    effort = QUICK if args.quick else FULL
    free = p["device"]["free_bytes"]
    anchors = matmul_bytes(p["products"], anchor_rows(args, effort), DTYPES[p["dtype"]])
    depths = engine_steps.step_depths(effort, p["spec"], p["config"], p["dtype"],
                                      None if free is None else free * 3 // 4 - anchors)
    own = engine_steps.own_depth(p["spec"])
    if None in effort.fit_layers and max(depths) < own:
        show(f"calibrate {p['device']['spec']}: the engine's steps at {max(depths)} layers, "
             f"not {own}: {own} layers' weights and pool would not fit in "
             f"{free / 1e9:.1f} GB free")
    return dataclasses.replace(effort, fit_layers=depths)


def _measure(args, p: dict, effort, torch, show) -> dict:
    """The five phases (module docstring), each with its progress line, and the overheads
    fitted on them: what the card and the result are made of. Where a phase after the
    memory's fails, the memory's figures are kept (_keep_memory) and the error is one line."""
    dev = p["device"]
    native = memory_plan(dev["spec"], p["memory"])
    show(f"calibrate {dev['spec']}: bandwidth of random runs of "
         f"{byte_text(effort.run_sizes[0])} .. {byte_text(effort.run_sizes[-1])}, sequential "
         f"read, copy ({'the native probe of ' + native if native else TORCH_SOURCE})")
    other = {}
    load = OtherLoad()
    bw = measure_memory(dev, p["memory"], effort, args.seed, show)
    other["bandwidth"] = load.share()
    try:
        return _measure_engine(args, p, effort, torch, show, bw, other)
    except Exception as exc:
        # the memory's figures, minutes of a device's time (on an H200 the engine's kernels
        # then failed, and calibrate printed a traceback and kept nothing), outlive the failure
        kept = _keep_memory(p, effort, bw)
        if isinstance(exc, OdmaError):
            show(f"calibrate {dev['spec']}: {kept}")
            raise
        raise DeviceError(f"calibrate failed after measuring the memory ({error_line(exc)}): "
                          f"{kept}") from exc


def _keep_memory(p: dict, effort, bw: dict) -> str:
    """Write the memory's figures to a probe file of their own (no card names it, so the card
    and its probe file stay as they were); what was kept where, for the error line."""
    path = p["probe"].removesuffix(".probe.json") + ".partial.probe.json"
    _write_probe(path, probe_document(p["device"], bw, effort.run_sizes))
    return f"the memory's figures are kept in {path}; no card written"


def _write_probe(path: str, doc: dict) -> None:
    """A probe document written whole, then renamed into place (a failure leaves the old file
    as it was); a link at the path is replaced, not followed, so a card's probe:NAME (relative
    to its folder) names the file written beside it."""
    from allocator.trace import write_file
    from odma_cli import jsonout

    text = jsonout.dumps(doc, indent=1) + "\n"
    write_file(path, lambda f: f.write(text), "probe file", replace_links=True)


def _measure_engine(args, p: dict, effort, torch, show, bw: dict, other: dict) -> dict:
    """The phases after the memory's (matmul, the engine's reads, steps and loop) and the fit."""
    from allocator.serving.sim.timing import MeasuredTiming

    dev, dtype = p["device"], p["dtype"]
    timing = MeasuredTiming(f"probe:{dev['spec']}", bw["runs_gbps"], bw["seq_gbps"],
                            bw["copy_gbps"])
    each, other["matmul"] = _measure_matmul(args, p, effort, torch, show)

    batch, contexts = engine_steps.read_shape(effort, dev["device"])
    show(f"calibrate {dev['spec']}: the engine's attention reading {args.model}'s KV in runs of "
         f"{', '.join(map(str, effort.read_run_tokens))} tokens and whole contexts, "
         f"{batch} requests at {' and '.join(map(str, contexts))} tokens")
    load = OtherLoad()
    reads = engine_steps.measure_engine_reads(torch, dev, dtype, p["config"], effort, args.seed)
    other["engine reads"] = load.share()
    if len(reads["gbps"]) < 2:
        # a table needs two sizes to interpolate between: without one the memory's rates serve
        show(f"calibrate {dev['spec']}: warning: the engine's reads gave {len(reads['gbps'])} "
             f"rate(s), too few for a table: the card reads KV at the memory's rates")
        reads["gbps"] = {}

    show(f"calibrate {dev['spec']}: the engine's steps on {args.model} at "
         f"{' and '.join(map(str, effort.fit_layers))} layers: decode batch "
         f"{', '.join(map(str, effort.fit_batches))} x context "
         f"{', '.join(map(str, effort.fit_contexts))}, prefill "
         f"{', '.join(f'{b} x {n}' for b, n in effort.prefill_shapes)}, chunked "
         f"{', '.join(f'{b} x {c} + {n} at {s}' for b, c, n, s in effort.chunk_shapes)}, "
         f"{effort.fit_reps} "
         f"steps each, among them the products at "
         f"{', '.join(map(str, anchor_rows(args, effort)))} rows")
    load = OtherLoad()
    anchors = linear_calls(torch, dev["device"], getattr(torch, dtype),
                           anchor_rows(args, effort), p["products"], effort, args.seed)
    steps = engine_steps.measure_steps(torch, dev, dtype, p["config"], effort, args.seed,
                                       anchors)
    del anchors                   # their weights
    other["steps"] = load.share()
    # the products' table at the speed the machine ran the steps at
    speed = steps_speed(each[dtype], steps["anchors"])
    each = {d: {shape: {r: v * speed for r, v in t.items()} for shape, t in e.items()}
            for d, e in each.items()}
    mm = {d: set_tflops(e, p["products"]) for d, e in each.items()}
    mm_stack = set_tflops(each[dtype], p["spec"].stack_products)
    peak = mm[dtype][args.prefill_tokens]
    tflops_bf16 = mm["bfloat16"][args.prefill_tokens]
    fitted = fit.fit_steps(p["spec"], dtype, steps, timing, each[dtype], args.prefill_tokens,
                           reads["gbps"])
    fitting, over = fitted["fit"], fitted["card"]
    show(f"calibrate {dev['spec']}: the engine's serving loop, {engine_steps.LOOP_OUTPUT} "
         f"tokens of batch {min(effort.fit_batches)} and {max(effort.fit_batches)}")
    load = OtherLoad()
    loop = engine_steps.measure_loop(torch, dev, dtype, p["config"], effort, args.seed,
                                     steps["decode"])
    other["loop"] = load.share()
    # the card's step costs are the Runner's steps and what the loop adds to each
    over["step_overhead_us"] += loop["step_s"] * 1e6
    over["request_overhead_us"] += loop["request_s"] * 1e6
    points = steps["decode"]
    busy, loaded = _disturbances(dev, points, other, show)
    return {"bw": bw, "timing": timing, "mm": mm, "mm_stack": mm_stack, "each": each,
            "peak": peak, "speed": speed,
            "tflops_bf16": tflops_bf16, "reads": reads, "steps": steps, "fitting": fitting,
            "over": over, "loop": loop, "other": other, "points": points, "busy": busy,
            "loaded": loaded}


def anchor_rows(args, effort) -> tuple:
    """The row counts at which the products are timed again among the engine's steps: the
    table's fewest and most decode rows and the prefill's."""
    return tuple(sorted({effort.decode_rows[0], effort.decode_rows[-1], args.prefill_tokens}))


def _measure_matmul(args, p: dict, effort, torch, show) -> tuple[dict, float | None]:
    """Phase 2: matmul throughput at the engine's dtype (and bfloat16, which every card
    needs) by rows, over --model's products: ({dtype: {(k, n): {rows: TFLOPS}}}, the share of
    the CPUs other processes took meanwhile). The tables of a set of products (set_tflops)
    are made once the products' speed among the engine's steps has scaled these."""
    dev, dtype = p["device"], p["dtype"]
    products = p["products"]
    rows = (args.prefill_tokens,) + tuple(effort.decode_rows)
    show(f"calibrate {dev['spec']}: matmul {dtype}, the {len(products)} shapes of "
         f"{args.model}'s layers and LM head, at {args.prefill_tokens} rows (prefill) and "
         f"{', '.join(map(str, effort.decode_rows))} (decode)")
    load = OtherLoad()
    each = {dtype: matmul_tflops(torch, dev["device"], getattr(torch, dtype), rows, products,
                                 effort, args.seed)[1]}
    if effort.prompt_rows:
        show(f"calibrate {dev['spec']}: matmul {dtype}, the layers' shapes at "
             f"{', '.join(map(str, effort.prompt_rows))} rows (prompts)")
        more = matmul_tflops(torch, dev["device"], getattr(torch, dtype), effort.prompt_rows,
                             p["spec"].stack_products, effort, args.seed)[1]
        for shape, by_rows in more.items():
            each[dtype][shape].update(by_rows)
    if dtype != "bfloat16":
        # a card needs its bf16 peak whatever the engine runs
        show(f"calibrate {dev['spec']}: matmul bfloat16 at {args.prefill_tokens} rows")
        each["bfloat16"] = matmul_tflops(torch, dev["device"], torch.bfloat16,
                                         (args.prefill_tokens,), products, effort, args.seed)[1]
    return each, load.share()


def _disturbances(dev: dict, points: list, other: dict, show) -> tuple[list, dict]:
    """(the decode shapes whose steps varied as on a busy machine, the phases during which
    other processes took more than BUSY_OTHER_SHARE of the CPUs), each warned of."""
    busy = [[q["layers"], q["batch"], q["context"]] for q in disturbed(points)]
    if busy:
        show(f"calibrate {dev['spec']}: warning: the steps of {len(busy)} of {len(points)} "
             f"shapes varied as on a busy machine: calibrate again when nothing else runs")
    loaded = {k: v for k, v in other.items() if v is not None and v > BUSY_OTHER_SHARE}
    if loaded:
        show(f"calibrate {dev['spec']}: warning: other processes took "
             + ", ".join(f"{v:.0%} of the CPUs during {k}" for k, v in loaded.items())
             + ": calibrate again when nothing else runs")
    return busy, loaded


def _result(args, p: dict, effort, m: dict, values: dict, load_before, started: float) -> dict:
    """The result object (SCHEMA) of a calibration whose card holds `values`."""
    dev, dtype, products = p["device"], p["dtype"], p["products"]
    bw, mm, each, reads, steps = m["bw"], m["mm"], m["each"], m["reads"], m["steps"]
    fitting, over, loop, points = m["fitting"], m["over"], m["loop"], m["points"]
    busy, loaded, other = m["busy"], m["loaded"], m["other"]
    return {
        "schema": SCHEMA, "card": p["card"], "probe": p["probe"], "device": dev["spec"],
        "device_name": dev["name"], "dtype": dtype, "quick": bool(args.quick),
        "memory": p["memory"],
        "model": args.model, "card_values": values,
        "bandwidth": {"seq_gbps": float(bw["seq_gbps"]), "copy_gbps": float(bw["copy_gbps"]),
                      "runs_gbps": {str(s): float(v) for s, v in bw["runs_gbps"].items()},
                      "runs_in_order_gbps": {str(s): float(v)
                                             for s, v in bw["runs_in_order_gbps"].items()},
                      "buffer_bytes": int(bw["buffer_bytes"]), "method": bw["method"],
                      "memory": bw["memory"], "source": bw["source"],
                      "native_device": bw["native_device"], "fallback": bw["fallback"]},
        "matmul": {"products": [{"k": k, "n": n, "count": c} for (k, n), c in products.items()],
                   "prefill_rows": args.prefill_tokens,
                   "steps_speed": m["speed"], "steps_speed_rows": list(anchor_rows(args, effort)),
                   "tflops": {d: {str(r): v for r, v in t.items()} for d, t in mm.items()},
                   "layers_tflops": {str(r): v for r, v in m["mm_stack"].items()},
                   "tflops_by_product": {d: {f"{k}x{n}": {str(r): v for r, v in t.items()}
                                             for (k, n), t in e.items()}
                                         for d, e in each.items()}},
        "engine_reads": dict(reads, gbps={str(b): g for b, g in reads["gbps"].items()}),
        "overheads": {"step_us": fitting["step_s"] * 1e6, "layer_us": fitting["layer_s"] * 1e6,
                      "request_us": fitting["request_s"] * 1e6,
                      "layer_request_us": fitting["layer_request_s"] * 1e6,
                      "model_layers": p["layers"], "card": over,
                      "rms_relative_residual": fitting["rms_relative_residual"],
                      "max_relative_residual": fitting["max_relative_residual"],
                      "fit_model": args.model, "fit_layers": list(effort.fit_layers),
                      "disturbed": busy, "points": points,
                      "prefill": dict(fitting["prefill"], points=steps["prefill"]),
                      "chunked": dict(fitting["chunked"], points=steps["chunked"]),
                      "loop": loop},
        "other_cpu_share": other, "busy_phases": sorted(loaded),
        "load_average_before": load_before,
        "seconds": time.perf_counter() - started,
    }



def _cmd(args) -> int:
    from odma_cli import jsonout

    def progress(text):
        if not args.quiet:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    result = calibrate(args, progress)
    print(jsonout.dumps(result, indent=1) if args.json else summary.format_summary(result))
    return 0


def register(subparsers) -> None:
    from odma_cli import argtypes

    from allocator.serving.models import DTYPES, shipped_configs

    p = subparsers.add_parser(
        "calibrate", help="measure a torch device and write a card file for simulate --card",
        description="Measure on a torch device what a card file needs, so that `odma-hw "
                    "simulate --card CARD` predicts `odma-hw engine` there: the bandwidth of "
                    "random contiguous runs by size, sequential and copy bandwidth (by the "
                    "native probe of the same memory where odma-hw has one, else torch's gather: "
                    "--memory; written beside the card as an `odma-hw probe --json` file, "
                    "CARD.probe.json); matmul "
                    "throughput at the engine's dtype over --model's layer and LM-head shapes, at "
                    "a prefill row count and at decode row counts; the engine's own KV read "
                    "rate by run length; and the per-step, per-layer, "
                    "per-request and per-request-per-layer overheads of the engine's decode "
                    "and prefill steps and its serving loop, fitted on --model cut to "
                    "2 layers and at its own depth. link_gbps and link_latency_us are not "
                    "measured: the card carries placeholders and says so. 7 to 10 minutes "
                    "for qwen2.5-0.5b on a quiet 2-core CPU, most of it its steps at 24 "
                    "layers and the LM head's products (--quick --model tiny-llama: 15 s); "
                    "other processes running meanwhile make every figure wrong, and a warning "
                    "says so.")
    p.add_argument("--device", default="torch:cpu", metavar="torch:DEV",
                   help="the torch device the engine runs on (default torch:cpu; torch:cuda:0, "
                        "torch:mlu:0)")
    p.add_argument("--out", type=argtypes.nonempty, required=True, metavar="CARD.toml",
                   help="the card to write, TOML (CARD.toml) or JSON (CARD.json); its probe "
                        "file goes beside it (CARD.probe.json), and a link at either is "
                        "replaced, not followed. Checked before anything is measured")
    p.add_argument("--name", default=None,
                   help="the card's name (default calibrated-<device>, e.g. "
                        "calibrated-torch-cpu)")
    p.add_argument("--model", default="qwen2.5-0.5b", metavar="CONFIG",
                   help=f"the model the card is for: its matrix products (every layer's "
                        f"and the LM head's shapes) are timed, its KV read by the engine's "
                        f"attention, and the engine's steps run on it cut to 2 layers and at "
                        f"its own depth. "
                        f"A config.json, a directory "
                        f"holding one, or one of {', '.join(shipped_configs())} (default "
                        f"qwen2.5-0.5b)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="the engine's dtype (default: float32 on a CPU, bfloat16 on a GPU or "
                        "MLU); bfloat16 throughput is measured in any case")
    p.add_argument("--prefill-tokens", type=argtypes.positive_int, default=256, metavar="N",
                   help="rows of the prefill-shape matmul (default 256)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions, shapes and run sizes, and a quarter of the working "
                        "set (for tests)")
    p.add_argument("--memory", default="auto", choices=list(MEMORY_MODES),
                   help="what measures the card's memory figures (run reads, sequential read, "
                        "copy): native, odma-hw's native probe of the same memory (host for "
                        "torch:cpu, cuda:N for torch:cuda:N, mlu:N for torch:mlu:N), whose "
                        "kernels read as the engine's own attention kernels do; torch, torch's "
                        "gather (index_select), sum and copy_; auto (default), native where "
                        "there is a native backend, torch's gather, said in one line, where it "
                        "is absent or fails")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seeds the random runs, weights and tokens (default 0)")
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({SCHEMA})")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
