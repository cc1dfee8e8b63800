"""The command-line pieces that `odma-hw simulate` (sim/cli.py), `odma-hw advise` (sim/advise.py)
and `odma-hw engine` (engine/cli.py) share, and simulate() (sim/simulation.py) takes: the card
options (--card and its older spelling --device: add_card_argument, cards_of), option types and
their checks (policies, dtypes, --goodput, --swap-space, --demand-bound), the argument groups
the commands add (length caps, goodput, scheduling), the length caps themselves (cap_lengths),
a card's emulator settings (card_emu), and the words and summary table their outputs print.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from odma_cli import argtypes
from odma_cli.errors import BadArgument

from allocator.policies import POLICIES, policy
from allocator.serving.cards.datafile import BANDWIDTH_GBPS, CAPACITY_GB
from allocator.serving.cards.presets import (DEFAULT_CARD, DTYPE_SPELLINGS, accelerator,
                                             card_names)
from allocator.serving.cards.profiles import profile_names
from allocator.serving.core.checks import PREEMPTION
from allocator.serving.core.metrics import ITL_TOKEN_TIMES, SLO_METRICS, parse_goodput
from allocator.serving.sim.replica import MAX_TIER_BYTES
from allocator.serving.sim.timing import EmuSettings
from allocator.trace import RequestTrace


def add_card_argument(p, what: str) -> None:
    """--card CARD[,CARD...], the name the engine gives its card too, and --device, its older
    spelling in simulate and advise (cards_of reads them). `what`: what several cards give."""
    p.add_argument("--card", default=None, metavar="CARD[,CARD...]",
                   help=f"the card: a preset ({', '.join(card_names())}; default "
                        f"{DEFAULT_CARD}, the ODMA paper's LPDDR device; a100-80gb is the HBM "
                        f"contrast) or a card file (TOML, or JSON if named *.json: name, "
                        f"bandwidth_gbps, capacity_gb, tflops_bf16, timing (emu:PRESET, "
                        f"probe:FILE or ideal), link_gbps, link_latency_us; see --list and "
                        f"docs/calibration.md); several, comma-separated, {what}")
    p.add_argument("--device", default=None, metavar="CARD[,CARD...]",
                   help="the older spelling of --card, kept for older command lines")


def parse_cards(text: str, option: str = "--card") -> list[str]:
    """CARD[,CARD...]: each a preset or a card file; BadArgument for an unknown one. A card
    file whose name has a comma in it is that one file, not a list."""
    if "," in text and os.path.isfile(text):
        cards = [text]
    else:
        cards = list(dict.fromkeys(argtypes.comma_items(text) or []))
    if not cards:
        raise BadArgument(f"{option}: expected CARD[,CARD...], not {text!r}")
    for card in cards:
        accelerator(card, option)
    return cards


def cards_of(args) -> list[str]:
    """The cards --card (or its older spelling --device) names, DEFAULT_CARD where neither is
    given; both given, or --device naming the engine's torch device, is refused."""
    card, device = getattr(args, "card", None), getattr(args, "device", None)
    if card is not None and device is not None:
        raise BadArgument("--device is the older spelling of --card: give one of them")
    if device is not None and device.startswith("torch:"):
        raise BadArgument(f"--device {device} is where the engine runs a model; this command "
                          f"runs none: name the card with --card")
    if card is not None:
        return parse_cards(card, "--card")
    return parse_cards(device, "--device") if device is not None else [DEFAULT_CARD]


def card_emu(dev, channels=None, **settings) -> EmuSettings:
    """The emulator settings of a card: its emu preset and channels (channels overrides them);
    a card timed otherwise keeps EmuSettings' preset, used only when --timing names emu."""
    kind, _, preset = dev.timing.partition(":")
    if kind == "emu":
        settings["preset"] = preset
    return EmuSettings(channels=channels or dev.emu_channels, **settings)


def demand_bound(text: str):
    """--demand-bound: a finite number >= 0, or none."""
    return None if text.strip().lower() == "none" else argtypes.nonnegative_float(text)


def swap_space(text: str) -> float:
    """--swap-space: GB >= 0 whose bytes a byte count holds (the simulator and the engine both
    take int(GB x 1e9): 1e300 GB would overflow it only once a model is built)."""
    gb = argtypes.nonnegative_float(text)
    if gb * 1e9 > MAX_TIER_BYTES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIER_BYTES / 1e9:.3g} GB, not "
                                         f"{text!r}")
    return gb


def parse_policies(text: str, extra: tuple = ()) -> list[str]:
    """A comma-separated list of policies (and of the `extra` names a command adds)."""
    known = [*POLICIES, *extra]
    names = argtypes.comma_items(text) or []
    bad = [p for p in names if p not in known]
    if not names or bad:
        raise BadArgument(f"unknown policy {', '.join(bad) or repr(text)}: expected a comma-"
                          f"separated list of {', '.join(known)}")
    return list(dict.fromkeys(names))


# units of the options simulate and engine share, where their names do not say (a sweep's axes)
SERVING_OPTION_UNITS = {"rate": "req/s", "page-tokens": "tokens", "max-model-len": "tokens",
                        "max-num-batched-tokens": "tokens", "prompt-cap": "tokens",
                        "output-cap": "tokens", "concurrency": "requests"}
def add_dtype_argument(p, names, what: str) -> None:
    """--dtype among `names` (the command's own spellings, either of each accepted), default
    auto (cards.presets.auto_dtype): simulate's, advise's and the engine's."""
    spellings = [s for n in names for s in dict.fromkeys((n, DTYPE_SPELLINGS.get(n, n)))]
    p.add_argument("--dtype", default="auto", type=dtype_argument(names),
                   metavar="{" + ",".join(["auto", *spellings]) + "}",
                   help=f"{what} (default auto: the type the card was calibrated at, which "
                        f"calibrate writes into it, else float32 on a CPU, bf16 on a GPU or MLU)")


def dtype_argument(names):
    """The type of a --dtype among `names` (a command's own spellings): either spelling of
    one (fp32 or float32, bf16 or bfloat16) -> the command's; or auto (cards.presets.auto_dtype
    decides, per card)."""
    names = ["auto", *names]

    def parse(text: str) -> str:
        t = text.strip().lower()
        for name in (t, DTYPE_SPELLINGS.get(t)):
            if name in names:
                return name
        both = ", ".join(f"{n} ({DTYPE_SPELLINGS[n]})" if DTYPE_SPELLINGS.get(n, n) != n else n
                         for n in names)
        raise argparse.ArgumentTypeError(f"expected one of {both}, not {text!r}")
    return parse


def goodput_item(text: str) -> str:
    """One --goodput KEY:MS item, checked as it is parsed (in one line)."""
    try:
        parse_goodput([text])
    except BadArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--goodput ")) from None
    return text


def goodput_slo(items) -> dict | None:
    """--goodput's items -> {ttft|tpot|e2el: seconds} (None when not given)."""
    return parse_goodput(items) if items else None


def cap_lengths(trace, prompt_cap: int | None = None, output_cap: int | None = None):
    """`trace` with every prompt cut to at most prompt_cap tokens and every output to at most
    output_cap (None: not cut), as --prompt-cap / --output-cap cut them in simulate and the
    engine alike; a new trace (the one given, perhaps a cached one, is left as it was)."""
    if not (prompt_cap or output_cap):
        return trace
    prompt = trace.prompt if not prompt_cap else np.minimum(trace.prompt, prompt_cap)
    gen = trace.generated if not output_cap else np.minimum(trace.generated, output_cap)
    prefix = (None if trace.prefix_tokens is None
              else np.minimum(trace.prefix_tokens, prompt))
    return RequestTrace(prompt, gen, trace.arrival, trace.name, prefix_id=trace.prefix_id,
                        prefix_tokens=prefix, offer_id=trace.offer_id)


def load_text(rate, concurrency, arrivals_given: bool, time_scale: float = 1.0) -> str:
    """What the load of a run is, in words: all at once, the trace's arrivals, R req/s, a
    closed loop of C (at R req/s where given)."""
    if concurrency is not None:
        return f"closed loop {concurrency}" + (f" at {rate:g} req/s" if rate else "")
    if rate:
        return f"{rate:g} req/s"
    if not arrivals_given:
        return "all at once"
    return "trace arrivals" + (f" x{time_scale:g}" if time_scale != 1.0 else "")


def summary_table(results: list[dict], labels: list[str]) -> list[str]:
    """The lines of vllm bench serve's summary of each result (labelled): request, output and
    total token throughput; mean, median and p99 of TTFT, TPOT and ITL in ms; goodput where
    --goodput set SLOs."""
    good = any(r.get("goodput") for r in results)
    head = ["", "req/s", "out tok/s", "total tok/s"]
    for m in ("TTFT", "TPOT", "ITL"):
        head += [f"{m} mean", f"{m} median", f"{m} p99"]
    if good:
        head += ["goodput req/s", "good"]
    rows = [head]
    for r, label in zip(results, labels):
        v = r["vllm_summary"]

        def ms(x):
            return "-" if x is None else f"{x:.1f}"
        row = [label, f"{v['request_throughput']:.3f}", f"{v['output_throughput']:.1f}",
               f"{v['total_token_throughput']:.1f}"]
        for m in ("ttft", "tpot", "itl"):
            row += [ms(v[f"mean_{m}_ms"]), ms(v[f"median_{m}_ms"]), ms(v[f"p99_{m}_ms"])]
        if good:
            g = r.get("goodput")
            row += (["-", "-"] if not g else
                    [f"{g['requests_per_s']:.3f}", f"{g['good_requests']}/{r['completed']}"])
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(0, "as vllm bench serve reports it (latencies in ms):")
    g = next((r["goodput"] for r in results if r.get("goodput")), None)
    if g:
        lines.append("goodput = requests/s within every SLO: " + ", ".join(
            f"{k} <= {v:g} ms" for k, v in g["slo_ms"].items()))
    if any(r.get("itl_basis") != ITL_TOKEN_TIMES for r in results):
        lines.append("ITL (simulated): the mean is exact; median and p99 take each request's "
                     "gaps at its mean gap (no token's time is kept)")
    return lines


# options that change only some policies' runs -> those policies: a demand bound is elastic's
# admission plan; co-batching picks requests by bucket tag, and static puts every request in one
# bucket, so its runs keep arrival order; the knee sizes extents
OPTION_POLICIES = {"--demand-bound": tuple(p for p in POLICIES if policy(p).demand),
                   "--cobatch": tuple(p for p in POLICIES if policy(p).cobatches),
                   "--extent-knee-tokens": tuple(p for p in POLICIES if policy(p).knee)}


def check_options_used(policies, demand_bound=0.0, cobatch: int = 0,
                       extent_knee_tokens: int | None = None) -> None:
    """BadArgument for an option of OPTION_POLICIES set (off its default) that changes none of
    `policies`' runs: their results would be the ones without it."""
    given = [option for option, on in (("--demand-bound", demand_bound != 0.0),
                                       ("--cobatch", cobatch),
                                       ("--extent-knee-tokens", extent_knee_tokens is not None))
             if on]
    for option in given:
        users = OPTION_POLICIES[option]
        if not set(users) & set(policies):
            raise BadArgument(f"{option} changes only {', '.join(users)} runs: --policy "
                              f"{','.join(policies)} would run as without it (drop it, or add "
                              f"one of those policies)")


def clip_note(dropped: int, cut: int, served: int, max_model_len: int) -> str | None:
    """The line saying what --clip changed of the workload (None: nothing), so that a table of
    19,365 requests does not pass for the 19,366-request trace it was asked to serve."""
    if not (dropped or cut):
        return None
    return (f"--clip: {dropped} of {served + dropped} requests dropped (prompt alone >= max "
            f"model len {max_model_len}), {cut} generations cut at that length")


def add_engine_profile_argument(p, what: str = "the card's") -> None:
    """--engine-profile NAME|FILE: a serving engine's per-step terms in place of `what`."""
    p.add_argument("--engine-profile", default=None, metavar="NAME|FILE",
                   help=f"the serving engine's per-step terms (overheads, weight read "
                        f"efficiency) in place of {what}: a preset "
                        f"({', '.join(profile_names())}) or a profile file (TOML); default: "
                        f"the card's own")


def add_length_caps(p) -> None:
    """--prompt-cap and --output-cap: simulate's and the engine's."""
    p.add_argument("--prompt-cap", type=argtypes.positive_int, default=None, metavar="N",
                   help="cut every prompt to at most N tokens (before --max-model-len and "
                        "--clip; an engine run on a CPU takes minutes, not hours)")
    p.add_argument("--output-cap", type=argtypes.positive_int, default=None, metavar="N",
                   help="make at most N tokens per request")


# the types of the options that give a quantity a card file also gives: the card's ranges
BANDWIDTH_GBPS_TYPE = argtypes.between(BANDWIDTH_GBPS.low, BANDWIDTH_GBPS.high)
POOL_GB_TYPE = argtypes.between(CAPACITY_GB.low, CAPACITY_GB.high)


def add_memory_utilization_argument(p) -> None:
    """--memory-utilization: simulate's and the engine's, the share of the card (or device)
    that weights and KV may take, vLLM's gpu_memory_utilization."""
    p.add_argument("--memory-utilization", type=argtypes.positive_float, default=0.9,
                   help="share of the card's memory for weights + KV, whose rest the default "
                        "KV pool is (vLLM's gpu_memory_utilization; default 0.9)")


def add_goodput_argument(p) -> None:
    """--goodput KEY:MS ...: simulate's and the engine's, as vllm bench serve --goodput."""
    p.add_argument("--goodput", type=goodput_item, nargs="+", default=None,
                   metavar="KEY:MS",
                   help=f"service level objectives in ms, as vllm bench serve --goodput: any "
                        f"of {', '.join(f'{k} ({v})' for k, v in SLO_METRICS.items())}, e.g. "
                        f"ttft:500 tpot:50; reports the requests within all of them per second "
                        f"(goodput)")


def add_scheduling_arguments(p) -> None:
    """How steps are filled and requests sent: simulate's and the engine's."""
    p.add_argument("--max-batch", type=argtypes.positive_int, default=256,
                   help="running requests at most (vLLM max_num_seqs, default 256)")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=None,
                   metavar="N",
                   help="chunked prefill (vLLM v1's default): at most N tokens per step, one "
                        "per running request's decode and the rest prompt chunks; at least "
                        "--max-batch (default: off, whole prompts run first, as vLLM v0)")
    p.add_argument("--concurrency", type=argtypes.positive_int, default=None, metavar="C",
                   help="closed loop, as vllm bench serve --max-concurrency C: at most C "
                        "requests in flight, the next sent when one completes (at its --rate "
                        "time if later; without --rate all are ready at once)")
    p.add_argument("--preemption", choices=PREEMPTION, default="recompute",
                   help="what a preempted request's KV becomes: recompute (freed; its prompt "
                        "and tokens run through prefill again, vLLM's default) or swap (copied "
                        "to host memory while --swap-space has room and back when it is "
                        "readmitted, as vLLM v0's preemption_mode=swap)")
    p.add_argument("--swap-space", type=swap_space, default=4.0, metavar="GB",
                   help="host memory for swapped KV, per card (default 4, vLLM's)")
    p.add_argument("--demand-bound", type=demand_bound, default=0.0, metavar="B|none",
                   help="elastic's admission plans for each admitted request's predicted "
                        "length L x (1 + B x u), u the predictor's distance to its 95 %% upper "
                        "bound (default 0: the prediction itself); none plans for nothing beyond "
                        "what a request holds (admit as paging does: for --preemption swap)")
    p.add_argument("--cobatch", type=argtypes.count, default=0, metavar="W",
                   help="co-batch by bucket tag (the ODMA paper's task pool): admit, among the "
                        "first W waiting requests, the oldest whose predicted length falls in "
                        "the batch's commonest bucket (the head after W pass-overs; default 0: "
                        "off, arrival order)")


# Other servers' settings one option away. A preset is flags put before the command line's
# own (the shell re-reads the line so: odma_cli.main), so a flag given explicitly still wins;
# a command takes the flags it has (the engine has no --layout).
PRESETS = {
    "vllm-v1": ("vLLM v1's OpenAI server on an H100-class GPU: nhd pages, chunked prefill at "
                "8,192 tokens a step, 1,024 running requests",
                ("--layout", "nhd", "--max-num-batched-tokens", "8192", "--max-batch", "1024")),
}


class Preset(str):
    """A --preset's name, carrying the flags it stands for (`flags`) in this command."""

    flags: tuple = ()


def add_preset_argument(p) -> None:
    """--preset NAME, after every option it may set has been added to p."""
    known = p._option_string_actions        # argparse keeps no public list of a parser's flags

    def own(flags) -> tuple:
        """Of a preset's flags, those of this command (the engine has no --layout)."""
        return tuple(x for flag, value in zip(flags[::2], flags[1::2])
                     if flag in known for x in (flag, value))

    def preset(name: str) -> Preset:
        if name not in PRESETS:
            raise argparse.ArgumentTypeError(f"unknown preset {name!r} (one of "
                                             f"{', '.join(PRESETS)})")
        got = Preset(name)
        got.flags = own(PRESETS[name][1])
        return got
    p.add_argument("--preset", type=preset, default=None, metavar="NAME",
                   help="another server's defaults, each flag given on the line still winning: "
                        + "; ".join(f"{name} ({what}: {' '.join(own(flags))})"
                                    for name, (what, flags) in PRESETS.items()))


def scheduler_text(max_batched_tokens, max_batch, concurrency=None) -> str:
    """The scheduler a run used, in words: prefill-first or chunked N, and its batch."""
    kind = ("prefill-first" if max_batched_tokens is None
            else f"chunked {max_batched_tokens} tokens/step")
    return f"{kind}, max batch {max_batch}"
