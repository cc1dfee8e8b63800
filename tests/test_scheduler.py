"""The waiting queue: the request admission tries next is the one a scan of the whole queue
would pick, under FCFS and both prefix schedules, while requests arrive, are admitted and
preempted and the cache moves prefixes between tiers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.serving.core.queue import DISTANCES, WaitingQueue


def scan(rule, queue, arrival, prefix, distance, now):
    """The rule by definition: the best key over the queue, ties to the front."""
    if rule == "fcfs":
        return queue[0]

    def key(i):
        d = DISTANCES - 1 if prefix[i] is None else distance[prefix[i]]
        return (d if rule == "fpf" else -(now - arrival[i]) * (DISTANCES - d), arrival[i])
    return min(queue, key=key)                 # min keeps the first of equals


OPS = st.lists(st.tuples(st.sampled_from(["arrive", "admit", "preempt", "promote", "demote"]),
                         st.integers(0, 4), st.integers(0, DISTANCES - 2)),
               min_size=1, max_size=120)


@pytest.mark.parametrize("rule", ["fcfs", "fpf", "relaxed-fpf"])
@settings(max_examples=150, deadline=None)
@given(ops=OPS, seed_times=st.lists(st.integers(0, 6), min_size=1, max_size=50))
def test_the_pick_is_what_a_scan_of_the_queue_picks(rule, ops, seed_times):
    arrival, prefix = {}, {}
    distance = {k: DISTANCES - 1 for k in range(4)}
    queue: list = []                  # the queue by definition: front first
    admitted: list = []
    q = WaitingQueue(rule, arrival.__getitem__, prefix.__getitem__, distance.__getitem__)
    now = 0.0
    for n, (op, k, d) in enumerate(ops):
        now += 0.5
        if op == "arrive":
            i = len(arrival)
            # equal arrivals are common (a whole trace at t=0): ties must go to the front
            arrival[i] = float(seed_times[i % len(seed_times)])
            prefix[i] = None if k == 4 else k
            q.append(i)
            queue.append(i)
        elif op == "admit" and queue:
            i = q.head(now)
            assert i == scan(rule, queue, arrival, prefix, distance, now)
            q.remove(i)
            queue.remove(i)
            admitted.append(i)
        elif op == "preempt" and admitted:
            i = admitted.pop(k % len(admitted))
            q.appendleft(i)
            queue.insert(0, i)
        elif op == "promote" and k < 4 and d < distance[k]:
            distance[k] = d           # only the engine promotes (restore, offer, prefetch)
            q.moved(k)
        elif op == "demote" and k < 4:
            distance[k] = min(DISTANCES - 1, distance[k] + 1)   # the cache demotes on its own
        assert len(q) == len(queue)
        assert q.first(3) == queue[:3]
    while queue:
        i = q.head(now)
        assert i == scan(rule, queue, arrival, prefix, distance, now)
        q.remove(i)
        queue.remove(i)


def test_a_request_cannot_wait_twice():
    q = WaitingQueue("fcfs", lambda i: 0.0)
    q.append(1)
    with pytest.raises(ValueError):
        q.appendleft(1)
