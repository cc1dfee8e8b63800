"""A real engine: a decoder-only transformer (a Hugging Face Llama, Qwen2 or Mistral, built with
transformers) serves a request trace on a torch device with continuous batching, every KV byte
in blocks of a KV allocator and every decision made by the Scheduler the simulation uses, so the
engine and `simulate` can differ in time, never in decisions.

- Model: a config.json (a file, a directory holding one and, optionally, safetensors weights, or
  the name of a config shipped in allocator/serving/configs). Without weights, random weights
  from a seed, spread so that outputs stay varied (transformers' own initialisation, std 0.02,
  gives logits so flat that greedy decoding repeats one token and ties are everywhere).
- Prompts: token ids drawn per request from a seeded generator (traces carry lengths, not
  text); greedy decoding of exactly the trace's number of tokens (end-of-sequence ignored).
- KV: contiguous policies keep a request's KV in its block head-major, [layers, 2 (K, V),
  kv_heads, capacity, head_dim]: each (layer, K/V, head) is one run of ctx x head_dim, read by
  attention as a view (no copy). Since a token's place depends on the capacity, a migration is
  the engine's own copy (the allocator's grow(copy=...)). The paged policy keeps page p of the
  pool as [layers, 2, kv_heads, page_tokens, head_dim]; attention gathers a request's pages
  through its block table.
- Steps: every step is one forward pass (Runner.forward) over what the Scheduler put in it:
  prefill-first, the prompts admitted together (and, after a preemption, the tokens each had
  made), or one token of every running request; chunked (max_batched_tokens), one token of
  every running request and the prompt chunks riding with them. All the step's tokens go
  through the projections and MLPs as one packed batch; each request attends over its own KV.
- The check (check=True): transformers' own forward of the model over each request's prompt and
  the tokens the engine made (what generate() runs, one position at a time), compared position
  by position: the chosen token, and the logits at the engine's top LOGIT_CHECK_K tokens. Where
  the reference's best two logits are within near_tie, a different token is a near tie, not a
  mismatch.
"""

from __future__ import annotations

import importlib
import math
import pathlib
import time

import numpy as np

from odma_hw.errors import BadArgument

from allocator.config import AllocatorConfig
from allocator.errors import OutOfMemory
from allocator.policies import make_allocator
from allocator.predictors import make_predictor
from allocator.serving.engine import RequestState
from allocator.serving.models import DTYPES, head_dim, kv_bytes_per_token, need
from allocator.serving.scheduler import Scheduler, check_scheduling

import torch  # noqa: E402  (only `odma-hw engine` imports this module: torch is its to need)

LOGIT_CHECK_K = 16


def build_model(config, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                weights=None):
    """The model of `config` on a torch device, in eval mode: the weights in `weights` (a
    directory of safetensors), else random ones from `seed`."""
    transformers = need("transformers", "engine")
    if dtype not in DTYPES:
        raise BadArgument(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if weights is not None:
        _load_weights(model, weights)
    else:
        _spread(model, seed)
    return model.eval()


def _spread(model, seed: int) -> None:
    """Random weights whose activations keep unit scale through the layers: matrices ~
    N(0, 1 / fan_in), embeddings ~ N(0, 1), biases ~ N(0, 0.1), norms 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 2:
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _load_weights(model, folder) -> None:
    safetensors = need("safetensors.torch", "engine")
    state = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        state.update(safetensors.load_file(str(f)))
    if model.config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise BadArgument(f"the weights in {folder} do not match the config: "
                          f"{' '.join(first[:2])[:300]}") from None


class BlockKV:
    """Each request's K and V of every layer, in its allocator block (see the module docstring
    for the layouts)."""

    def __init__(self, alloc, config, dtype):
        self.alloc = alloc
        self.dtype = dtype
        self.layers = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.paged = hasattr(alloc, "page_tokens")
        self.device = alloc.pool_tensor().device
        self._views: dict = {}           # request -> (its block, the block's KV view)
        if self.paged:
            T = alloc.page_tokens
            used = T * alloc.bytes_per_token
            pool = alloc.pool_tensor()[:alloc.n_pages * alloc.page_bytes]
            self.pages = pool.view(alloc.n_pages, alloc.page_bytes)[:, :used].view(dtype).view(
                alloc.n_pages, self.layers, 2, self.kv_heads, T, self.head_dim)

    def _pieces(self, i, blk=None):
        """Request i's KV in its live block (or in `blk`), as _views_of gives it. The block is
        looked up in the allocator every time, so views kept of a released or migrated-away
        block are never read, only replaced; an extent block's are renewed when it gains an
        extent."""
        blk = blk if blk is not None else self.alloc.block(i)
        extents = getattr(blk, "extents", None)
        got = self._views.get(i)
        if got is None or got[0] is not blk or got[1] is not extents:
            got = self._views[i] = (blk, extents, self._views_of(blk))
        return got[2]

    def _views_of(self, blk):
        """[(first token, tokens, view of shape (layers, 2, kv_heads, tokens, head_dim))], one
        piece per contiguous range of `blk` (a block is one, an extent block one per extent), in
        token order."""
        shape = (self.layers, 2, self.kv_heads)
        extents = getattr(blk, "extents", None)
        if extents is None:
            return [(0, blk.capacity_tokens,
                     blk.tensor(self.dtype, shape + (blk.capacity_tokens, self.head_dim)))]
        pieces, first = [], 0
        for k, (_, _, tokens, _) in enumerate(extents):
            pieces.append((first, tokens,
                           blk.extent_tensor(k, self.dtype, shape + (tokens, self.head_dim))))
            first += tokens
        return pieces

    def write(self, i, layer: int, start: int, k, v) -> None:
        """Store K and V, each (kv_heads, n, head_dim), at positions [start, start + n)."""
        n = k.shape[1]
        if self.paged:
            T = self.alloc.page_tokens
            pos = torch.arange(start, start + n)
            page = torch.tensor(self.alloc.block(i).pages, dtype=torch.int64)[pos // T]
            slot = pos % T
            self.pages[page, layer, 0, :, slot] = k.transpose(0, 1)
            self.pages[page, layer, 1, :, slot] = v.transpose(0, 1)
            return
        end = start + n
        for first, tokens, view in self._pieces(i):
            lo, hi = max(start, first), min(end, first + tokens)
            if lo < hi:
                view[layer, 0, :, lo - first:hi - first] = k[:, lo - start:hi - start]
                view[layer, 1, :, lo - first:hi - first] = v[:, lo - start:hi - start]

    def read(self, i, layer: int, ctx: int):
        """(K, V) of positions [0, ctx), each (kv_heads, ctx, head_dim): views of the block;
        from extents, one run per (extent, K/V, head), joined; paged, gathered from the pages
        of the block table."""
        if self.paged:
            T = self.alloc.page_tokens
            table = torch.tensor(self.alloc.block(i).pages[:-(-ctx // T)], dtype=torch.int64)
            kv = self.pages[table, layer]                    # (pages, 2, kv_heads, T, D)
            kv = kv.permute(1, 2, 0, 3, 4).reshape(2, self.kv_heads, -1, self.head_dim)
            return kv[0, :, :ctx], kv[1, :, :ctx]
        parts = [view[layer, :, :, :min(tokens, ctx - first)]
                 for first, tokens, view in self._pieces(i) if first < ctx]
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return kv[0], kv[1]

    def save(self, i, tokens: int) -> list:
        """A host copy of request i's KV of positions [0, tokens): per layer (2, kv_heads,
        tokens, head_dim) (a swap-out)."""
        return [torch.stack(self.read(i, layer, tokens)).to("cpu", copy=True)
                for layer in range(self.layers)]

    def load(self, i, saved: list) -> None:
        """Write a host copy save() made back into request i's (new) block (a swap-in)."""
        for layer, kv in enumerate(saved):
            kv = kv.to(self.device)
            self.write(i, layer, 0, kv[0], kv[1])

    def migrate(self, old, new) -> None:
        """The allocator's copy of a migration (or an extent merge): the first `written` tokens
        of every run, each to its place in the new block."""
        n = min(old.written // self.alloc.bytes_per_token, old.capacity_tokens)
        dst = self._views_of(new)          # not the request's block until the switch
        for first, tokens, src in self._pieces(old.request_id, old):
            for to, room, view in dst:
                lo, hi = max(first, to), min(first + tokens, to + room, n)
                if lo < hi:
                    view[:, :, :, lo - to:hi - to] = src[:, :, :, lo - first:hi - first]


# ----------------------------------------------------------------------------- forward passes
class Runner:
    """The model's forward, with attention over KV in blocks: the model's own modules (norms,
    projections, rotary embedding, MLP, head) around each request's attention."""

    def __init__(self, model, kv: BlockKV):
        self.model = model
        self.inner = model.model
        self.kv = kv
        mod = importlib.import_module(type(model).__module__)
        self.rope = mod.apply_rotary_pos_emb
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.head_dim = kv.head_dim
        self.device = next(model.parameters()).device

    def _qkv(self, attn, h, cos, sin):
        b, n, _ = h.shape
        D = self.head_dim
        q = attn.q_proj(h).view(b, n, -1, D).transpose(1, 2)
        k = attn.k_proj(h).view(b, n, -1, D).transpose(1, 2)
        v = attn.v_proj(h).view(b, n, -1, D).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        return q, k, v

    def _layers(self, x, positions, attend):
        """The decoder stack over hidden states x (batch, tokens, hidden) at `positions`, each
        layer's attention by attend(layer, q, k, v) -> (batch, heads, tokens, head_dim); the
        final norm's output."""
        cos, sin = self.inner.rotary_emb(x, positions)
        for layer, block in enumerate(self.inner.layers):
            attn = block.self_attn
            q, k, v = self._qkv(attn, block.input_layernorm(x), cos, sin)
            o = attend(layer, q, k, v)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.inner.norm(x)

    @torch.no_grad()
    def forward(self, batch):
        """One step over `batch`: (request i, its next token ids, the position of the first):
        a decode is one token after its context, a prefill or a prompt chunk several. Every
        token of the step goes through the projections and MLPs as one packed matrix product
        (as a serving engine packs a step); each request's tokens store their K and V in its
        block and attend causally over its KV up to them. The logits of each one's last token,
        (len(batch), vocab)."""
        sizes = [ids.numel() for _, ids, _ in batch]
        ends = np.cumsum(sizes)
        x = self.inner.embed_tokens(torch.cat([ids for _, ids, _ in batch])[None].to(self.device))
        pos = torch.cat([torch.arange(start, start + n) for (_, _, start), n in
                         zip(batch, sizes)])[None].to(self.device)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def attend(layer, q, k, v):
            out = []
            for (i, _, start), end, n in zip(batch, ends, sizes):
                part = slice(end - n, end)
                self.kv.write(i, layer, start, k[0, :, part], v[0, :, part])
                if start == 0:         # a whole prompt: its own K and V, no read back
                    K, V, mask, causal = k[:, :, part], v[:, :, part], None, n > 1
                else:                  # what its block holds, the new tokens included
                    K, V = (t[None] for t in self.kv.read(i, layer, start + n))
                    mask, causal = (None if n == 1 else torch.ones(
                        n, start + n, dtype=torch.bool, device=self.device).tril(start)), False
                out.append(sdpa(q[:, :, part], K, V, attn_mask=mask, is_causal=causal,
                                enable_gqa=True))
            return torch.cat(out, dim=2)
        return self.model.lm_head(self._layers(x, pos, attend)[0, ends - 1])

    def prefill(self, batch):
        """Run each (request i, its token ids) of `batch` causally from position 0."""
        return self.forward([(i, ids, 0) for i, ids in batch])

    def decode(self, ids, positions, requests):
        """One decode step: token ids[b] of request requests[b] at position positions[b];
        (batch, vocab) logits."""
        return self.forward([(i, torch.tensor([t]), p)
                             for t, p, i in zip(ids, positions, requests)])


# ----------------------------------------------------------------------------- serving
def prompt_ids(n_requests: int, lengths, vocab: int, seed: int) -> list:
    """Token ids of each prompt, from a seeded generator (ids 3.. to stay clear of the
    special tokens most vocabularies put first)."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(3, vocab, int(n))) for n in lengths[:n_requests]]


def serve(model, prompts: list, gen: list, arrivals, policy: str, *, pool_bytes: int,
          max_model_len: int, max_batch: int = 256, max_prefill: int = 0, page_tokens: int = 16,
          predictor: str = "online", seed: int = 0, config: AllocatorConfig | None = None,
          max_batched_tokens: int | None = None, concurrency: int | None = None,
          preemption: str = "recompute", swap_bytes: int = 0, cobatch: int = 0,
          progress=None, log: list | None = None, keep_logits: bool = False) -> dict:
    """Serve the requests (prompt token ids, tokens to make, arrival seconds from the start) with
    `policy`, prefill-first or chunked (max_batched_tokens), open or closed loop (concurrency),
    a preempted request recomputed or swapped to host memory (swap_bytes of it), co-batching
    by bucket tag over a window of `cobatch` waiting requests (0: off); their tokens,
    times, and the allocator's and scheduler's counts."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    spec = f"torch:{dev}"
    n = len(prompts)
    reqs = [RequestState(i, int(prompts[i].numel()), int(gen[i]), float(arrivals[i]))
            for i in range(n)]
    bpt = kv_bytes_per_token(model.config, str(dtype).removeprefix("torch."))
    check_scheduling(max_batch, max_batched_tokens, concurrency, preemption=preemption,
                     swap_bytes=swap_bytes, cobatch=cobatch)
    alloc = make_allocator(policy, spec, pool_bytes, bpt, max_model_len,
                           config or AllocatorConfig(background_refresh=False),
                           page_tokens=page_tokens)
    try:
        kv = BlockKV(alloc, model.config, dtype)
        sched = Scheduler(alloc, make_predictor("oracle" if policy == "oracle" else predictor,
                                                seed=seed), reqs,
                          max_batch=max_batch, max_prefill=max_prefill or max(max_model_len, 2048),
                          bytes_per_token=bpt, migrate=None if kv.paged else kv.migrate, log=log,
                          max_batched_tokens=max_batched_tokens, concurrency=concurrency,
                          preemption=preemption, swap_bytes=swap_bytes, cobatch=cobatch)
        host: dict = {}                # swapped requests' KV
        sched.swap_out = lambda i, r, tokens: host.__setitem__(i, kv.save(i, tokens))
        sched.swap_in = lambda i, r, tokens: kv.load(i, host.pop(i))
        return _Serving(Runner(model, kv), sched, prompts, keep_logits).run(progress)
    finally:
        alloc.close()


class _Serving:
    """The engine's loop: the Scheduler decides, the Runner executes, one step at a time."""

    def __init__(self, runner, sched, prompts, keep_logits):
        self.runner = runner
        self.sched = sched
        self.prompts = prompts
        self.keep_logits = keep_logits
        n = len(prompts)
        self.made = [[] for _ in range(n)]      # tokens made, kept across preemptions
        self.top = [[] for _ in range(n)]       # (values, indices) of the top logits per token
        self.steps = self.batch_sum = self.peak_batch = 0
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def emit(self, i, logits) -> None:
        self.made[i].append(int(torch.argmax(logits)))
        if self.keep_logits:
            v, ix = torch.topk(logits.float(), min(LOGIT_CHECK_K, logits.numel()))
            self.top[i].append((v.cpu(), ix.cpu()))

    def context(self, i):
        """Request i's context: its prompt and, after a preemption, every token it made."""
        p = self.prompts[i]
        return torch.cat([p, torch.tensor(self.made[i], dtype=p.dtype)])

    def prefilled(self, i, r, t) -> None:
        """Request i's prefill completed (its first token made): it finishes, or joins the
        decodes, or is preempted."""
        sched = self.sched
        if sched.made_first_token(i, r, t):
            sched.finish(i, r, t)
            return
        try:
            sched.run_on(i, r)
        except OutOfMemory:
            sched.preempt(i, r)

    def decoded(self, ids, t) -> None:
        """The running requests `ids` each made a token: completions, then growth for the next
        token's slot, in request order."""
        sched, reqs = self.sched, self.sched.reqs
        for i in ids:
            r = reqs[i]
            if r.made >= r.gen:
                sched.finish(i, r, t)
        for i in ids:
            r = reqs[i]
            if i in sched.running and r.prompt + r.made + 1 > \
                    sched.alloc.block(i).capacity_tokens:
                try:
                    sched.grow(i, r.prompt + r.made + 1)
                except OutOfMemory:
                    sched.preempt(i, r)

    def step(self) -> bool:
        """One prefill iteration or one (decode or mixed) step; whether anything ran."""
        sched, reqs, made = self.sched, self.sched.reqs, self.made
        running = sched.running
        chunks = []
        if not sched.chunked and sched.waiting and len(running) < sched.max_batch:
            admitted, _ = sched.admit(self.now())
            if admitted or sched.resuming:
                batch = [(i, self.context(i), 0) for i, _, _, _ in admitted]
                if batch:
                    for (i, _, _), logits in zip(batch, self.runner.forward(batch)):
                        self.emit(i, logits)
                t = self.now()
                for i, r, _, _ in admitted:
                    self.prefilled(i, r, t)
                sched.resume()
                self.peak_batch = max(self.peak_batch, len(running))
                return True
        elif sched.chunked:
            chunks, _, _ = sched.chunks(self.now())
        ids = sorted(running)
        if not ids and not chunks:
            came_back = bool(sched.resuming)   # (or, a copy failing, went back to the queue)
            sched.resume()
            return came_back
        # each decode feeds its last token, at the position after its context
        batch = [(i, torch.tensor(made[i][-1:]), reqs[i].prompt + reqs[i].made - 1)
                 for i in ids]
        batch += [(i, self.context(i)[start:start + k], start) for i, _, start, k in chunks]
        logits = self.runner.forward(batch)
        for j, i in enumerate(ids):
            self.emit(i, logits[j])
            reqs[i].made += 1
        if ids:
            self.steps += 1
            self.batch_sum += len(ids)
        t = self.now()
        self.decoded(ids, t)
        for j, (i, r, _, k) in enumerate(chunks):
            if sched.chunk_done(i, r, k):
                self.emit(i, logits[len(ids) + j])
                self.prefilled(i, r, t)
        sched.resume()
        self.peak_batch = max(self.peak_batch, len(running))
        return True

    def run(self, progress) -> dict:
        sched = self.sched
        n = len(sched.reqs)
        last_progress = time.perf_counter()
        while sched.done < n:
            sched.arrive(self.now())
            if not self.step():
                t = sched.next_send()
                if t is None:
                    raise RuntimeError("engine stalled: requests wait and nothing runs")
                time.sleep(max(0.0, min(0.05, t - self.now())))
                continue
            if progress and time.perf_counter() - last_progress > 1.0:
                last_progress = time.perf_counter()
                progress(sched.done, n, self.now())
        alloc, tot = sched.alloc, sched.tot
        return {"requests": sched.reqs, "tokens": self.made,
                "top_logits": self.top if self.keep_logits else None,
                "seconds": self.now(), "steps": self.steps, "batch_sum": self.batch_sum,
                "peak_batch": self.peak_batch, "preemptions": int(tot["preemptions"]),
                "allocator": alloc.stats(), "used_tokens": alloc.used_tokens_sum,
                "reserved_tokens": alloc.reserved_tokens_sum}


# ----------------------------------------------------------------------------- the check
def check_tokens(model, prompts: list, tokens: list, top: list, *, near_tie: float = 1e-3,
                 logit_rtol: float | None = None) -> dict:
    """Compare what the engine made with transformers' forward of the model over each request's
    prompt and the engine's tokens (teacher forced, so that a near tie does not derail the rest
    of the request). A request mismatches when a token differs from the reference's choice
    where the reference's best two logits are more than `near_tie` apart, or when a logit at
    the engine's top-LOGIT_CHECK_K tokens differs by more than logit_rtol x (1 + the position's
    largest logit) (default 1e-4 for float32, 3e-2 for bfloat16)."""
    dtype = next(model.parameters()).dtype
    if logit_rtol is None:
        logit_rtol = 1e-4 if dtype == torch.float32 else 3e-2
    dev = next(model.parameters()).device
    mismatches = near_ties = 0
    worst = 0.0
    for p, toks, tops in zip(prompts, tokens, top or [None] * len(tokens)):
        seq = torch.cat([p, torch.tensor(toks, dtype=p.dtype)])[None].to(dev)
        with torch.no_grad():
            ref = model(seq).logits[0, p.numel() - 1:p.numel() - 1 + len(toks)].float().cpu()
        two = torch.topk(ref, 2).values
        bad = False
        for j, tok in enumerate(toks):
            if tok != int(torch.argmax(ref[j])):
                if float(two[j, 0] - two[j, 1]) <= near_tie:
                    near_ties += 1
                else:
                    bad = True
            if tops is None:                   # a run that kept no logits (hf): tokens only
                continue
            values, index = tops[j]
            diff = float((values - ref[j, index]).abs().max())
            worst = max(worst, diff)
            if diff > logit_rtol * (1.0 + float(ref[j].abs().max())):
                bad = True
        mismatches += bad
    return {"mismatches": mismatches, "near_ties": near_ties,
            "max_logit_diff": worst if top is not None else None,
            "near_tie": near_tie, "logit_rtol": logit_rtol}


# ----------------------------------------------------------------------------- a whole run
def summarise(policy: str, run: dict, setup: dict) -> dict:
    """The result object of one policy, with simulate's metric names."""
    from allocator.serving.metrics import percentiles

    reqs = run["requests"]
    span = max(run["seconds"], 1e-12)
    made = sum(len(t) for t in run["tokens"])
    used, reserved = run["used_tokens"], run["reserved_tokens"]
    a = run["allocator"]
    return {
        "policy": policy,
        "requests": len(reqs),
        "completed": sum(q.finish is not None for q in reqs),
        "output_tokens": made,
        "output_tps": made / span,
        "requests_per_s": len(reqs) / span,
        "duration_s": span,
        "ttft_s": percentiles([q.first_token - q.arrival for q in reqs]),
        "tpot_s": percentiles([(q.finish - q.first_token) / (q.gen - 1) for q in reqs
                               if q.gen > 1]),
        "e2e_s": percentiles([q.finish - q.arrival for q in reqs]),
        "preemptions": run["preemptions"],
        "migrations": a.get("migrations", 0),
        "utilization": used / reserved if reserved else None,
        "mean_batch": run["batch_sum"] / run["steps"] if run["steps"] else None,
        "peak_batch": run["peak_batch"],
        "steps": run["steps"],
        "startup_s": run.get("startup_seconds"),   # hf: its manager's start-up, not in duration
        "mismatches": None, "near_ties": None, "max_logit_diff": None,
        "settings": setup,
    }
