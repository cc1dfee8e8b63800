"""Where simulate and the engine part, step by step: one row of bench/fidelity_engine.py (one
command line, both commands) served in one process, every step of the core's loop timed in the
engine (wall seconds) and costed in the simulation (its executor's seconds), then summed by the
kind of step (decode-only, or with a prompt chunk or whole prompts) for each. Only each
executor's execute() is wrapped: the loop is the core's own.

    .venv/bin/python bench/fidelity_steps.py --card CARD.toml [--trace sharegpt_8k.csv]
        [--policy odma,paged] [--budget 256] [--each] [fidelity_engine.py's other options]

--each also prints every step with prompt tokens in it, the engine's beside the simulation's
(both make the same such plans in the same order).

The simulation's decode plans may cover several steps at once (its executor jumps to the next
event), so decode-only steps are compared as sums, not one by one. The engine's own warm-up
run is left out (the last run each command drives is the one it reports).
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity_engine  # noqa: E402
from engine_table import lengths_only  # noqa: E402

from allocator.serving.engine import cli as engine_cli  # noqa: E402
from allocator.serving.engine.serve import RunnerExecutor  # noqa: E402
from allocator.serving.sim import cli as simulate_cli  # noqa: E402
from allocator.serving.sim.timed import TimedExecutor  # noqa: E402
from odma_cli.main import build_parser  # noqa: E402


def logged(executor_class, runs: list, wall: bool):
    """executor_class.execute, which also logs each step it runs or costs: (decode rows, prompt
    tokens, seconds), a list per executor (one run) in `runs`. The core's loop is left as it is:
    only what each executor does with a plan is timed."""
    execute = executor_class.execute

    def timed(self, plan):
        if not runs or runs[-1][0] is not self:
            runs.append((self, []))
        start, t0 = self.now(), time.perf_counter()
        outcome = execute(self, plan)
        secs = time.perf_counter() - t0 if wall else outcome.time - start
        prompt = sum(c.tokens for c in plan.chunks) + sum(a.held for a in plan.admitted)
        runs[-1][1].append((len(plan.decodes), prompt, secs))
        return outcome
    return timed


def sums(log: list) -> dict:
    out = collections.defaultdict(lambda: [0, 0, 0.0])
    for decodes, prompt, secs in log:
        kind = "with prompts" if prompt else "decode-only"
        out[kind][0] += 1
        out[kind][1] += decodes
        out[kind][2] += secs
    return out


def main(argv=None) -> int:
    p = fidelity_engine.parser()
    p.add_argument("--trace", default="sharegpt_8k.csv",
                   help="a trace CSV, or the name of one in the shared traces folder")
    p.add_argument("--each", action="store_true",
                   help="print every step with prompt tokens, engine beside simulate")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trace = lengths_only(a.trace, tmp)
        sched = ["--max-num-batched-tokens", str(a.budget)] if a.budget else []
        for policy in a.policy.split(","):
            a.policy = policy
            line = fidelity_engine.run_args(a, trace, sched)
            logs = {"engine": [], "simulate": []}
            for name, module, executor, wall in (
                    ("engine", engine_cli, RunnerExecutor, True),
                    ("simulate", simulate_cli, TimedExecutor, False)):
                with mock.patch.object(executor, "execute",
                                       logged(executor, logs[name], wall)):
                    module.compute(build_parser().parse_args([name, *line, "--json"]))
            for name, runs in logs.items():
                log = runs[-1][1]       # the engine's warm-up run comes before its timed one
                for kind, (n, rows, secs) in sorted(sums(log).items()):
                    # the engine's plans are steps: its mean batch; the simulation's are not
                    batch = f", batch {rows / n:4.1f}" if name == "engine" else ""
                    print(f"{policy:8s} {name:8s} {kind:12s} {n:4d} plans{batch}, "
                          f"{secs:7.2f} s")
            if a.each:
                eng, sim = ([s for s in runs[-1][1] if s[1]] for runs in logs.values())
                for (rows, prompt, e), (_, _, t) in zip(eng, sim):
                    print(f"{policy:8s} step: {rows:3d} decodes, {prompt:4d} prompt tokens: "
                          f"engine {e * 1e3:8.1f} ms, simulate {t * 1e3:8.1f} ms "
                          f"({(t / e - 1) * 100:+.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
