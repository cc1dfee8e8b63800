"""The same requests served by transformers' own continuous batching (its
ContinuousBatchingManager, paged KV cache and FIFO scheduler), as a reference for
serve.serve(): the same greedy tokens, and times measured the same way.

- Decoding: greedy (do_sample=False) of exactly gen[i] tokens; end-of-sequence ignored, as in
  serve(). transformers drops negative end-of-sequence ids, so each request's is -1 and a request
  that emits the model's eos id goes on to its gen[i]-th token. (generate()'s min_new_tokens is
  not the same thing: it masks the eos logit, so where eos is the argmax it picks another token.)
- Concurrency: transformers caps requests per forward pass (max_requests_per_batch). Its FIFO
  scheduler puts running requests first and skips one only when the cache cannot hold it, so with
  a cache that holds the max_batch longest requests at once, at most max_batch requests run.
- Cache: sized here, not from free memory (on CPU transformers would otherwise take 60% of RAM
  and fill an attention mask as long as that cache), with prefix sharing off (serve() shares no
  prefixes) and no safety margin (the cache never runs short, so admissions are never held back
  and no request is offloaded).
- Times: seconds since the run started (after the manager's start-up and one warm-up request,
  both in startup_seconds); a token's time is transformers' own timestamp of it.
- Counts: steps and batch_sum count every forward pass of transformers' loop and the requests in
  it; a pass mixes prefill chunks and decodes, where serve() counts decode steps alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import time

from odma_cli.errors import BadArgument, DeviceUnavailable

from allocator.serving.core.requests import RequestState

NO_EOS = -1                 # transformers keeps only non-negative end-of-sequence ids
PROGRESS_EVERY = 1.0        # seconds between progress calls
STOP_TIMEOUT = 60.0         # seconds to wait for the generation thread to exit


def _transformers():
    """(ContinuousBatchingConfig, GenerationConfig) of transformers, or DeviceUnavailable."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise DeviceUnavailable(f"the hf reference needs transformers ({exc})") from None
    cb_config = getattr(transformers, "ContinuousBatchingConfig", None)
    if cb_config is None:
        raise DeviceUnavailable(f"transformers {transformers.__version__} has no continuous "
                                f"batching (ContinuousBatchingConfig)")
    return cb_config, transformers.GenerationConfig


def check_memory_probe(torch) -> None:
    """Without an accelerator, transformers sizes its cache against host memory read with psutil,
    and without psutil it sees none and refuses any cache."""
    accel = torch.cuda.is_available() or \
        (hasattr(torch, "xpu") and torch.xpu.is_available()) or \
        torch.backends.mps.is_available()
    if not accel and importlib.util.find_spec("psutil") is None:
        raise DeviceUnavailable("transformers' continuous batching on CPU reads host memory with "
                                "psutil; pip install psutil")


def _geometry(prompts, gen, max_batch: int, page: int) -> tuple[int, int]:
    """(cache blocks of `page` tokens, tokens per forward pass): blocks for the max_batch longest
    requests at once, and serve()'s prefill budget, max(longest request, 2048)."""
    lengths = sorted((int(p.numel()) + int(g) for p, g in zip(prompts, gen)), reverse=True)
    blocks = sum(-(-n // page) for n in lengths[:max_batch])
    return blocks, max(lengths[0], 2048)


class _Counts:
    """Forward passes, the requests in them, the most requests running and the requests offloaded
    for want of cache, read from transformers' scheduler and offloading manager as the
    generation thread calls them."""

    def __init__(self, processor):
        self.reset()
        scheduler, offloader = processor.scheduler, processor.offloading_manager
        schedule, offload = scheduler.schedule_batch, offloader.offload_requests

        def counted_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if out[0]:
                self.steps += 1
                self.batch_sum += len(out[0])
                self.peak = max(self.peak, len(scheduler.active_requests))
            return out

        def counted_offload(*args, **kwargs):
            # an offloaded request leaves the running set for the waiting queue
            before = len(scheduler.active_requests)
            out = offload(*args, **kwargs)
            self.offloaded += max(0, before - len(scheduler.active_requests))
            return out
        scheduler.schedule_batch = counted_schedule
        offloader.offload_requests = counted_offload

    def reset(self) -> None:
        self.steps = self.batch_sum = self.peak = self.offloaded = 0


def run_hf(model, prompts: list, gen: list, arrivals, *, max_batch: int,
           max_batched_tokens: int | None = None, concurrency: int | None = None,
           cuda_graphs: bool | None = None, progress=None) -> dict:
    """Serve the requests (prompt token ids, tokens to make, arrival seconds from the start) with
    transformers' continuous batching on the model's device, at most max_batched_tokens tokens
    per forward pass (default: serve()'s prefill budget) and, closed loop, at most `concurrency`
    requests in flight; its CUDA graphs on or off (None: transformers' own choice, off with an
    attention that needs a mask, as sdpa does); the dict serve.serve() returns (see the
    module docstring for what its counts mean here)."""
    CBConfig, GenerationConfig = _transformers()
    import torch

    _check_requests(model, prompts, gen, arrivals, max_batch)
    n = len(prompts)
    check_memory_probe(torch)

    reqs = [RequestState(i, int(prompts[i].numel()), int(gen[i]), float(arrivals[i]))
            for i in range(n)]
    page = CBConfig.page_size
    blocks, batch_tokens = _geometry(prompts, gen, int(max_batch), page)
    batch_tokens = max_batched_tokens or batch_tokens
    cb_config = CBConfig(page_size=page, num_blocks=blocks, max_batch_tokens=batch_tokens,
                         max_requests_per_batch=int(max_batch), allow_block_sharing=False,
                         safety_margin=0.0, auto_switch_to_flash=False,
                         use_cuda_graph=cuda_graphs)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=NO_EOS)

    t0 = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config)
    ok = False
    try:
        try:
            manager.warmup()            # builds the cache and the batch processor
        except MemoryError as exc:
            raise DeviceUnavailable(f"transformers' continuous batching cannot place its KV "
                                    f"cache ({blocks} blocks of {page} tokens): {exc}") from None
        processor = manager.batch_processor
        cache = processor.cache
        stats = {"blocks": int(cache.num_blocks), "page_tokens": page,
                 "max_batch_tokens": int(cache.max_batch_tokens),
                 "cache_bytes": int(cache.cache_tensor.numel() * cache.cache_tensor.element_size())}
        try:
            counts = _Counts(processor)
        except AttributeError:          # a transformers whose loop is laid out otherwise
            counts = None
        del processor, cache
        manager.start()
        # one token through the loop, so that the thread's own set-up and the first forward
        # pass are start-up, not the first request's time
        manager.add_request(prompts[0][:1].tolist(), request_id="warm-up", max_new_tokens=1,
                            eos_token_id=NO_EOS)
        while _next(manager, PROGRESS_EVERY) is None:
            pass
        if counts is not None:
            counts.reset()
        startup = time.perf_counter() - t0
        run = _serve(manager, prompts, reqs, progress, concurrency)
        ok = True
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=STOP_TIMEOUT, hard_stop=not ok)
        manager.destroy()

    run.update({
        "startup_seconds": startup,
        "cuda_graphs": cb_config.use_cuda_graph,      # as transformers settled it
        "top_logits": None,
        "steps": counts.steps if counts else None,
        "batch_sum": counts.batch_sum if counts else None,
        "peak_batch": counts.peak if counts else None,
        "preemptions": counts.offloaded if counts else 0,
        "allocator": stats,
        "used_tokens": 0, "reserved_tokens": 0,
    })
    return run


def _check_requests(model, prompts: list, gen: list, arrivals, max_batch) -> None:
    """BadArgument (DeviceUnavailable for a model without continuous batching) for requests
    or a model run_hf cannot serve, before anything is built."""
    n = len(prompts)
    if not (len(gen) == len(arrivals) == n):
        raise BadArgument(f"{n} prompts, {len(gen)} generation lengths and {len(arrivals)} "
                          f"arrivals: expected one of each per request")
    if n == 0:
        raise BadArgument("no requests to serve")
    if int(max_batch) < 1:
        raise BadArgument(f"max_batch must be at least 1, got {max_batch}")
    if any(int(g) < 1 for g in gen) or any(p.numel() < 1 for p in prompts):
        raise BadArgument("every request needs a prompt of at least one token and at least one "
                          "token to make")
    if not hasattr(model, "init_continuous_batching"):
        raise DeviceUnavailable(f"{type(model).__name__} has no continuous batching "
                                f"(init_continuous_batching)")
    if getattr(model, "_cached_continuous_batching_manager", None) is not None:
        # transformers would hand back that manager, sized and configured for other requests
        raise BadArgument("the model holds a persistent continuous batching manager: call "
                          "model.destroy_cached_continuous_batching_manager() first")


def _next(manager, timeout: float):
    """The next finished request's output, None after `timeout` seconds without one; raises when
    the generation thread died or the request failed."""
    out = manager.get_result(timeout=timeout)
    if out is None:
        if not manager.is_running():
            cause = getattr(manager.background_thread_status, "fatal_error", None)
            raise RuntimeError(f"transformers' continuous batching stopped before every request "
                               f"finished{f': {cause}' if cause else ''}")
        return None
    if out.error is not None:
        raise RuntimeError(f"transformers' continuous batching failed request "
                           f"{out.request_id}: {out.error}")
    return out


def _serve(manager, prompts, reqs, progress, concurrency=None) -> dict:
    """Submit each request once its arrival time has passed (and, closed loop, once fewer than
    `concurrency` are in flight: it arrives then) and collect the outputs."""
    n = len(reqs)
    tokens: list = [None] * n
    times: list = [[] for _ in range(n)]      # each token's seconds from the start
    order = sorted(range(n), key=lambda i: (reqs[i].arrival, i))
    next_arrival = done = 0
    start = time.perf_counter()
    last_progress = start

    def now():
        return time.perf_counter() - start

    def gated():
        return concurrency is not None and next_arrival - done >= concurrency

    while done < n:
        while next_arrival < n and reqs[order[next_arrival]].arrival <= now() and not gated():
            i = order[next_arrival]
            if concurrency:            # a closed loop's request arrives when it is sent
                reqs[i].arrival = max(reqs[i].arrival, now())
            manager.add_request(prompts[i].tolist(), request_id=f"r{i}",
                                max_new_tokens=reqs[i].gen, record_timestamps=True,
                                eos_token_id=NO_EOS)
            next_arrival += 1
        wait = PROGRESS_EVERY
        if next_arrival < n and not gated():
            wait = min(wait, max(0.0, reqs[order[next_arrival]].arrival - now()))
        out = _next(manager, wait)
        if out is not None:
            i = int(out.request_id[1:])
            r = reqs[i]
            tokens[i] = list(out.generated_tokens)
            r.made = len(tokens[i])
            r.first_token = out.timestamps[0] - start
            r.finish = out.timestamps[-1] - start
            times[i] = [t - start for t in out.timestamps]
            done += 1
        if progress and time.perf_counter() - last_progress > PROGRESS_EVERY:
            last_progress = time.perf_counter()
            progress(done, n, now())
    return {"requests": reqs, "tokens": tokens, "token_times": times, "seconds": now()}
