"""The serving core shared by the simulation (allocator/serving/sim/replica.py) and the real engine
(allocator/serving/engine/serve.py): the Scheduler and its step contract.

- plan.py: Plan (what a step runs), Outcome (what it made) and Executor (what the loop needs of
  an executor, and the hooks the Scheduler's update tells its decisions through);
- scheduler.py, admission.py, queue.py: the Scheduler, its admission rules, its waiting queue;
- build.py: SchedulingOptions and build_scheduler, the one way both build a Scheduler;
- checks.py: settings no Scheduler can run;
- drive.py: the one loop (schedule -> execute -> update -> settle);
- requests.py: RequestState and fit_lengths;
- metrics.py: the summaries of a run.
"""
