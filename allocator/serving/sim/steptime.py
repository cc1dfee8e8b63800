"""What the steps of one card of a replica cost: the timing executor of the serving simulation.

    decode = max(weights, products) + max(KV, attention) + step overhead
             + layers x (layer overhead + batch x layer-request overhead)
             + batch x request overhead + all-reduce (TP > 1), where
      weights = streamed weights / (seq GB/s x the card's weight_read_efficiency),
      products = the batch's FLOPs through the weights / (peak x MFU),
      KV = sum over running requests of their KV runs / (run GB/s)
           (run GB/s: the card's engine_run_gbps where it has one, the rate the engine's
           attention reads runs at; else the memory's, from the card's timing source),
      attention = the batch's FLOPs over each context / (peak x MFU)
    prefill = max(weights / seq GB/s, products) + max(KV bytes / seq GB/s, attention)
              + step overhead
              + layers x (layer overhead + prompts x layer-request overhead) + all-reduce
      (each operator at its own roofline, one after the other as an engine runs them: a
      CPU whose products are compute-bound while its attention waits on memory takes the sum;
      a roofline of the whole step would hide the shorter of the two)
      (the card's prefill_* overheads where it gives them: an engine that replays its decode
      steps from CUDA graphs runs prompts eagerly; a chunked step with prompt chunks in it
      pays them instead of the decode step's per-step and per-layer ones)
    migration = 2 x bytes copied / copy GB/s (the copy counts read + write)
KV runs by layout, per card with h KV heads, head_dim x 2 B = g bytes per token per run:
    contiguous: 2 x layers x h runs of ctx x g bytes;
    paged "v06" and "hnd" (vLLM 0.6 / vllm-mlu): one run of page_tokens x g per page, layer,
      K or V and head; with one KV head per card, consecutive pages of a request merge;
    paged "nhd" (vLLM v1): one run of page_tokens x h x g per page, layer, K or V; consecutive
      pages merge;
    extent: per extent, 2 x layers x h runs of the tokens it holds x g bytes (the last extent
      partly filled); extents never merge, each is a head-major block of its own.

While the batch does not change, each request's KV time grows linearly with its context, so a
step's time is linear in the step index and any number of steps sums in closed form
(decode_span); a request's line is re-read from the timing source when its block changes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from allocator.serving.sim.timing import rate_table


def knee_tokens(timing, run_unit_bytes: int, fraction: float, max_tokens: int) -> int:
    """The knee of a timing source: the fewest tokens whose run (tokens x run_unit_bytes bytes)
    reads at `fraction` of its sequential bandwidth: the first power of two that does, then
    bisection below it (on a measured curve that is not monotone, the crossing in that octave).
    Where no run up to max_tokens gets there (several streams interleaved at the controller cap
    every run below streaming), `fraction` of the fastest such run: the start of the plateau,
    not max_tokens, which would make every extent a whole request."""
    def first(target):
        def fast(tokens):
            return float(timing.run_gbps(tokens * run_unit_bytes)) >= target

        hi = 1
        while not fast(hi):
            if hi >= max_tokens:
                return None
            hi = min(2 * hi, max_tokens)
        lo = hi // 2                           # not fast (or 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fast(mid):
                hi = mid
            else:
                lo = mid
        return hi

    knee = first(fraction * float(timing.seq_gbps))
    if knee is None:
        sizes = sorted({min(1 << k, max_tokens) for k in range(max_tokens.bit_length() + 1)})
        best = max(float(timing.run_gbps(t * run_unit_bytes)) for t in sizes)
        knee = first(fraction * best) or max_tokens
    return knee


def extent_config(setup):
    """setup.config for the extent allocator: its knee (extent_knee_tokens) from setup's timing
    source and the contiguous layout's run unit (head_dim x 2 B per (layer, K/V, head) run),
    unless the config names one."""
    c = setup.config
    if c.extent_knee_tokens is not None:
        return c
    _, unit, _ = setup.run_layout("contiguous")
    return dataclasses.replace(c, extent_knee_tokens=knee_tokens(
        setup.timing, unit, c.extent_knee_fraction, setup.max_model_len))


class StepTimer:
    """Step costs of one card for a ServingSetup and a KV layout; it also keeps the running
    requests' KV lines summed (add) and the margins over the physical floors."""

    def __init__(self, setup, layout: str):
        self.s = setup
        self.layout = layout
        self.bpt = setup.kv_bytes_per_token
        t = setup.timing
        self.seq_gbps = float(t.seq_gbps)
        self.copy_gbps = float(t.copy_gbps)
        self.peak_bw = t.peak_gbps * 1e9
        # an extent is read as a contiguous block is, one extent at a time
        self.runs_per_unit, self.run_unit_bytes, self.merge = setup.run_layout(
            "contiguous" if layout == "extent" else layout)
        m, d = setup.model, setup.device
        # per step, independent of the batch: weights and per-layer overheads
        self.weight_bytes = setup.weight_bytes       # a property that sums the model's shapes
        self.w_seconds = self.weight_bytes / (self.seq_gbps * d.weight_read_efficiency * 1e9)
        self.layer_seconds = (m.layers * d.layer_overhead_us + d.step_overhead_us) * 1e-6
        # all-reduce: 2 per layer of batch x hidden x 2 B, ring over TP cards
        tp = setup.tp
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            self.ar_const = 2 * m.layers * 2 * (tp - 1) * d.link_latency_us * 1e-6
            self.ar_per_token = 2 * m.layers * ring * m.hidden * 2 / (d.link_gbps * 1e9)
        else:
            self.ar_const = self.ar_per_token = 0.0
        self.req_seconds = d.request_overhead_us * 1e-6
        # an engine that launches attention once per request per layer pays this per request
        self.layer_req_seconds = m.layers * d.layer_request_overhead_us * 1e-6
        # steps with prompts in them: the card's own figures for them (any it gives; 0 for the
        # others), else the decode steps'
        pre = (d.prefill_step_overhead_us, d.prefill_layer_overhead_us,
               d.prefill_layer_request_overhead_us)
        if all(v is None for v in pre):
            self.prefill_seconds, self.prefill_req_seconds = (self.layer_seconds,
                                                              self.layer_req_seconds)
        else:
            step_us, layer_us, layer_req_us = (v or 0.0 for v in pre)
            self.prefill_seconds = (m.layers * layer_us + step_us) * 1e-6
            self.prefill_req_seconds = m.layers * layer_req_us * 1e-6
        self.chunk_seconds = m.layers * d.chunk_layer_overhead_us * 1e-6
        self.card_flops = d.peak_tflops(setup.dtype) * 1e12
        # decode FLOPs per step on one card: per request, and per token of context (attention)
        self.flops_per_request = 2.0 * m.streamed_params / tp
        self.flops_per_ctx = 4.0 * m.layers * m.heads * m.head_dim / tp
        # the card's matmul tables: (log2 rows, share of the card's peak)
        self._efficiency, self._layer_efficiency = (
            None if not t else (np.log2([r for r, _ in t]),
                                np.array([v * 1e12 for _, v in t]) / self.card_flops)
            for t in (d.matmul_tflops, d.layer_matmul_tflops))
        # of those per request: the LM head's, and the layers' (all a prompt's tokens go
        # through the layers, only each sequence's last through the head)
        self.head_flops = 2.0 * m.vocab * m.hidden / tp
        self.layer_flops = self.flops_per_request - self.head_flops
        self.per_token = self.runs_per_unit * self.run_unit_bytes   # KV bytes per context token
        # GB/s of the KV's runs by their size, as the engine reads them where the card says
        self.kv_gbps = (rate_table(d.engine_run_gbps) if d.engine_run_gbps
                        else setup.timing.run_gbps)
        self._runs_memo: dict = {}         # a paged run's read (seconds, B/s) by its tokens
        self._extent_gbps: dict = {}       # an extent run's GB/s by its bytes
        self.sums = [0.0, 0.0, 0.0, 0.0]   # over running requests: a, slope, ab, sb
        self.floor_margin = math.inf       # min over steps of step seconds / (bytes / peak)
        self.compute_margin = math.inf     # min over steps of step seconds / (FLOPs / peak)
        self.prefill_margin = math.inf

    # -- a request's KV time, linear in the step index ----------------------------------------
    def linearize(self, r, step: int, ctx: int, blk) -> None:
        """Set r's line (RequestState.kv_seconds_at_0 and _per_step, kv_bytes_at_0 and
        _per_step) so that its KV read at decode step s takes kv_seconds_at_0 + s x
        kv_seconds_per_step, with ctx tokens at `step`."""
        unit = self.run_unit_bytes
        n = self.runs_per_unit
        per_token = n * unit
        gbps = self.kv_gbps
        if self.layout == "contiguous":
            run = ctx * unit
            bw = float(gbps(run)) * 1e9
            secs = n * run / bw
            slope = per_token / bw
        elif self.layout == "extent":
            secs, slope = self._extent_line(blk, ctx, unit, n)
        else:
            pt = self.s.page_tokens
            if self.merge:
                if getattr(blk, "run_pages", None) is not None:
                    secs, slope = self._merged_line(blk, ctx, pt, n)
                else:                              # any block that gives runs()
                    runs = blk.runs()
                    pages = np.array([k for _, k in runs], dtype=np.float64)
                    full = pages * pt
                    full[-1] -= len(blk.pages) * pt - ctx  # the last page is partly filled
                    run_bytes, bws = self._run_reads(full)
                    secs = float(n * (run_bytes / bws).sum())
                    slope = per_token / float(bws[-1])
            else:
                bw = float(gbps(pt * unit)) * 1e9
                secs = n * ctx * unit / bw
                slope = per_token / bw
        r.kv_seconds_per_step = slope
        r.kv_seconds_at_0 = secs - step * slope
        r.kv_bytes_per_step = per_token
        r.kv_bytes_at_0 = ctx * per_token - step * per_token

    def _run_reads(self, full):
        """(bytes, B/s) of the reads of runs of `full` tokens each (an array of floats; at least
        one token's worth a run)."""
        run_bytes = np.maximum(full, 1) * self.run_unit_bytes
        return run_bytes, self.kv_gbps(run_bytes) * 1e9

    def _run_seconds(self, memo: dict, full: int) -> tuple[float, float]:
        """(seconds, B/s) of the read of one run of `full` tokens, remembered in memo by its
        tokens: each run is costed as an element of the array all of a block's runs were once
        costed in (the rates are a function of the size alone), so the sums below add the same
        numbers."""
        got = memo.get(full)
        if got is None:
            run_bytes, bws = self._run_reads(np.array([full], dtype=np.float64))
            got = memo[full] = (float((run_bytes / bws)[0]), float(bws[0]))
        return got

    def _merged_line(self, blk, ctx: int, pt: int, n: int) -> tuple[float, float]:
        """(seconds now, seconds per step) of the KV read of a paged block whose consecutive
        pages merge into one run, ctx tokens in it (the last page partly filled). The block
        only gains pages, so every run but its last is final: their read times are kept on the
        block (timer_line: this timer, the runs costed, their seconds) and only the runs added
        since, and the last, are costed anew; the seconds are summed over the whole array each
        time, as numpy sums one array of every run's seconds (pairwise), so the figure is the
        one costing every run afresh gives, to the bit."""
        lens = blk.run_pages()
        m = len(lens)
        line = blk.timer_line
        if line is None or line[0] is not self:
            line = blk.timer_line = [self, 0, np.empty(max(16, 2 * m))]
        done, buf = line[1], line[2]
        if m > len(buf):
            grown = np.empty(2 * m)
            grown[:done] = buf[:done]
            buf = line[2] = grown
        if done < m - 1:                           # runs that a later run has closed
            if m - 1 - done <= 4:
                memo = self._runs_memo
                for j in range(done, m - 1):
                    buf[j] = self._run_seconds(memo, lens[j] * pt)[0]
            else:
                run_bytes, bws = self._run_reads(
                    np.array(lens[done:m - 1], dtype=np.float64) * pt)
                buf[done:m - 1] = run_bytes / bws
            line[1] = m - 1
        # the last run: its pages less what the last page lacks
        secs, bw = self._run_seconds(self._runs_memo,
                                     lens[-1] * pt - (len(blk.pages) * pt - ctx))
        buf[m - 1] = secs
        return float(n * buf[:m].sum()), n * self.run_unit_bytes / bw

    def _extent_line(self, blk, ctx: int, unit: int, n: int) -> tuple[float, float]:
        """(seconds now, seconds per step) of the KV read of an extent block holding ctx tokens:
        every extent one run per (layer, K/V, head) of the tokens it holds. Only the last one
        grows, a token a step, until the request outgrows it and is relinearized: the slope is
        the chord of its read time from now to full, exact at both ends, where a slope at its
        current fill (a fresh extent holds one token: runs of head_dim x 2 B) would overstate the
        whole extent's cost until the next event."""
        gbps, memo = self.kv_gbps, self._extent_gbps

        def rate(run):         # GB/s of a run of `run` bytes (one interpolation per size)
            got = memo.get(run)
            if got is None:
                got = memo[run] = float(gbps(run))
            return got

        def read(tokens):      # seconds of the n runs of `tokens` tokens each
            run = tokens * unit
            return n * run / (rate(run) * 1e9)

        secs = 0.0
        start = last_fill = last_cap = 0
        for cap in blk.extent_tokens():
            fill = min(cap, ctx - start)
            if fill <= 0:
                break
            secs += read(fill)
            start += cap
            last_fill, last_cap = fill, cap
        if last_cap > last_fill:
            return secs, (read(last_cap) - read(last_fill)) / (last_cap - last_fill)
        # the last extent is full: the next step outgrows it, and the line is re-read then
        return secs, n * unit / (rate(max(last_fill, 1) * unit) * 1e9)

    def add(self, r, sign: int) -> None:
        """Count a running request's line in the batch's sums (sign +1), or take it out (-1)."""
        sums = self.sums
        sums[0] += sign * r.kv_seconds_at_0
        sums[1] += sign * r.kv_seconds_per_step
        sums[2] += sign * r.kv_bytes_at_0
        sums[3] += sign * r.kv_bytes_per_step

    def start(self, r, step: int, blk) -> None:
        """A request joins the batch at `step`, holding the slot of its next token."""
        r.start_step = step
        r.block_tokens = blk.capacity_tokens
        self.linearize(r, step, r.prompt + r.made + 1, blk)
        self.add(r, +1)

    def relinearize(self, r, blk) -> None:
        """Re-read a running request's line (its block changed, or it ran RELINEARIZE steps)."""
        self.add(r, -1)
        r.block_tokens = blk.capacity_tokens
        self.linearize(r, r.start_step, r.prompt + r.made + 1, blk)
        self.add(r, +1)

    # -- prefill and migration -----------------------------------------------------------------
    def prefill(self, parts) -> tuple[float, float, float]:
        """(seconds, FLOPs, bytes) of one prefill iteration over (tokens held, tokens covered by
        the cache) pairs."""
        s = self.s
        flops = sum(s.model.prefill_flops(h - c, cached=c) for h, c in parts) / s.tp
        attn = sum(s.model.prefill_attention_flops(h - c, cached=c) for h, c in parts) / s.tp
        computed = sum(h - c for h, c in parts)
        nbytes = self.weight_bytes + sum(h for h, _ in parts) * self.bpt
        products, rate = self.prompt_products(computed, len(parts))
        bw = self.seq_gbps * 1e9
        # the products, then the attention, each at its roofline; an engine that runs
        # attention request by request pays that per prompt too
        secs = (max(products, self.weight_bytes / bw)
                + max(attn / rate, (nbytes - self.weight_bytes) / bw)
                + self.prefill_seconds + len(parts) * self.prefill_req_seconds + self.ar_const
                + sum(c > 0 for _, c in parts) * self.chunk_seconds
                + computed * self.ar_per_token)
        return secs, flops, nbytes

    def note_prefill(self, secs: float, flops: float, nbytes: float) -> None:
        self.prefill_margin = min(self.prefill_margin,
                                  secs / max(flops / self.card_flops, nbytes / self.peak_bw))

    def migration_seconds(self, nbytes: int) -> float:
        return 2.0 * nbytes / (self.copy_gbps * 1e9) if nbytes else 0.0

    # -- decode ----------------------------------------------------------------------------------
    def overhead_seconds(self, nb: int, extra_per_request: float = 0.0) -> float:
        """Overheads of one step running nb requests: layers x (layer overhead + nb x
        layer-request overhead) + nb x request overhead. extra_per_request (seconds) joins the
        per-request sum: decode adds its all-reduce there, in the order its sums always had."""
        return self.layer_seconds + nb * (self.req_seconds + self.layer_req_seconds
                                          + extra_per_request)

    def efficiency(self, rows: int, layers: bool = False) -> float:
        """The share of the card's peak FLOPS a step's matrix products reach with `rows` rows
        (tokens): the card's measured throughput at that row count (interpolated in log rows,
        the nearest end beyond its table) where the card has one, else the MFU. A CPU reaches
        a few percent of its 256-row throughput at one row; a GPU's decode is memory-bound.
        layers: of the layers' products alone (the card's layer_matmul_tflops)."""
        table = self._layer_efficiency if layers else self._efficiency
        if table is None:
            return self.s.mfu
        return float(np.interp(math.log2(max(rows, 1)), *table))

    def prompt_products(self, rows: int, heads: int) -> tuple[float, float]:
        """(seconds of the matrix products, the rate its attention's FLOPs run at) of a step
        with prompt tokens in it: `rows` tokens through the layers, `heads` of them (each
        sequence's last) through the LM head. Where the card measured its layers' products
        apart, each part at its own row count: the head's time is the whole set's at `heads`
        rows less the layers' there (at least its FLOPs at the card's peak); else all of them
        at the whole set's rate at `rows`."""
        if self._layer_efficiency is None:
            rate = self.card_flops * self.efficiency(rows)
            return (rows * self.layer_flops + heads * self.head_flops) / rate, rate
        rate = self.card_flops * self.efficiency(rows, layers=True)
        head = max(heads * self.head_flops,
                   heads * (self.flops_per_request / self.efficiency(heads)
                            - self.layer_flops / self.efficiency(heads, layers=True)))
        return rows * self.layer_flops / rate + head / self.card_flops, rate

    def _decode_lines(self, nb: int):
        """(overheads, m0, m1, f0, f1, products) of a decode step of the nb running requests at
        step s, in seconds: `products` is max(weights, the products' FLOPs), the same every
        step; the step is max(m0 + m1 s, f0 + f1 s) + overheads, m the line where its attention
        is memory-bound (products + KV reads), f where it is compute-bound (products + the
        attention's FLOPs), each linear in the step index."""
        a, sl, ab, sb = self.sums if nb else (0.0, 0.0, 0.0, 0.0)
        over = self.overhead_seconds(nb, self.ar_per_token) + self.ar_const
        rate = self.card_flops * self.efficiency(nb)
        products = max(self.w_seconds, nb * self.flops_per_request / rate)
        f0 = products + self.flops_per_ctx * ab / self.per_token / rate
        f1 = self.flops_per_ctx * sb / self.per_token / rate
        return over, products + a, sl, f0, f1, products

    def _flops_seconds(self, nb: int, at: float) -> float:
        """Seconds of a decode step's FLOPs at the card's peak (products and attention)."""
        ab, sb = (self.sums[2], self.sums[3]) if nb else (0.0, 0.0)
        return (nb * self.flops_per_request + self.flops_per_ctx * (ab + sb * at)
                / self.per_token) / self.card_flops

    def _count_decode(self, tot, nb: int, k: int, tri: float, secs: float, lines) -> None:
        """Add k decode steps (tri: the sum of their step indices) to tot's components."""
        _, m0, m1, f0, f1, products = lines
        a, sl, ab, sb = self.sums
        tot["decode"] += secs
        tot["kv"] += k * a + sl * tri
        tot["weights"] += k * self.w_seconds
        tot["overheads"] += k * self.overhead_seconds(nb)
        tot["allreduce"] += k * (self.ar_const + nb * self.ar_per_token)
        beyond = k * (products - self.w_seconds)   # compute beyond the memory time
        if f0 + f1 * tri / k > m0 + m1 * tri / k:
            beyond += k * (f0 - m0) + (f1 - m1) * tri
        if beyond > 0:
            tot["compute"] += beyond
            tot["compute_bound_steps"] += k
        tot["steps"] += k
        tot["kv_bytes"] += k * ab + sb * tri
        tot["batch_seconds"] += nb * secs

    def decode_terms(self, nb: int, step: int) -> tuple[float, float, float]:
        """(memory, compute, floor) seconds of a decode step of the nb running requests at
        `step`, the overheads left out: its reads, its FLOPs, and what the step model takes
        for them (each operator at its roofline), which `odma-hw calibrate` takes from a
        measured step to fit the overheads."""
        _, m0, m1, f0, f1, _ = self._decode_lines(nb)
        a, sl = (self.sums[0], self.sums[1]) if nb else (0.0, 0.0)
        memory = self.w_seconds + a + sl * step
        compute = self._flops_seconds(nb, step) / self.efficiency(nb)
        return memory, compute, max(m0 + m1 * step, f0 + f1 * step)

    def decode_span(self, nb: int, step: int, k: int, dt: float | None, tot) -> tuple[int, float]:
        """Run decode steps from `step` with nb requests: at most k (the next event), and no
        more than reach dt seconds when dt is given (a request arrives then). Returns (steps,
        seconds) and adds the components to tot."""
        ab, sb = self.sums[2], self.sums[3]
        # a step is max(memory, compute) of its attention, after its products, + overheads
        lines = over, m0, m1, f0, f1, _ = self._decode_lines(nb)
        compute_bound = f0 + f1 * step > m0 + m1 * step
        if m1 != f1:                               # memory and compute trade places there
            cross = (f0 - m0) / (m1 - f1)
            if cross > step:
                k = min(k, max(1, math.ceil(cross - step)))
        c0, c1 = (f0, f1) if compute_bound else (m0, m1)
        if dt is not None:
            k = min(k, self.steps_until(dt, c0 + over, c1, step))
        k = max(1, k)
        tri = k * step + k * (k - 1) / 2          # sum of the step indices
        secs = k * (c0 + over) + c1 * tri
        for at in (step, step + k - 1):           # both ends: time, bytes, FLOPs are linear
            t_step = max(m0 + m1 * at, f0 + f1 * at) + over
            self.floor_margin = min(self.floor_margin,
                                    t_step * self.peak_bw / (self.weight_bytes + ab + sb * at))
            self.compute_margin = min(self.compute_margin, t_step / self._flops_seconds(nb, at))
        self._count_decode(tot, nb, k, tri, secs, lines)
        return k, secs

    def mixed_step(self, nb: int, step: int, chunks, tot) -> float:
        """Seconds of one chunked-prefill step: nb running requests decode (at decode step
        `step`) while prompt chunks [(first position, tokens)] ride along. The weights are read
        once for all, the products over every token of the step; the chunks add their
        attention's FLOPs (over the context before them) and their context's KV bytes at the
        sequential bandwidth (read what is cached, write what they compute), as prefill()
        counts a whole prompt; with no decode it is prefill() of those chunks. tot gets the
        decode's components (as decode_span gives them) and the chunks' share of the step,
        "prefill_chunks"."""
        s = self.s
        a, sl, ab, sb = self.sums if nb else (0.0, 0.0, 0.0, 0.0)
        computed = sum(k for _, k in chunks)
        context = sum(start + k for start, k in chunks)
        chunk_flops = sum(s.model.prefill_flops(k, cached=start) for start, k in chunks) / s.tp
        chunk_attn = sum(s.model.prefill_attention_flops(k, cached=start)
                         for start, k in chunks) / s.tp
        lines = over, m0, m1, f0, f1, _ = self._decode_lines(nb)
        # every token of the step, decodes and chunks, goes through one matrix product, each
        # sequence's last through the LM head; then the attention reads the decodes' KV and
        # the chunks' context, or computes
        products, rate = self.prompt_products(nb + computed, nb + len(chunks))
        products = max(self.w_seconds, products)
        ctx_flops = self.flops_per_ctx * (ab + sb * step) / self.per_token
        attention = max(a + sl * step + context * self.bpt / (self.seq_gbps * 1e9),
                        (ctx_flops + chunk_attn) / rate)
        extra = (len(chunks) * self.prefill_req_seconds + computed * self.ar_per_token
                 + sum(start > 0 for start, _ in chunks) * self.chunk_seconds
                 + self.prefill_seconds - self.layer_seconds)   # the step runs as a prefill
        secs = products + attention + over + extra
        nbytes = self.weight_bytes + ab + sb * step + context * self.bpt
        flops = nb * self.flops_per_request + ctx_flops + chunk_flops
        self.floor_margin = min(self.floor_margin, secs * self.peak_bw / nbytes)
        self.compute_margin = min(self.compute_margin, secs * self.card_flops / flops)
        tot["prefill_tokens"] += computed
        if not nb:
            tot["prefill"] += secs
            tot["prefills"] += 1
            return secs
        tot["prefill_chunks"] += secs - (max(m0 + m1 * step, f0 + f1 * step) + over)
        self._count_decode(tot, nb, 1, step, secs, lines)
        return secs

    @staticmethod
    def steps_until(dt: float, c0: float, slope: float, step: int) -> int:
        """Smallest K >= 1 such that steps step .. step + K - 1, the k-th taking
        c0 + slope x k seconds, last at least dt seconds in all."""
        if dt <= 0:
            return 1
        b = c0 + slope * (step - 0.5)
        if slope <= 1e-18 * max(b, 1e-30):
            k = math.ceil(dt / b)
        else:
            a = slope / 2
            k = math.ceil((-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a))
        k = max(1, k)
        while k > 1 and (k - 1) * c0 + slope * ((k - 1) * step + (k - 1) * (k - 2) / 2) >= dt:
            k -= 1
        while k * c0 + slope * (k * step + k * (k - 1) / 2) < dt:
            k += 1
        return k
