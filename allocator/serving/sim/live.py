"""Live memory timing: decode attention over KV that sits in real allocator blocks on a torch
device (live_attention.py), and the bandwidth of reading that device in runs of S bytes,
both measured now.

measure_attention builds both allocators on a device (build_contiguous, build_paged: pages
scattered as in a pool that has served a while), fills them and times a decode step per layout.
measure_run_bandwidth reads random runs of S bytes through the same kind of gather (into a small
staging buffer that stays in cache, so the timed traffic is the reads), and compares them with
one long contiguous read and a streaming copy (TorchDevice.measure). Times come from
TorchDevice._timed: device events on accelerators, a synchronised wall clock on the CPU. Every
figure is a median over `reps` timed repetitions after one untimed warm-up; GB = 1e9 B.
"""

from __future__ import annotations

import statistics

from odma_cli.errors import BadArgument
from odma_hw.devices.torch_device import TorchDevice

from allocator.arguments import positive_count
from allocator.config import AllocatorConfig
from allocator.paged import PagedAllocator
from allocator.placement import RacmAllocator
from allocator.pool import resolve_device
from allocator.serving.cards.presets import ModelSpec
from allocator.serving.sim.live_attention import (LAYOUTS, PAGED_LAYOUTS, ContiguousKV, PagedKV,
                                                  attention_model, decode_attention, pieces_per_row,
                                                  require_torch)

try:
    import torch
except ImportError:  # the rest of the package works without torch; these functions do not
    torch = None

CPU_STAGING_BYTES = 8 << 20     # gathers land in a buffer that stays in a CPU's caches ...
ACCEL_STAGING_BYTES = 16 << 20  # ... or, on accelerators, in few enough launches to stream


def _torch_device(device) -> tuple[TorchDevice, bool]:
    """(the TorchDevice, whether we opened it) for a spec string or an opened Device."""
    require_torch()
    if device is None:
        raise BadArgument("live timing needs a torch device (torch:cpu, torch:cuda:0, ...)")
    dev, owned = resolve_device(device)
    if not isinstance(dev, TorchDevice):
        if owned:
            dev.close()
        raise BadArgument(f"live timing needs a torch device (torch:cpu, torch:cuda:0, ...), "
                          f"not {dev.spec}")
    return dev, owned


def _timed_reps(dev: TorchDevice, fns) -> list[float]:
    """Seconds of fns[1:], timed after running fns[0] untimed (the warm-up)."""
    fns[0]()
    dev._sync()
    return [dev._timed(fn) for fn in fns[1:]]


def measure_run_bandwidth(device, run_bytes, *, buffer_bytes=None, reps=5, seed=0) -> dict:
    """Sustained read bandwidth of random runs of each size in `run_bytes` on a torch device
    (a spec such as "torch:cpu", or an opened TorchDevice), beside one long contiguous read and a
    streaming copy (read + write counted). Each repetition reads about a quarter of a buffer of
    `buffer_bytes` (default: TorchDevice.default_buffer_bytes, 1 GiB where memory allows) as runs
    of S bytes at random S-aligned places, a fresh set each repetition; a run's bytes are
    gathered (index_select) into a staging buffer small enough to stay in cache, so every byte is
    read once from memory. runs_in_order_gbps is the same gather over consecutive runs: the
    kernel's own ceiling, to read the random figures against."""
    dev, owned = _torch_device(device)
    try:
        reps = positive_count("reps", reps)
        sizes = [run_bytes] if isinstance(run_bytes, int) else list(run_bytes)
        sizes = list(dict.fromkeys(positive_count("run size", s) for s in sizes))
        if not sizes:
            raise BadArgument("run_bytes names no run size")
        size = (dev.default_buffer_bytes("rand") if buffer_bytes is None
                else positive_count("buffer_bytes", buffer_bytes))
        size -= size % 8
        for s in sizes:
            if s % 8 or s > size // 4:
                raise BadArgument(f"run size {s} must be a multiple of 8 B and at most a quarter "
                                  f"of the {size}-byte buffer")
        seq = dev.measure("read", buffer_bytes=size, reps=reps)
        copy = dev.measure("copy", buffer_bytes=size, reps=reps)
        staging_cap = CPU_STAGING_BYTES if dev.dev.type == "cpu" else ACCEL_STAGING_BYTES
        gen = torch.Generator(device="cpu").manual_seed(seed)
        runs, in_order = {}, {}
        buf = dev.alloc(size)
        try:
            words = buf.handle.view(torch.int64)
            words.fill_(1)
            for s in sizes:
                n = size // s                                   # runs in the buffer
                split = pieces_per_row(s // 8)
                pieces = words[:n * s // 8].view(n * split, -1)  # a run = `split` rows in a row
                per_rep = max(1, (size // 4) // s)
                per_call = max(1, min(per_rep, staging_cap // s)) * split
                staging = torch.empty((per_call, pieces.shape[1]), dtype=torch.int64,
                                      device=dev.dev)
                perm = torch.randperm(n, generator=gen)
                need = per_rep * (reps + 1)
                perm = perm.repeat(-(-need // n))[:need].view(reps + 1, per_rep)
                first = int(torch.randint(0, n - per_rep + 1, (1,), generator=gen))
                ordered = torch.arange(first, first + per_rep)

                def gather_all(runs_read):
                    chunks = ((runs_read[:, None] * split + torch.arange(split)).reshape(-1)
                              .to(dev.dev).split(per_call))

                    def run():
                        for c in chunks:
                            torch.index_select(pieces, 0, c, out=staging[:c.numel()])
                    return run

                fns = [gather_all(perm[r]) for r in range(reps + 1)]
                runs[s] = per_rep * s / statistics.median(_timed_reps(dev, fns)) / 1e9
                ordered_fns = [gather_all(ordered)] * (reps + 1)
                in_order[s] = (per_rep * s / statistics.median(_timed_reps(dev, ordered_fns))
                               / 1e9)
        finally:
            dev.free(buf)
        return {"device": dev.spec, "seq_gbps": seq.median_gbps, "copy_gbps": copy.median_gbps,
                "runs_gbps": runs, "runs_in_order_gbps": in_order, "buffer_bytes": size,
                "reps": reps,
                "method": (f"runs: index_select of random S-aligned S-byte rows into a "
                           f"{staging_cap >> 20} MiB staging buffer, ~buffer/4 per repetition; "
                           f"seq: {seq.method} of the buffer; copy: {copy.method} of its halves; "
                           f"timing: TorchDevice._timed "
                           f"({'wall clock' if dev.dev.type == 'cpu' else 'device events'}), "
                           f"median of {reps} after a warm-up")}
    finally:
        if owned:
            dev.close()


def _fill_pool(alloc, gen) -> None:
    """Every byte of the pool as valid bf16 (normal values), so timing never meets NaN."""
    alloc.pool_tensor().view(torch.bfloat16).normal_(generator=gen)


def build_contiguous(dev, model: ModelSpec, batch: int, context: int):
    """A RacmAllocator on `dev` holding `batch` requests of `context` tokens: (alloc, blocks)."""
    config = AllocatorConfig(large_share=0.0, background_refresh=False)
    max_tokens = context + config.token_alignment
    block_bytes = -(-max_tokens * model.kv_bytes_per_token // dev.alignment) * dev.alignment
    alloc = RacmAllocator(dev, batch * block_bytes, model.kv_bytes_per_token, max_tokens, config)
    try:
        blocks = [alloc.reserve(("live", i), context, 1) for i in range(batch)]
    except BaseException:
        alloc.close()
        raise
    return alloc, blocks


def build_paged(dev, model: ModelSpec, batch: int, context: int, page_tokens: int, seed: int = 0):
    """A PagedAllocator on `dev` holding `batch` requests of `context` tokens whose pages are
    scattered as in a pool that has served a while: the free list is first shuffled (every
    page taken by a one-page filler, the fillers released in random order), then the requests
    grow round-robin, one page each in turn. Returns (alloc, blocks)."""
    pages = batch * -(-context // page_tokens)
    page_bytes = -(-page_tokens * model.kv_bytes_per_token // dev.alignment) * dev.alignment
    alloc = PagedAllocator(dev, pages * page_bytes, model.kv_bytes_per_token, context,
                           page_tokens=page_tokens)
    try:
        fillers = list(range(alloc.n_pages))
        for f in fillers:
            alloc.reserve(("filler", f), 0)
        gen = torch.Generator().manual_seed(seed)
        for j in torch.randperm(len(fillers), generator=gen).tolist():
            alloc.release(("filler", fillers[j]))
        for i in range(batch):
            alloc.reserve(("live", i), 0)
        for upto in range(page_tokens, context + page_tokens, page_tokens):
            for i in range(batch):
                alloc.grow(("live", i), min(upto, context))
        blocks = [alloc.block(("live", i)) for i in range(batch)]
    except BaseException:
        alloc.close()
        raise
    return alloc, blocks


def measure_attention(device, model, batch: int, context: int, layouts=LAYOUTS, page_tokens=16,
                      reps=5, *, layers=None, seed=0) -> dict:
    """Seconds of one decode step's attention (every layer) for `batch` requests of `context`
    tokens, per layout, on a torch device: contiguous blocks of a RacmAllocator vs the paged
    layouts over a PagedAllocator whose pages are scattered (see build_paged). `layers` reduces
    the model's depth (the geometry of a layer stays). Returns the median seconds per layout,
    each paged layout's ratio to contiguous (when contiguous is measured), and the KV bytes a
    step reads over those seconds."""
    require_torch()
    m = attention_model(model, layers)
    batch = positive_count("batch", batch)
    context = positive_count("context", context)
    page_tokens = positive_count("page_tokens", page_tokens)
    reps = positive_count("reps", reps)
    layouts = list(dict.fromkeys([layouts] if isinstance(layouts, str) else layouts))
    bad = [lay for lay in layouts if lay not in LAYOUTS]
    if bad or not layouts:
        raise BadArgument(f"unknown layout(s) {bad or layouts!r}: expected some of "
                          f"{', '.join(LAYOUTS)}")
    dev, owned = _torch_device(device)
    gen = torch.Generator(device=dev.dev).manual_seed(seed)
    allocs = []
    try:
        paged = [lay for lay in layouts if lay in PAGED_LAYOUTS]
        kvs, segments = _filled_batches(dev, m, layouts, paged, batch, context, page_tokens,
                                        seed, gen, allocs)
        q = torch.randn((m.layers, batch, m.heads, m.head_dim), generator=gen,
                        device=dev.dev).to(torch.bfloat16)
        seconds, gather_seconds, gathered = {}, {}, {}
        for lay in layouts:
            kv = kvs.pop(lay)

            def step(kv=kv):
                for layer in range(m.layers):
                    decode_attention(q[layer], kv, layer)

            def gather(kv=kv):
                for layer in range(m.layers):
                    kv.gather(layer)

            seconds[lay] = statistics.median(_timed_reps(dev, [step] * (reps + 1)))
            gather_seconds[lay] = statistics.median(_timed_reps(dev, [gather] * (reps + 1)))
            gathered[lay] = kv.workspace()[0].numel() * 2 * m.layers
            kv.release_workspace()            # one layout's workspace in memory at a time
        kv_bytes = batch * context * m.kv_bytes_per_token
        out = {"device": dev.spec, "model": m.name, "layers": m.layers, "batch": batch,
               "context": context, "page_tokens": page_tokens, "reps": reps,
               "kv_bytes": kv_bytes, "seconds": seconds,
               "kv_gbps": {lay: kv_bytes / s / 1e9 for lay, s in seconds.items()},
               "gather_seconds": gather_seconds,
               "gather_gbps": {lay: gathered[lay] / s / 1e9 for lay, s in gather_seconds.items()},
               "paged_segments_mean": segments,
               "method": ("per layer: one index_select of the batch's K and V out of the pool "
                          "(contiguous: a run per request, K/V and KV head; nhd: a row per page; "
                          "hnd, v06: a row per page and KV head) into a workspace, conversion to "
                          "fp32 in (batch, kv_heads, T, head_dim) order, QK^T, softmax, PV; "
                          "gather_seconds times the index_selects alone; paged pages scattered "
                          f"by a shuffled free list; median of {reps} timed steps after a "
                          "warm-up")}
        if "contiguous" in seconds:
            c, cg = seconds["contiguous"], gather_seconds["contiguous"]
            out["ratio_to_contiguous"] = {lay: seconds[lay] / c for lay in paged}
            out["gather_ratio_to_contiguous"] = {lay: gather_seconds[lay] / cg for lay in paged}
        return out
    finally:
        for alloc in allocs:
            alloc.close()
        if owned:
            dev.close()


def _filled_batches(dev, m: ModelSpec, layouts, paged, batch: int, context: int,
                    page_tokens: int, seed: int, gen, allocs: list) -> tuple[dict, float | None]:
    """The decode batch of each layout measure_attention times, in allocators built on `dev`
    (appended to `allocs`, which the caller closes) and filled: ({layout: its KV batch}, the
    paged requests' mean segments, None without a paged layout)."""
    kvs = {}
    if "contiguous" in layouts:
        alloc, blocks = build_contiguous(dev, m, batch, context)
        allocs.append(alloc)
        _fill_pool(alloc, gen)
        kvs["contiguous"] = ContiguousKV(alloc, m, blocks)
    segments = None
    if paged:
        alloc, blocks = build_paged(dev, m, batch, context, page_tokens, seed)
        allocs.append(alloc)
        _fill_pool(alloc, gen)
        segments = sum(b.segments for b in blocks) / batch
        for lay in paged:                      # one pool, read through each layout
            kvs[lay] = PagedKV(alloc, m, blocks, lay)
    return kvs, segments
