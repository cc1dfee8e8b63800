"""The one loop every Scheduler runs under: schedule a step, let the executor run (or time) it,
update the Scheduler from what it made, let the executor settle the step; wait when nothing
runs. The simulation and the engine differ only in their executor."""

from __future__ import annotations

from allocator.serving.core.plan import IDLE, Executor
from allocator.serving.core.scheduler import Scheduler


def drive(scheduler: Scheduler, executor: Executor) -> None:
    """Serve every request of `scheduler` with `executor`. RuntimeError when requests wait and
    nothing runs or will be sent (a scheduler that can admit nothing into an empty batch)."""
    n = len(scheduler.reqs)
    while scheduler.done < n:
        plan = scheduler.schedule(executor.now())
        if plan.kind == IDLE:
            if plan.wake is None:
                raise RuntimeError(f"{executor.name} stalled: requests wait and nothing runs")
            executor.wait(plan.wake)
            continue
        outcome = executor.execute(plan)
        scheduler.update(plan, outcome, executor)
        executor.settle(plan, outcome)
