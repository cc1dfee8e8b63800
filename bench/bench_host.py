"""Host DRAM bandwidth: sequential read, copy and random reads per granule at 1 and 2 threads.

    .venv/bin/python -m pytest bench/bench_host.py --benchmark-only --benchmark-columns=min,median,max

Each benchmark is one HostDevice.measure() call on a working set chosen by devices.md rule 1
(streaming: max(4 x LLC, 1 GiB); random: 1 GiB on huge pages): the shim does its own warm-up and
repetitions, so pytest-benchmark runs it once (pedantic, one round) and the bandwidth it measured
goes to extra_info: gbps (best repetition), median_gbps, spread, method, huge-page fraction and
load average. The timing columns are whole calls including allocation and first touch; read the
bandwidth from extra_info, e.g. with `--benchmark-json out.json`.
"""

import pytest

from odma_hw import devices

GRANULES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
THREADS = [1, 2]
REPS = 5


@pytest.fixture(scope="module")
def host():
    dev = devices.open("host")
    yield dev
    dev.close()


def run(benchmark, host, pattern, granule, threads):
    m = benchmark.pedantic(host.measure, args=(pattern, granule, threads),
                           kwargs={"reps": REPS}, rounds=1, iterations=1)
    benchmark.extra_info.update({
        "pattern": pattern, "granule": granule, "threads": threads,
        "gbps": round(m.gbps, 3), "median_gbps": round(m.median_gbps, 3),
        "spread": round(m.spread, 3), "method": m.method, "buffer_bytes": m.buffer_bytes,
        "bytes_per_rep": m.bytes, "huge_page_fraction": m.extra["huge_page_fraction"],
        "loadavg_1m": m.extra["loadavg_1m"], "convention": m.extra["byte_convention"],
    })
    return m


@pytest.mark.parametrize("threads", THREADS)
def test_host_seq_read(benchmark, host, threads):
    run(benchmark, host, "read", 64, threads)


@pytest.mark.parametrize("threads", THREADS)
def test_host_copy(benchmark, host, threads):
    run(benchmark, host, "copy", 64, threads)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("granule", GRANULES)
def test_host_rand(benchmark, host, granule, threads):
    run(benchmark, host, "rand", granule, threads)
