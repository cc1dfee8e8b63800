"""The serving simulation: a request trace served by the core's Scheduler (allocator.serving.core)
with every step costed, not run.

simulation.py (simulate(): the library entry), replica.py (one replica's run, the setup of a run),
timed.py and steptime.py (the executor: what each step costs on a card), timing.py, live.py and
live_attention.py (the memory timing sources: emulated, probed, measured live), report.py and
cli.py (`odma-hw simulate`), advise.py (`odma-hw advise`, the what-if on top of it).
"""
