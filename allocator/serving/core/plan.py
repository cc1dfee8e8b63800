"""The step contract between the Scheduler and an executor, modelled on vLLM v1's
schedule() -> SchedulerOutput -> update_from_output() and nano-vllm's schedule -> run ->
postprocess:

    plan = scheduler.schedule(now)               # what this step runs (Plan)
    outcome = executor.execute(plan)             # runs or times it (Outcome)
    scheduler.update(plan, outcome, executor)    # first tokens, finishes, growths, preemptions,
                                                 # resumes; the executor is told each as it is made
    executor.settle(plan, outcome)               # the step's stalls; the executor's clock moves

A growth, a migration or a preemption is decided after the step that made the token needing the
room (as both the simulation's events and the engine's steps have always had it), so they are
the update's decisions, told to the executor through its hooks in the order they are made: the
simulation's step timer keeps float sums whose value depends on that order.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

PREFILL = "prefill"     # prefill-first: the admitted prompts run as one prefill iteration
MIXED = "mixed"         # chunked: every running request's decode and the prompt chunks
DECODE = "decode"       # every running request decodes (the simulation: up to the next event)
IDLE = "idle"           # nothing runs: wait for the next request to be sent


class Admitted(NamedTuple):
    """A request admission took: its KV reserved for `held` tokens, `covered` restored from
    the prefix cache."""

    id: int
    req: object             # its RequestState
    held: int
    covered: int


class Chunk(NamedTuple):
    """`tokens` prompt tokens of a request from position `start`; `last`: they complete its
    prompt (it makes its first token in this step)."""

    id: int
    req: object
    start: int
    tokens: int
    last: bool


@dataclasses.dataclass
class Plan:
    """One step, as the Scheduler decided it before it runs."""

    kind: str
    admitted: list = dataclasses.field(default_factory=list)   # Admitted, in admission order
    chunks: list = dataclasses.field(default_factory=list)     # Chunk, in prefill order
    decodes: list = dataclasses.field(default_factory=list)    # running ids, in id order
    resuming: list = dataclasses.field(default_factory=list)   # [(id, req)] swapped requests
    #                                     readmitted: their KV comes back after the step
    restore: float = 0.0        # seconds of the admitted requests' prefix restores
    prefetch: float = 0.0       # seconds of the prefix prefetches this step started
    horizon: float | None = None   # decode: when a request sent could next join the batch
    wake: float | None = None      # idle: when the next request is sent (None: none will be)


@dataclasses.dataclass
class Outcome:
    """What an executor's step made. The executor counts the tokens each decode made
    (RequestState.made, at once or, the simulation, lazily: see Executor.unsettled)."""

    time: float                 # when the step's tokens exist: first-token and finish time
    seconds: float = 0.0        # the step's own time, before its stalls
    finished: list = dataclasses.field(default_factory=list)   # decodes that made their last
    #                                                            token, in id order
    outgrown: list = dataclasses.field(default_factory=list)   # decodes whose next token's
    #                                      slot lies beyond their block, in id order


class Executor:
    """What the Scheduler's loop (core.drive) needs of an executor, and the hooks the
    Scheduler's update calls as it decides. The hooks' defaults do nothing and count every
    token at once: a Scheduler driven by hand (tests) uses this class as it is."""

    name = "executor"

    # -- the step --------------------------------------------------------------------------
    def now(self) -> float:
        raise NotImplementedError

    def execute(self, plan: Plan) -> Outcome:
        raise NotImplementedError

    def settle(self, plan: Plan, outcome: Outcome) -> None:
        """After the update: the step's stalls (migrations, swaps) and its bookkeeping."""

    def wait(self, until: float) -> None:
        """Nothing runs: let time pass towards `until` (when the next request is sent)."""
        raise NotImplementedError

    # -- told during the update, in decision order --------------------------------------------
    def unsettled(self, i, r) -> int:
        """Tokens running request i made that r.made does not count yet."""
        return 0

    def evict(self, i, r) -> None:
        """Running request i is about to be preempted: count what it made."""

    def swap_out(self, i, r, tokens: int) -> None:
        """Copy request i's first `tokens` of KV to the host (before its block is freed);
        raising loses nothing: the request is recomputed."""

    def swap_in(self, i, r, tokens: int) -> None:
        """Copy request i's swapped KV back into its new block; raising: it is recomputed."""

    def finished(self, i, r, t: float, offered: float, decoding: bool) -> None:
        """Request i completed at t (`decoding`: it was in the decode batch); `offered`:
        seconds of its offers to the prefix cache."""

    def joined(self, i, r, blk, moved: int | None) -> None:
        """Request i joined the decodes in `blk`: after its prefill (moved: bytes a migration
        copied to make its next token's room) or swapped back in (moved None)."""

    def grew(self, i, r, blk, moved: int) -> None:
        """Running request i grew into `blk` (moved: bytes a migration copied)."""

    def decodes_done(self) -> None:
        """The update decided every finish and growth of the step's decodes; the prompts that
        completed come next."""
