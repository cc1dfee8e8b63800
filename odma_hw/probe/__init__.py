"""Is a device's memory random-access-constrained (RACM), and by how much?

probe_device() measures sustained sequential-read bandwidth and random-read bandwidth across
granularities on one Device and classifies it: RACM when B_rand / B_seq at the device's natural
granule is below alpha (the ODMA paper's 0.3-0.7 range; default 0.5). The verdict is
"inconclusive" when the measurement cannot support one (devices.md rule 8): bandwidth still scales
with threads at the last core count (the memory system was not saturated, so the ratio is a
per-core limit), bandwidth sits far below the known peak, repetitions disagree too much, or the
working set may have fit in a cache.

That verdict answers "is this memory random-access-constrained at the decision granule?" (the
ODMA paper's definition, section 2.2, speaks of "the access granularities typical of KV-cache
paging (tens to hundreds of bytes)"). An allocator asks a narrower question: do the runs its KV
layout reads stream at full speed? So beside the verdict the probe reports the knee (the smallest
measured run from which on every measured run reads at >= FULL_SPEED of streaming) and, for a
model's KV pages (--model, --page-tokens, --dtype) or a run size (--run-bytes), what paging costs
on the device: the ratio at that run size, measured where it is a power of two, interpolated
between the two measured granules around it otherwise. `--from FILE` re-judges a saved result
(`probe --json`) without measuring.

Every argument is checked before anything is measured: plan_probe() validates one device's probe
(and asks the device whether it would accept every measurement of the plan), run_plan() measures.
The `probe` command plans every device it was given before it measures the first one.

The package: runs.py the run sizes a probe judges and what paging costs at them (KVRun, the
knee, judge_run); measure.py plans, measures and classifies one device (ProbeResult);
saved.py re-judges a saved result (--from); cli.py the `devices` and `probe` commands.
"""
