"""Generated workloads with shared prompt prefixes: the prefix-cache paper's two benchmarks,
rebuilt from documented distributions (no dataset is copied).

- text_analysis: n prompt templates (the prefixes: an instruction and few-shot examples), k >> n
  requests, each a random template followed by a random body, answered briefly; all queued at
  once (a dataset streamed through the model) or at a Poisson rate.
- chat: one system prompt before every conversation; conversations of several turns whose
  history grows; turn 1 starts with the system prompt, turn t with the whole history of turns
  1..t-1 (which turn t-1 offers to the cache when it completes). Lengths of user turns and
  answers follow ShareGPT.

Lengths are log-normal, clipped; the ShareGPT parameters are fitted to
shared/traces/sharegpt_8k.csv (microsoft/sarathi-serve's processed ShareGPT, Llama-2 tokenizer):
log prompt length mean 7.0065, sd 1.6257; log answer length mean 5.7694, sd 1.0011 (answers
<= 1024 tokens). The text-analysis figures are ours (the paper gives none): templates of 800 to
2,000 tokens, bodies of log-normal(4.5, 0.6) tokens (a sentence to a paragraph), answers of
log-normal(4.0, 0.5) tokens (a verdict with a line of reasoning).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from odma_cli.errors import BadArgument

from allocator.arguments import positive_count
from allocator.trace import MAX_SPAN_SECONDS, MAX_TRACE_REQUESTS, RequestTrace

SHAREGPT_PROMPT = (7.0065, 1.6257)      # log-normal (mu, sigma) of ShareGPT prompt tokens
SHAREGPT_ANSWER = (5.7694, 1.0011)      # ... and of its answers
SHAREGPT_MAX_ANSWER = 1024
# A million conversations take half a minute to generate and make about three million requests;
# more would soon pass what a trace may hold (MAX_TRACE_REQUESTS).
MAX_CONVERSATIONS = 1_000_000
CHAT_MAX_CONTEXT = 16384                # tokens a conversation may reach (the default)


def _lognormal(rng, mu_sigma, n, lo, hi) -> np.ndarray:
    mu, sigma = mu_sigma
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(np.int64)


def _check_rate(rate, n: int, what: str) -> None:
    """BadArgument unless `n` arrivals at `rate` per second fit the span a trace may have
    (checked before any generation, so a unit mistake is refused at once)."""
    if rate is None:
        return
    if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)
            and math.isfinite(1.0 / rate)):
        raise BadArgument(f"rate must be a finite number > 0, got {rate!r}")
    span = (n - 1) / rate
    if span > MAX_SPAN_SECONDS:
        raise BadArgument(f"{n} {what} at {rate:g} per second would arrive over {span:.3g} s, "
                          f"more than the {MAX_SPAN_SECONDS:.0f} s (30 days) a trace may span: "
                          f"raise --rate")


def _arrivals(rng, n, rate) -> np.ndarray | None:
    if rate is None:
        return None
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    return t - t[0]


def text_analysis(requests: int = 2000, prefixes: int = 128, *, template_tokens=(800, 2000),
                  body=(4.5, 0.6), answer=(4.0, 0.5), rate: float | None = None,
                  seed: int = 0) -> RequestTrace:
    """k = `requests` requests over n = `prefixes` templates (uniformly chosen); each count at
    most MAX_TRACE_REQUESTS (what load_trace reads back)."""
    for name, v in (("requests", requests), ("prefixes", prefixes)):
        if positive_count(name, v) > MAX_TRACE_REQUESTS:
            raise BadArgument(f"{name} must be at most {MAX_TRACE_REQUESTS} (what a trace may "
                              f"hold), got {v}")
    _check_rate(rate, requests, "requests")
    rng = np.random.default_rng(seed)
    lo, hi = template_tokens
    template = rng.integers(lo, hi + 1, prefixes)
    which = rng.integers(0, prefixes, requests)
    bodies = _lognormal(rng, body, requests, 1, 4096)
    prompt = template[which] + bodies
    gen = _lognormal(rng, answer, requests, 1, 1024)
    # one string per template used, shared by its requests: ten million requests cost a list of
    # pointers, not ten million strings
    used, which_used = np.unique(which, return_inverse=True)
    names = [f"template-{w}" for w in used.tolist()]
    return RequestTrace(prompt, gen, _arrivals(rng, requests, rate),
                        f"text-analysis(n={prefixes},k={requests})",
                        prefix_id=[names[i] for i in which_used.tolist()],
                        prefix_tokens=template[which], offer_id=[""] * requests)


def chat(conversations: int = 400, *, system_tokens: int = 512, turns_mean: float = 3.0,
         max_context: int = CHAT_MAX_CONTEXT, rate: float = 1.0, think_seconds: float = 30.0,
         seed: int = 0) -> RequestTrace:
    """Conversations start at `rate` per second; turn t of a conversation arrives
    think_seconds x (t - 1) after its first turn. A conversation ends after a geometric number
    of turns (mean turns_mean) or when its context would pass max_context."""
    positive_count("conversations", conversations)
    positive_count("system_tokens", system_tokens)
    positive_count("max_context", max_context)
    if conversations > MAX_CONVERSATIONS:
        raise BadArgument(f"conversations must be at most {MAX_CONVERSATIONS}, got "
                          f"{conversations}")
    # a turn holds at least one user token and one answer token after the system prompt
    if system_tokens > max_context - 2:
        raise BadArgument(f"a system prompt of {system_tokens} tokens leaves no room for a turn "
                          f"in a {max_context}-token context: at most {max_context - 2}")
    longest = (max_context - system_tokens) // 2       # turns a conversation can hold at most
    # a mean beyond `longest` is fine: conversations then go on until their context is full
    if not (isinstance(turns_mean, (int, float)) and 1 <= turns_mean < math.inf):
        raise BadArgument(f"mean turns per conversation must be a finite number >= 1, got "
                          f"{turns_mean!r}")
    if not (isinstance(think_seconds, (int, float)) and 0 <= think_seconds
            and think_seconds * longest <= MAX_SPAN_SECONDS):
        raise BadArgument(f"think_seconds must be in [0, {MAX_SPAN_SECONDS / longest:.0f}] (a "
                          f"conversation spans at most 30 days), got {think_seconds!r}")
    if rate is None:
        raise BadArgument("chat needs a rate of conversations per second")
    _check_rate(rate, conversations, "conversations")
    rng = np.random.default_rng(seed)
    starts = _arrivals(rng, conversations, rate)
    rows = []
    for c in range(conversations):
        turns = int(rng.geometric(1.0 / turns_mean))
        history = system_tokens
        prefix, prefix_tokens = "system", system_tokens
        for t in range(turns):
            user = int(_lognormal(rng, SHAREGPT_PROMPT, 1, 1, 4096)[0])
            out = int(_lognormal(rng, SHAREGPT_ANSWER, 1, 1, SHAREGPT_MAX_ANSWER)[0])
            if history + user + out > max_context:
                break
            offer = f"conv-{c}/turn-{t}"
            rows.append((starts[c] + think_seconds * t, history + user, out, prefix,
                         prefix_tokens, offer))
            history += user + out
            prefix, prefix_tokens = offer, history
    if not rows:
        raise BadArgument(f"no turn of {conversations} conversation(s) fits in {max_context} "
                          f"tokens after a {system_tokens}-token system prompt: shorten the "
                          f"system prompt")
    if len(rows) > MAX_TRACE_REQUESTS:
        raise BadArgument(f"{conversations} conversations made {len(rows):,} requests, more "
                          f"than the {MAX_TRACE_REQUESTS:,} a trace may hold: fewer conversations")
    rows.sort(key=lambda r: r[0])
    a, p, g, pid, pt, oid = zip(*rows)
    return RequestTrace(p, g, a, f"chat(conversations={conversations})", prefix_id=list(pid),
                        prefix_tokens=list(pt), offer_id=list(oid))


WORKLOADS = {"text-analysis": text_analysis, "chat": chat}


def _at_most(limit: int):
    """argparse type: an integer in [1, limit]; beyond it a generator would only run out of
    memory or time, so the parser refuses it in one line."""
    from odma_cli import argtypes

    def parse(text: str) -> int:
        v = argtypes.positive_int(text)
        if v > limit:
            raise argparse.ArgumentTypeError(f"must be at most {limit}, not {v}")
        return v
    return parse


# each kind's own options and their defaults (None on the command line: not given, so that the
# other kind's options can be refused)
KIND_OPTIONS = {"text-analysis": {"requests": 2000, "prefixes": 128},
                "chat": {"conversations": 400, "system_tokens": 512, "turns": 3.0}}


def register(subparsers) -> None:
    from odma_cli import argtypes

    p = subparsers.add_parser(
        "workload", help="write a generated request trace with shared prefixes (CSV)",
        description="Write the prefix-cache paper's benchmarks as request traces: "
                    "text-analysis (n templates, k requests) or chat (a system prompt and "
                    "multi-turn conversations). Lengths follow documented distributions; see "
                    "allocator/serving/workloads.py.")
    TEXT, CHAT = KIND_OPTIONS["text-analysis"], KIND_OPTIONS["chat"]   # the help's defaults
    p.add_argument("kind", choices=list(WORKLOADS))
    p.add_argument("--out", type=argtypes.nonempty, required=True, metavar="CSV",
                   help="file to write")
    p.add_argument("--requests", type=_at_most(MAX_TRACE_REQUESTS), default=None,
                   help=f"text-analysis: requests k (default {TEXT['requests']})")
    p.add_argument("--prefixes", type=_at_most(MAX_TRACE_REQUESTS), default=None,
                   help=f"text-analysis: unique templates n (default {TEXT['prefixes']})")
    p.add_argument("--conversations", type=_at_most(MAX_CONVERSATIONS), default=None,
                   help=f"chat: conversations (default {CHAT['conversations']})")
    p.add_argument("--system-tokens", type=_at_most(CHAT_MAX_CONTEXT - 2), default=None,
                   help=f"chat: system prompt tokens (default {CHAT['system_tokens']}; a turn "
                        f"must fit after it in {CHAT_MAX_CONTEXT})")
    p.add_argument("--turns", type=argtypes.positive_float, default=None,
                   help=f"chat: mean turns per conversation (default {CHAT['turns']:g})")
    p.add_argument("--rate", type=argtypes.positive_float, default=None,
                   help="arrivals per second (text-analysis default: all at once; chat: "
                        "conversations per second, default 1)")
    p.add_argument("--seed", type=argtypes.seed, default=0)
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from odma_cli import argtypes
    from odma_cli.errors import BadArgument

    from allocator.trace import check_output_path, write_trace

    other = next(k for k in KIND_OPTIONS if k != args.kind)
    given = argtypes.given(args, KIND_OPTIONS[other])
    if given:       # each kind has its own shape: the other's options would change nothing
        raise BadArgument(f"{argtypes.flag_names(given)} shape{'s' if len(given) == 1 else ''} "
                          f"{other} traces: {args.kind} takes "
                          f"{argtypes.flag_names(KIND_OPTIONS[args.kind])}")
    check_output_path(args.out)
    o = argtypes.with_defaults(args, KIND_OPTIONS[args.kind])
    if args.kind == "text-analysis":
        trace = text_analysis(o["requests"], o["prefixes"], rate=args.rate, seed=args.seed)
    else:
        trace = chat(o["conversations"], system_tokens=o["system_tokens"],
                     turns_mean=o["turns"], rate=args.rate or 1.0, seed=args.seed)
    write_trace(trace, args.out)
    print(f"{args.out}: {trace.name}, {len(trace)} requests, mean prompt "
          f"{trace.prompt.mean():.0f} tokens of which prefix {trace.prefix_tokens.mean():.0f}, "
          f"mean answer {trace.generated.mean():.0f} tokens")
    return 0
