"""The engine's forward pass: a transformers model's own modules (embedding, norms, projections,
rotary embedding, MLP, head) around attention over KV in the allocator's pool, one batched step
at a time, optionally replayed from CUDA graphs.

A step packs every token it runs into one matrix: decodes first (one token each), then prompt
chunks that continue a context, then whole prompts. Per layer the step stores the K and V of all
its tokens with one scatter (slots from the run tables, as vLLM's reshape_and_cache) and attends
in at most three calls: the decodes through the run-table decode kernel, the chunks through the
run-table prefill kernel, and each whole prompt through a dense causal attention over its own K
and V (compute-bound: nothing to read back; prompts="dense"), or, with prompts="runs", the
whole prompts with the chunks, as chunks from position 0: one launch a layer for all of them
where the dense attention is a call per prompt. The tables are built once per step on the host
(allocator/serving/engine/kv_runs.py) and moved to the device before the first layer; nothing inside
the layers waits for the host, and the step's one synchronisation is reading its tokens back.

On the Triton path the layers run fused where the model allows (FusedLayers): q, k and v in
one matrix product, gate and up in one, the residual add inside the next RMSNorm, rotary and
the KV store in one kernel, silu and the product in one: about ten launches a layer where
transformers' modules make 35.

Decode-only steps can be captured as CUDA graphs, one per padded batch size (1, 2, 4, 8, then
steps of 8 up to the largest batch, as vLLM pads), over static buffers for ids, positions,
slots and run tables; a step copies its values into them and replays. Padded lanes have no runs
(their attention is zeros) and a negative slot (their K and V are not stored).
"""

from __future__ import annotations

import gc
import importlib
import sys

import numpy as np
import torch

from odma_cli.errors import BadArgument, one_line

from allocator.serving.engine import layer_kernels, run_attention
from allocator.serving.engine.kv_runs import KVPool
from allocator.serving.models import head_dim


def dense_attention():
    """The SDPA backends whole prompts may use: flash, memory-efficient, math, never cuDNN's,
    which builds a plan for every new sequence length (about 40 ms each on an H100 with torch
    2.11, against 0.3 ms for flash): a run whose prompts have hundreds of distinct lengths
    spent seconds there, and only the first run of a process did."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


# how whole prompts attend: a dense causal attention per prompt over its own K and V, or with
# the chunks through the run-table prefill kernel (one launch a layer, K and V read back)
PROMPT_ATTENTION = ("dense", "runs")


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes decode graphs are captured for: 1, 2, 4, 8, then steps of 8."""
    return [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]


class Runner:
    """Batched steps of `model` over the KV in `kv` with attention `backend` ("torch" or
    "triton"), whole prompts attending per `prompts` (PROMPT_ATTENTION); decode steps from CUDA
    graphs when `graphs` is a DecodeGraphs."""

    def __init__(self, model, kv: KVPool, backend: str = "torch", fused: str = "auto",
                 prompts: str = "dense"):
        if prompts not in PROMPT_ATTENTION:
            raise BadArgument(f"--prompt-attention takes {' or '.join(PROMPT_ATTENTION)}, not "
                              f"{prompts!r}")
        self.model = model
        self.dense_prompts = prompts == "dense"
        self.inner = model.model
        self.kv = kv
        self.backend = backend
        mod = importlib.import_module(type(model).__module__)
        self.rope = mod.apply_rotary_pos_emb
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = kv.head_dim
        self.scale = self.head_dim ** -0.5
        self.device = next(model.parameters()).device
        self.graphs = None
        self.fused = FusedLayers.of(model, backend, fused)

    # ------------------------------------------------------------------ tables to the device
    def _host(self, array):
        """A host tensor of `array` that a copy to the device need not wait for (pinned)."""
        t = torch.from_numpy(array)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _to_device(self, array):
        return self._host(array).to(self.device, non_blocking=True)

    def _runs(self, tables):
        return self.run_table(**{f: self._to_device(getattr(tables, f))
                                 for f in run_attention.TABLE_FIELDS})

    def run_table(self, **tensors):
        """A RunTable of these device tensors, with what the kernels may assume of every table:
        no context beyond the pool's longest request, offsets aligned as the allocator aligns."""
        return run_attention.RunTable(**tensors, max_context=self.kv.alloc.max_tokens,
                                      align=self.kv.align)

    # ------------------------------------------------------------------ the layers
    def layers(self, ids, pos, slot, slot_cap, attend):
        """The decoder stack over the packed token ids at positions `pos` (device tensors, [N]),
        storing each token's K and V at its slot, attention by attend(layer, q, k, v) -> o (each
        [N, heads, head_dim]); the final norm's output [N, hidden]."""
        if self.fused is not None:
            return self.fused.layers(self, ids, pos, slot, slot_cap, attend)
        x = self.inner.embed_tokens(ids)[None]
        cos, sin = self.inner.rotary_emb(x, pos[None])
        n, D = ids.shape[0], self.head_dim
        step = {}                          # what every layer's store of this step shares
        for layer, block in enumerate(self.inner.layers):
            attn = block.self_attn
            h = block.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, -1, D).transpose(1, 2)
            k = attn.k_proj(h).view(1, n, -1, D).transpose(1, 2)
            v = attn.v_proj(h).view(1, n, -1, D)[0]
            q, k = self.rope(q, k, cos, sin)
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
            run_attention.store_kv(self.kv.flat, k, v, slot, slot_cap, layer, self.kv_heads, D,
                                   backend=self.backend, align=self.kv.align, cache=step)
            o = attend(layer, q, k, v)
            x = x + attn.o_proj(o.reshape(1, n, -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.inner.norm(x)[0]

    def _decode_attend(self, runs, n_dec):
        """attend() for the first n_dec rows of a step, decodes over `runs`."""
        def attend(layer, q, k, v):
            return run_attention.decode_attention(q[:n_dec], self.kv.flat, runs, layer,
                                                  self.kv_heads, self.head_dim, self.scale,
                                                  backend=self.backend)
        return attend

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def forward(self, batch):
        """One step over `batch`: (request i, its next token ids, the position of the first); a
        decode is one token after its context, a prompt chunk several after one, a whole prompt
        starts at 0. The logits of each one's last token, (len(batch), vocab), in batch order."""
        sizes = [len(ids) for _, ids, _ in batch]
        kind = [0 if start and n == 1 else 1 if start or not self.dense_prompts else 2
                for (_, _, start), n in zip(batch, sizes)]
        order = sorted(range(len(batch)), key=kind.__getitem__)
        batch = [batch[j] for j in order]
        sizes = [sizes[j] for j in order]
        kinds = [kind[j] for j in order]
        n_dec, n_chunk = kinds.count(0), kinds.count(1)
        if n_dec == len(batch) and self.graphs is not None:
            logits = self.graphs.decode(batch)
            if logits is not None:
                return self._unorder(logits, order)
        ends = np.cumsum(sizes)
        ids = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for _, t, _ in batch])
        pos = np.concatenate([np.arange(s, s + n, dtype=np.int64)
                              for (_, _, s), n in zip(batch, sizes)])
        writers = [(i, s, n) for (i, _, s), n in zip(batch, sizes)]
        dec = self.kv.step_tables([(i, s + 1) for i, _, s in batch[:n_dec]], writers)
        runs_dec = self._runs(dec) if n_dec else None
        chunk = batch[n_dec:n_dec + n_chunk]
        runs_chunk = (self._runs(self.kv.step_tables(
            [(i, s + n) for (i, _, s), n in zip(chunk, sizes[n_dec:])], []))
            if n_chunk else None)
        q_start = np.asarray(ends[n_dec:n_dec + n_chunk] - sizes[n_dec:n_dec + n_chunk]
                             - (ends[n_dec - 1] if n_dec else 0), dtype=np.int32)
        chunk_q = tuple(self._to_device(np.asarray(a, dtype=np.int32)) for a in (
            q_start, sizes[n_dec:n_dec + n_chunk], [s for _, _, s in chunk]))
        chunk_rows = slice(int(ends[n_dec - 1]) if n_dec else 0,
                           int(ends[n_dec + n_chunk - 1]) if n_chunk else 0)
        longest_chunk = max(sizes[n_dec:n_dec + n_chunk], default=0)
        prompts = [(int(e - n), int(e)) for e, n, k in zip(ends, sizes, kinds) if k == 2]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        decode = self._decode_attend(runs_dec, n_dec)

        def attend(layer, q, k, v):
            if n_dec == len(batch):          # a decode-only step: no rows to put together
                return decode(layer, q, k, v)
            o = torch.empty_like(q)
            if n_dec:
                o[:n_dec] = decode(layer, q, k, v)
            if n_chunk:                  # every row of chunk_rows is a chunk's
                run_attention.prefill_attention(
                    q[chunk_rows], self.kv.flat, runs_chunk, *chunk_q, layer, self.kv_heads,
                    self.head_dim, self.scale, o[chunk_rows], backend=self.backend,
                    max_q_len=longest_chunk)
            if prompts:                  # whole prompts: their own K and V, no read back
                with dense_attention():
                    for a, b in prompts:
                        o[a:b] = sdpa(q[None, a:b].transpose(1, 2), k[None, a:b].transpose(1, 2),
                                      v[None, a:b].transpose(1, 2), is_causal=b - a > 1,
                                      enable_gqa=True)[0].transpose(0, 1)
            return o

        hidden = self.layers(self._to_device(ids), self._to_device(pos),
                             self._to_device(dec.slot), self._to_device(dec.slot_cap), attend)
        logits = self.model.lm_head(hidden[torch.from_numpy(ends - 1).to(self.device)])
        return self._unorder(logits, order)

    def prefill(self, batch):
        """Run each (request i, its token ids) of `batch` causally from position 0."""
        return self.forward([(i, ids, 0) for i, ids in batch])

    def decode(self, ids, positions, requests):
        """One decode step: token ids[b] of request requests[b] at position positions[b];
        (batch, vocab) logits."""
        return self.forward([(i, [t], p) for t, p, i in zip(ids, positions, requests)])

    @staticmethod
    def _unorder(logits, order):
        """The rows of a step run in `order` back in the batch's order."""
        if order == sorted(order):
            return logits
        return logits[torch.from_numpy(np.argsort(order)).to(logits.device)]


def check_fused(fused: str, backend: str) -> None:
    """BadArgument, in one line, for a --fused-layers value (auto, on, off) that cannot be had
    with this attention backend: the fused layers run on the Triton path only."""
    if fused not in ("auto", "on", "off"):
        raise BadArgument(f"--fused-layers takes auto, on or off, not {fused!r}")
    if fused == "on" and backend != "triton":
        raise BadArgument(f"--fused-layers on needs the Triton kernels (here: {backend} "
                          "attention)")


class FusedLayers:
    """A decoder stack of q/k/v, o, gate/up, down projections, RMSNorms and rotary (Llama,
    Qwen2, Mistral) run in about ten launches a layer on the Triton path: q, k, v joined into
    one matrix (and gate, up into another), the residual add inside the next RMSNorm, rotary
    and the KV store in one kernel, silu(gate) * up in one. At a decode batch each launch is a
    few microseconds of an idle GPU, inside a CUDA graph too, so the count is the step's time.
    The modules' own parameters become views of the joined matrices: no second copy of the
    weights, and transformers' forward (the hf policy, --check's reference) reads the same
    values."""

    def __init__(self, model):
        inner = model.model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.inner = inner
        self.final = inner.norm
        self.blocks = []
        with torch.no_grad():
            for block in inner.layers:
                a, m = block.self_attn, block.mlp
                qkv_w, qkv_b = self._join([a.q_proj, a.k_proj, a.v_proj])
                gu_w, gu_b = self._join([m.gate_proj, m.up_proj])
                self.blocks.append((block.input_layernorm, qkv_w, qkv_b, a.o_proj,
                                    block.post_attention_layernorm, gu_w, gu_b, m.down_proj))

    @staticmethod
    def why_not(model) -> str | None:
        """Why this model's layers cannot run fused (None: they can)."""
        cfg = model.config
        if getattr(cfg, "hidden_act", None) != "silu":
            return f"its activation is {getattr(cfg, 'hidden_act', None)!r}, not silu"
        inner = getattr(model, "model", None)
        rot = getattr(inner, "rotary_emb", None)
        if rot is None or getattr(rot, "inv_freq", None) is None \
                or rot.inv_freq.numel() * 2 != head_dim(cfg):
            return "its rotary embedding does not turn the whole head"
        want = {"self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"},
                "mlp": {"gate_proj", "up_proj", "down_proj", "act_fn"}}
        for block in inner.layers:
            for part, names in want.items():
                have = {n for n, _ in getattr(block, part).named_children()}
                if have != names:
                    return f"its {part} has {sorted(have)}, not {sorted(names)}"
            norms = (block.input_layernorm, block.post_attention_layernorm)
            if any(not hasattr(n, "variance_epsilon") or n.weight.dim() != 1 for n in norms):
                return "its norms are not RMSNorms"
            a, m = block.self_attn, block.mlp
            for group in ((a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)):
                if len({g.bias is None for g in group}) > 1:
                    return "only some of its joined projections have biases"
        return None

    @classmethod
    def of(cls, model, backend: str, fused: str):
        """The model's FusedLayers (made once a model) where `fused` ("auto", "on", "off") and
        the backend allow: "auto" fuses on the Triton path where the model fits; "on" refuses
        in one line where it cannot."""
        check_fused(fused, backend)
        if fused == "off" or backend != "triton":       # the torch path runs the modules
            return None
        why = cls.why_not(model)
        if why is not None:
            if fused == "on":
                raise BadArgument(f"--fused-layers on: not for this run: {why}")
            return None
        made = getattr(model, "_odma_fused_layers", None)
        if made is None:
            made = cls(model)
            model._odma_fused_layers = made
        return made

    @staticmethod
    def _join(linears):
        """One weight (and bias) of the linears stacked by output rows; each linear's parameters
        become views of it."""
        w = torch.cat([lin.weight for lin in linears])
        b = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        at = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = torch.nn.Parameter(w[at:at + rows], requires_grad=False)
            if b is not None:
                lin.bias = torch.nn.Parameter(b[at:at + rows], requires_grad=False)
            at += rows
        return w, b

    def layers(self, runner, ids, pos, slot, slot_cap, attend):
        """Runner.layers on the fused path."""
        linear = torch.nn.functional.linear
        H, KVH, D = self.heads, self.kv_heads, runner.head_dim
        kv = runner.kv
        x = self.inner.embed_tokens(ids)               # the residual stream, [N, hidden]
        cos, sin = self.inner.rotary_emb(x[None], pos[None])
        cos, sin = cos[0], sin[0]
        n = ids.shape[0]
        h = torch.empty_like(x)
        delta = None
        for layer, (norm_in, qkv_w, qkv_b, o_proj, norm_post, gu_w, gu_b, down) in enumerate(
                self.blocks):
            layer_kernels.add_rms_norm_triton(x, delta, norm_in.weight, norm_in.variance_epsilon,
                                              h)
            qkv = linear(h, qkv_w, qkv_b)
            layer_kernels.rope_store_triton(qkv, cos, sin, kv.flat, slot, slot_cap, layer, H,
                                            KVH, D, kv.align)
            q = qkv[:, :H * D].view(n, H, D)
            k = qkv[:, H * D:(H + KVH) * D].view(n, KVH, D)
            v = qkv[:, (H + KVH) * D:].view(n, KVH, D)
            o = attend(layer, q, k, v)
            layer_kernels.add_rms_norm_triton(x, linear(o.reshape(n, H * D), o_proj.weight,
                                                        o_proj.bias),
                                              norm_post.weight, norm_post.variance_epsilon, h)
            gu = linear(h, gu_w, gu_b)
            act = layer_kernels.silu_mul_triton(gu, gu.new_empty(n, gu.shape[1] // 2))
            delta = linear(act, down.weight, down.bias)
        layer_kernels.add_rms_norm_triton(x, delta, self.final.weight,
                                          self.final.variance_epsilon, h)
        return h


class DecodeGraphs:
    """CUDA graphs of decode-only steps, one per padded batch size, sharing one memory pool;
    each step stages its ids, positions, slots and run tables in one pinned host buffer, copies
    them into the static device buffers (views of one device buffer of the same layout: the
    per-request values in one copy, each run array's used part in one) and replays the graph
    of the smallest size that holds it. A step whose tables outgrow the buffers runs eagerly
    (decode() returns None)."""

    def __init__(self, runner: Runner, max_batch: int, max_runs: int):
        self.runner = runner
        dev = runner.device
        self.sizes = graph_sizes(max_batch)
        top = self.sizes[-1]
        self.max_runs = max_runs
        i32, i64 = torch.int32, torch.int64
        # the per-request fields first (copied whole), then the run arrays (their used part)
        fields = [("ids", i64, top), ("pos", i64, top), ("slot", i64, top),
                  ("slot_cap", i64, top), ("run_start", i32, top + 1), ("ctx_len", i32, top),
                  ("run_off", i64, max_runs), ("run_cap", i32, max_runs),
                  ("run_len", i32, max_runs), ("run_pos", i32, max_runs)]
        at, spans = 0, {}
        for name, dtype, n in fields:
            spans[name] = (at, dtype, n)
            at += -(-n * dtype.itemsize // STAGE_ALIGN) * STAGE_ALIGN
        self.per_request_bytes = spans["run_off"][0]        # where the run arrays start
        self.host_bytes = torch.zeros(at, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self.device_bytes = torch.zeros(at, dtype=torch.uint8, device=dev)
        self.staged, self.on_device, self.on_host = {}, {}, {}
        for name, (a, dtype, n) in spans.items():
            self.staged[name] = self.host_bytes[a:a + n * dtype.itemsize].view(dtype)
            self.on_device[name] = self.device_bytes[a:a + n * dtype.itemsize].view(dtype)
            self.on_host[name] = self.staged[name].numpy()      # the same bytes, for numpy
        self.on_host["slot"][:] = -1
        self.on_host["slot_cap"][:] = 1
        self.on_host["run_cap"][:] = 1
        self.device_bytes.copy_(self.host_bytes)
        # the staged values of a step are not written over before its copies are done
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.graphs: dict = {}
        self.logits: dict = {}
        self.pool = None

    def _static(self, size):
        t = self.on_device
        return self.runner.run_table(
            run_start=t["run_start"][:size + 1], run_off=t["run_off"], run_cap=t["run_cap"],
            run_len=t["run_len"], run_pos=t["run_pos"], ctx_len=t["ctx_len"][:size])

    def _forward(self, size):
        r, t = self.runner, self.on_device
        hidden = r.layers(t["ids"][:size], t["pos"][:size], t["slot"][:size],
                          t["slot_cap"][:size], r._decode_attend(self._static(size), size))
        return r.model.lm_head(hidden)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every size, largest first (the later graphs reuse the first one's memory).
        The buffers hold an empty batch meanwhile: no KV is stored, none read."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in self.sizes:    # warm-up: every size's kernels compiled before capture
                self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[size] = self._forward(size)
            self.pool = g.pool() if self.pool is None else self.pool
            self.graphs[size] = g

    def decode(self, batch):
        """Logits of a decode-only batch [(request, [token id], position)] from the graph of its
        padded size, or None when its run tables do not fit the static buffers."""
        r = self.runner
        n = len(batch)
        tables = r.kv.step_tables([(i, s + 1) for i, _, s in batch],
                                  [(i, s, 1) for i, _, s in batch])
        if tables.run_off.size > self.max_runs:
            return None
        size = next(s for s in self.sizes if s >= n)
        if self.copied is not None:
            self.copied.synchronize()
        h = self.on_host
        h["ids"][:n] = [int(t[0]) for _, t, _ in batch]
        h["pos"][:n] = [s for _, _, s in batch]
        # padded lanes: no slot (their K and V are not stored), no runs (attention zeros)
        h["slot"][:size] = -1
        h["slot"][:n] = tables.slot
        h["slot_cap"][:n] = tables.slot_cap
        h["run_start"][:size + 1] = tables.run_start[-1]
        h["run_start"][:n + 1] = tables.run_start
        h["ctx_len"][:size] = 0
        h["ctx_len"][:n] = tables.ctx_len
        runs = tables.run_off.size
        per_request = self.per_request_bytes
        self.device_bytes[:per_request].copy_(self.host_bytes[:per_request], non_blocking=True)
        for f in ("run_off", "run_cap", "run_len", "run_pos"):
            h[f][:runs] = getattr(tables, f)
            self.on_device[f][:runs].copy_(self.staged[f][:runs], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.graphs[size].replay()
        return self.logits[size][:n]


CAPTURE_TRIES = 2
STAGE_ALIGN = 16         # bytes: each static input starts aligned as Triton assumes pointers


def make_graphs(runner: Runner, max_batch: int, max_runs: int, warn=None):
    """Decode graphs for `runner`, or None (with one line to `warn`) when capture fails twice:
    the engine then runs every step eagerly. The garbage collector is run before a capture and
    kept from running during it: a tensor freed then (pinned host memory of an earlier step,
    whose free queries CUDA events) invalidates the capture, as it did on an H100 once."""
    why = None
    for _ in range(CAPTURE_TRIES):
        graphs = DecodeGraphs(runner, max_batch, max_runs)
        gc.collect()
        gc.disable()
        try:
            torch.cuda.synchronize()
            graphs.capture()
        except Exception as exc:     # (CUDA, out of memory, a kernel that fails to compile)
            why = one_line(exc, 200) or type(exc).__name__
            continue
        finally:
            gc.enable()
        runner.graphs = graphs
        return graphs
    print(f"odma-hw engine: CUDA graph capture failed ({why}); running eagerly",
          file=warn or sys.stderr)
    return None
