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

import numpy as np

from odma_hw.errors import BadArgument

from allocator.trace import RequestTrace

SHAREGPT_PROMPT = (7.0065, 1.6257)      # log-normal (mu, sigma) of ShareGPT prompt tokens
SHAREGPT_ANSWER = (5.7694, 1.0011)      # ... and of its answers
SHAREGPT_MAX_ANSWER = 1024


def _lognormal(rng, mu_sigma, n, lo, hi) -> np.ndarray:
    mu, sigma = mu_sigma
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(np.int64)


def _arrivals(rng, n, rate) -> np.ndarray | None:
    if rate is None:
        return None
    if not rate > 0:
        raise BadArgument(f"rate must be > 0, got {rate}")
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    return t - t[0]


def text_analysis(requests: int = 2000, prefixes: int = 128, *, template_tokens=(800, 2000),
                  body=(4.5, 0.6), answer=(4.0, 0.5), rate: float | None = None,
                  seed: int = 0) -> RequestTrace:
    """k = `requests` requests over n = `prefixes` templates (uniformly chosen)."""
    if not (requests >= 1 and prefixes >= 1):
        raise BadArgument("text_analysis needs at least one request and one prefix")
    rng = np.random.default_rng(seed)
    lo, hi = template_tokens
    template = rng.integers(lo, hi + 1, prefixes)
    which = rng.integers(0, prefixes, requests)
    bodies = _lognormal(rng, body, requests, 1, 4096)
    prompt = template[which] + bodies
    gen = _lognormal(rng, answer, requests, 1, 1024)
    return RequestTrace(prompt, gen, _arrivals(rng, requests, rate),
                        f"text-analysis(n={prefixes},k={requests})",
                        prefix_id=[f"template-{w}" for w in which],
                        prefix_tokens=template[which], offer_id=[""] * requests)


def chat(conversations: int = 400, *, system_tokens: int = 512, turns_mean: float = 3.0,
         max_context: int = 16384, rate: float = 1.0, think_seconds: float = 30.0,
         seed: int = 0) -> RequestTrace:
    """Conversations start at `rate` per second; turn t of a conversation arrives
    think_seconds x (t - 1) after its first turn. A conversation ends after a geometric number
    of turns (mean turns_mean) or when its context would pass max_context."""
    if not (conversations >= 1 and turns_mean >= 1 and system_tokens >= 1):
        raise BadArgument("chat needs conversations >= 1, turns_mean >= 1, system_tokens >= 1")
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
    rows.sort(key=lambda r: r[0])
    a, p, g, pid, pt, oid = zip(*rows)
    return RequestTrace(p, g, a, f"chat(conversations={conversations})", prefix_id=list(pid),
                        prefix_tokens=list(pt), offer_id=list(oid))


WORKLOADS = {"text-analysis": text_analysis, "chat": chat}


def register(subparsers) -> None:
    from odma_hw import argtypes

    p = subparsers.add_parser(
        "workload", help="write a generated request trace with shared prefixes (CSV)",
        description="Write the prefix-cache paper's benchmarks as request traces: "
                    "text-analysis (n templates, k requests) or chat (a system prompt and "
                    "multi-turn conversations). Lengths follow documented distributions; see "
                    "allocator/serving/workloads.py.")
    p.add_argument("kind", choices=list(WORKLOADS))
    p.add_argument("--out", required=True, metavar="CSV", help="file to write")
    p.add_argument("--requests", type=argtypes.positive_int, default=2000,
                   help="text-analysis: requests k (default 2000)")
    p.add_argument("--prefixes", type=argtypes.positive_int, default=128,
                   help="text-analysis: unique templates n (default 128)")
    p.add_argument("--conversations", type=argtypes.positive_int, default=400,
                   help="chat: conversations (default 400)")
    p.add_argument("--system-tokens", type=argtypes.positive_int, default=512,
                   help="chat: system prompt tokens (default 512)")
    p.add_argument("--turns", type=argtypes.positive_float, default=3.0,
                   help="chat: mean turns per conversation (default 3)")
    p.add_argument("--rate", type=argtypes.positive_float, default=None,
                   help="arrivals per second (text-analysis default: all at once; chat: "
                        "conversations per second, default 1)")
    p.add_argument("--seed", type=argtypes.seed, default=0)
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    from allocator.trace import write_trace

    if args.kind == "text-analysis":
        trace = text_analysis(args.requests, args.prefixes, rate=args.rate, seed=args.seed)
    else:
        trace = chat(args.conversations, system_tokens=args.system_tokens,
                     turns_mean=args.turns, rate=args.rate or 1.0, seed=args.seed)
    write_trace(trace, args.out)
    print(f"{args.out}: {trace.name}, {len(trace)} requests, mean prompt "
          f"{trace.prompt.mean():.0f} tokens of which prefix {trace.prefix_tokens.mean():.0f}, "
          f"mean answer {trace.generated.mean():.0f} tokens")
    return 0
