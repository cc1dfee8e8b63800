"""The requests a Scheduler serves: RequestState (one request's lengths, progress and times, as
the simulation and the engine both track it) and fit_lengths (a trace's lengths fitted to a
model's context, as both fit them)."""

from __future__ import annotations

import numpy as np

from odma_cli.errors import BadArgument

from allocator.predictors import Request


class RequestState:
    """One request as every driver of the Scheduler sees it: its lengths, progress, times and
    the scheduler's and executors' per-request state (the simulation's step-timer fields a, slope,
    ab, sb, start_step and cap included)."""

    __slots__ = ("rid", "prompt", "gen", "made", "arrival", "first_token", "finish",
                 "preemptions", "predicted", "start_step", "kv_seconds_at_0",
                 "kv_seconds_per_step", "kv_bytes_at_0", "kv_bytes_per_step", "epoch",
                 "block_tokens", "prefix", "prefix_tokens", "offer", "covered", "prefilled",
                 "swapped")

    def __init__(self, rid, prompt, gen, arrival, prefix="", prefix_tokens=0, offer=""):
        self.rid = rid
        self.prompt = prompt        # tokens of the original prompt
        self.gen = gen              # tokens it makes in all
        self.made = 0               # tokens made so far (kept across preemptions)
        self.arrival = arrival
        self.first_token = None
        self.finish = None
        self.preemptions = 0
        self.predicted = None       # (L, u) made once, before the first admission
        self.start_step = 0         # decode step at which `made` holds
        # its KV read at decode step s takes kv_seconds_at_0 + s x kv_seconds_per_step seconds
        # and holds kv_bytes_at_0 + s x kv_bytes_per_step bytes (the step timer's line)
        self.kv_seconds_at_0 = 0.0
        self.kv_seconds_per_step = 0.0
        self.kv_bytes_at_0 = 0.0
        self.kv_bytes_per_step = 0.0
        self.epoch = 0
        self.block_tokens = 0       # tokens its block holds: growing past them is an event
        self.prefix = prefix        # key of the prefix its prompt starts with ("" for none)
        self.prefix_tokens = prefix_tokens
        self.offer = offer          # key its whole context is offered under when it completes
        self.covered = 0            # prompt tokens the cache covered at its last admission
        self.prefilled = 0          # chunked prefill: context tokens computed (or restored)
        self.swapped = 0            # preempted by swap: tokens of its KV the host holds


def predictor_request(i, r) -> Request:
    """Request i as a length predictor sees it."""
    return Request(i, r.prompt, r.gen)


def fit_lengths(trace, max_model_len: int | None, model, clip: bool):
    """(prompt, generated, kept indices, max_model_len, counts of dropped/truncated requests).
    Every request makes at least one token. A request longer than max_model_len (or than the
    model's context) is refused, unless clip: then a prompt that alone does not fit is dropped
    (a server rejects it) and a generation is cut where the length runs out (a server stops)."""
    prompt = trace.prompt.astype(np.int64)
    gen = np.maximum(trace.generated.astype(np.int64), 1)
    longest = int((prompt + gen).max())
    cap = longest if max_model_len is None else int(max_model_len)
    if cap > model.max_context:
        if max_model_len is not None:
            raise BadArgument(f"--max-model-len {cap} exceeds {model.name}'s context of "
                              f"{model.max_context} tokens")
        cap = model.max_context
    over = prompt + gen > cap
    if over.any() and not clip:
        i = int(np.flatnonzero(over)[0])
        raise BadArgument(f"{int(over.sum())} requests of {trace.name} exceed the "
                          f"{cap}-token limit (request {i}: {prompt[i]} + {gen[i]} tokens; "
                          f"{model.name} takes {model.max_context}): pass --clip to drop "
                          f"or truncate them, or raise --max-model-len")
    keep = np.flatnonzero(prompt < cap)
    dropped = len(prompt) - len(keep)
    truncated = int((over[keep]).sum())
    gen = np.minimum(gen, cap - prompt)
    if not len(keep):
        raise BadArgument(f"no request of {trace.name} fits in {cap} tokens")
    return prompt[keep], gen[keep], keep, cap, dropped, truncated
