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
- Steps: a prefill runs each admitted request's prompt (and, after a preemption, the tokens it
  had made) causally; a decode step runs one token of every running request through the batch's
  projections and MLPs together and each request's attention over its own KV.
- The check (check=True): transformers' own forward of the model over each request's prompt and
  the tokens the engine made (what generate() runs, one position at a time), compared position
  by position: the chosen token, and the logits at the engine's top LOGIT_CHECK_K tokens. Where
  the reference's best two logits are within near_tie, a different token is a near tie, not a
  mismatch.
"""

from __future__ import annotations

import collections
import importlib
import json
import math
import os
import pathlib
import time

import numpy as np

from odma_hw.errors import BadArgument, DeviceUnavailable

from allocator.config import AllocatorConfig
from allocator.errors import OutOfMemory
from allocator.policies import make_allocator
from allocator.predictors import make_predictor
from allocator.serving.engine import RequestState
from allocator.serving.scheduler import Scheduler

try:
    import torch
except ImportError:  # the rest of the package works without torch
    torch = None

SUPPORTED = ("llama", "qwen2", "mistral")
CONFIG_DIR = pathlib.Path(__file__).with_name("configs")
DTYPES = ("float32", "bfloat16")
LOGIT_CHECK_K = 16
CONTIGUOUS = ("odma", "static", "s3", "oracle")


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _need(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DeviceUnavailable(f"the engine needs {module} ({exc}); pip install "
                                f"'odma-hw[{extra}]'") from None


# ----------------------------------------------------------------------------- the model
def load_config(spec: str):
    """(transformers config, directory of weights or None) for a config file, a directory with
    config.json, or a shipped config's name."""
    transformers = _need("transformers", "engine")
    weights = None
    path = pathlib.Path(spec)
    if spec in shipped_configs():
        path = CONFIG_DIR / f"{spec}.json"
    elif path.is_dir():
        weights = path if any(path.glob("*.safetensors")) else None
        path = path / "config.json"
    elif not path.is_file():
        raise BadArgument(f"--model {spec!r} is neither a config.json, a directory holding one, "
                          f"nor a shipped config ({', '.join(shipped_configs())})")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise BadArgument(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") \
            from None
    if not isinstance(data, dict) or data.get("model_type") not in SUPPORTED:
        kind = data.get("model_type") if isinstance(data, dict) else None
        raise BadArgument(f"{path}: model_type {kind!r} is not supported (the engine runs "
                          f"{', '.join(SUPPORTED)})")
    data = dict(data)
    try:
        config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"{path}: not a valid config: {exc}") from None
    return config, weights


def build_model(config, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                weights=None):
    """The model of `config` on a torch device, in eval mode: the weights in `weights` (a
    directory of safetensors), else random ones from `seed`."""
    transformers = _need("transformers", "engine")
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
    safetensors = _need("safetensors.torch", "engine")
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


# ----------------------------------------------------------------------------- KV in blocks
def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, dtype: str) -> int:
    """K and V of every layer and KV head, in the model's dtype."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * \
        (4 if dtype == "float32" else 2)


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
        self._views: dict = {}           # request -> (its block, the block's KV view)
        if self.paged:
            T = alloc.page_tokens
            used = T * alloc.bytes_per_token
            pool = alloc.pool_tensor()[:alloc.n_pages * alloc.page_bytes]
            self.pages = pool.view(alloc.n_pages, alloc.page_bytes)[:, :used].view(dtype).view(
                alloc.n_pages, self.layers, 2, self.kv_heads, T, self.head_dim)

    def _view(self, i, blk=None):
        blk = blk if blk is not None else self.alloc.block(i)
        got = self._views.get(i)
        if got is None or got[0] is not blk:
            view = blk.tensor(self.dtype, (self.layers, 2, self.kv_heads, blk.capacity_tokens,
                                           self.head_dim))
            got = self._views[i] = (blk, view)
        return got[1]

    def forget(self, i) -> None:
        """Request i's block is gone (finished, preempted): drop the view, so that nothing
        reads a released block through it."""
        self._views.pop(i, None)

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
        view = self._view(i)
        view[layer, 0, :, start:start + n] = k
        view[layer, 1, :, start:start + n] = v

    def read(self, i, layer: int, ctx: int):
        """(K, V) of positions [0, ctx), each (kv_heads, ctx, head_dim): views of the block, or,
        paged, gathered from the pages of the block table."""
        if self.paged:
            T = self.alloc.page_tokens
            table = torch.tensor(self.alloc.block(i).pages[:-(-ctx // T)], dtype=torch.int64)
            kv = self.pages[table, layer]                    # (pages, 2, kv_heads, T, D)
            kv = kv.permute(1, 2, 0, 3, 4).reshape(2, self.kv_heads, -1, self.head_dim)
            return kv[0, :, :ctx], kv[1, :, :ctx]
        view = self._view(i)
        return view[layer, 0, :, :ctx], view[layer, 1, :, :ctx]

    def migrate(self, old, new) -> None:
        """The allocator's copy of a migration: the first `written` tokens of every run, each to
        its place in the larger block."""
        n = min(old.written // self.alloc.bytes_per_token, old.capacity_tokens)
        src = self._view(old.request_id, old)
        dst = new.tensor(self.dtype, (self.layers, 2, self.kv_heads, new.capacity_tokens,
                                      self.head_dim))
        dst[:, :, :, :n] = src[:, :, :, :n]


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

    @torch.no_grad()
    def prefill(self, i, ids):
        """Run request i's tokens `ids` causally from position 0, storing their KV; the logits
        of the last position."""
        x = self.inner.embed_tokens(ids[None].to(self.device))
        pos = torch.arange(ids.numel(), device=self.device)[None]
        cos, sin = self.inner.rotary_emb(x, pos)
        for layer, block in enumerate(self.inner.layers):
            attn = block.self_attn
            q, k, v = self._qkv(attn, block.input_layernorm(x), cos, sin)
            self.kv.write(i, layer, 0, k[0], v[0])
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, ids.numel(), -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x[:, -1]))[0]

    @torch.no_grad()
    def decode(self, ids, positions, requests):
        """One decode step: token ids[b] of request requests[b] at position positions[b];
        (batch, vocab) logits."""
        b = len(requests)
        x = self.inner.embed_tokens(torch.as_tensor(ids, device=self.device)[:, None])
        pos = torch.as_tensor(positions, device=self.device)[:, None]
        cos, sin = self.inner.rotary_emb(x, pos)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for layer, block in enumerate(self.inner.layers):
            attn = block.self_attn
            q, k, v = self._qkv(attn, block.input_layernorm(x), cos, sin)
            out = []
            for j, i in enumerate(requests):
                p = positions[j]
                self.kv.write(i, layer, p, k[j], v[j])
                K, V = self.kv.read(i, layer, p + 1)
                out.append(sdpa(q[j:j + 1], K[None], V[None], enable_gqa=True))
            o = torch.cat(out).transpose(1, 2).reshape(b, 1, -1)
            x = x + attn.o_proj(o)
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x[:, 0]))


# ----------------------------------------------------------------------------- serving
def prompt_ids(n_requests: int, lengths, vocab: int, seed: int) -> list:
    """Token ids of each prompt, from a seeded generator (ids 3.. to stay clear of the
    special tokens most vocabularies put first)."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(3, vocab, int(n))) for n in lengths[:n_requests]]


def serve(model, prompts: list, gen: list, arrivals, policy: str, *, pool_bytes: int,
          max_model_len: int, max_batch: int = 256, max_prefill: int = 0, page_tokens: int = 16,
          predictor: str = "online", seed: int = 0, config: AllocatorConfig | None = None,
          progress=None, log: list | None = None, keep_logits: bool = False) -> dict:
    """Serve the requests (prompt token ids, tokens to make, arrival seconds from the start) with
    `policy`; their tokens, times, and the allocator's and scheduler's counts."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    spec = f"torch:{dev}"
    n = len(prompts)
    reqs = [RequestState(i, int(prompts[i].numel()), int(gen[i]), float(arrivals[i]))
            for i in range(n)]
    bpt = kv_bytes_per_token(model.config, str(dtype).removeprefix("torch."))
    alloc = make_allocator(policy, spec, pool_bytes, bpt, max_model_len,
                           config or AllocatorConfig(background_refresh=False),
                           page_tokens=page_tokens)
    try:
        return _serve(model, alloc, reqs, prompts, policy, bpt, max_batch,
                      max_prefill or max(max_model_len, 2048), predictor, seed, progress, log,
                      keep_logits)
    finally:
        alloc.close()


def _serve(model, alloc, reqs, prompts, policy, bpt, max_batch, max_prefill, predictor, seed,
           progress, log, keep_logits) -> dict:
    kv = BlockKV(alloc, model.config, next(model.parameters()).dtype)
    runner = Runner(model, kv)
    tot = collections.Counter()
    sched = Scheduler(alloc, make_predictor("oracle" if policy == "oracle" else predictor,
                                            seed=seed), reqs,
                      max_batch=max_batch, max_prefill=max_prefill, bytes_per_token=bpt,
                      tot=tot, migrate=None if kv.paged else kv.migrate, log=log)
    n = len(reqs)
    made = [[] for _ in range(n)]            # tokens made, kept across preemptions
    top = [[] for _ in range(n)]             # (values, indices) of the top logits per token
    order = sorted(range(n), key=lambda i: (reqs[i].arrival, i))
    running, waiting = sched.running, sched.waiting
    next_arrival, peak_batch, steps, batch_sum = 0, 0, 0, 0
    start = time.perf_counter()
    last_progress = start

    def now():
        return time.perf_counter() - start

    def emit(i, logits) -> int:
        tok = int(torch.argmax(logits))
        made[i].append(tok)
        if keep_logits:
            v, ix = torch.topk(logits.float(), min(LOGIT_CHECK_K, logits.numel()))
            top[i].append((v.cpu(), ix.cpu()))
        return tok

    def drop(i):
        kv.forget(i)

    while sched.done < n:
        while next_arrival < n and reqs[order[next_arrival]].arrival <= now():
            waiting.append(order[next_arrival])
            next_arrival += 1
        if waiting and len(running) < max_batch:
            admitted, _ = sched.admit(now())
            if admitted:
                for i, r, held, _ in admitted:
                    # a rerun's context is its prompt and every token it made
                    ids = torch.cat([prompts[i], torch.tensor(made[i], dtype=prompts[i].dtype)])
                    emit(i, runner.prefill(i, ids))
                t = now()
                for i, r, _, _ in admitted:
                    if sched.made_first_token(i, r, t):
                        drop(i)
                        sched.finish(i, r, t)
                        continue
                    try:
                        sched.run_on(i, r)
                    except OutOfMemory:
                        drop(i)
                        sched.preempt(i, r)
                peak_batch = max(peak_batch, len(running))
                continue
        if not running:
            if next_arrival >= n:
                raise RuntimeError("engine stalled: requests wait and nothing runs")
            time.sleep(max(0.0, min(0.05, reqs[order[next_arrival]].arrival - now())))
            continue
        ids = sorted(running)
        # each feeds its last token, at the position after its context
        logits = runner.decode([made[i][-1] for i in ids],
                               [reqs[i].prompt + reqs[i].made - 1 for i in ids], ids)
        for j, i in enumerate(ids):
            emit(i, logits[j])
            reqs[i].made += 1
        steps += 1
        batch_sum += len(ids)
        t = now()
        for i in ids:                       # completions, then growth, in request order
            r = reqs[i]
            if r.made >= r.gen:
                drop(i)
                sched.finish(i, r, t)
        for i in ids:
            r = reqs[i]
            if i in running and r.prompt + r.made + 1 > alloc.block(i).capacity_tokens:
                try:
                    sched.grow(i, r.prompt + r.made + 1)
                except OutOfMemory:
                    drop(i)
                    sched.preempt(i, r)
        if progress and time.perf_counter() - last_progress > 1.0:
            last_progress = time.perf_counter()
            progress(sched.done, n, now())
    return {"requests": reqs, "tokens": made, "top_logits": top if keep_logits else None,
            "seconds": now(), "steps": steps, "batch_sum": batch_sum, "peak_batch": peak_batch,
            "preemptions": int(tot["preemptions"]), "allocator": alloc.stats(),
            "used_tokens": alloc.used_tokens_sum, "reserved_tokens": alloc.reserved_tokens_sum}


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


# ----------------------------------------------------------------------------- the command
SCHEMA = "odma-hw.engine/1"
ROW_KEYS = ("policy",)                  # what tells apart the rows of one run


def prepare(args):
    """Every check before the weights are built: (config, weights, trace lengths, arrivals,
    KV pool bytes, max model length)."""
    import types

    from allocator.serving.cli import parse_policies
    from allocator.serving.engine import fit_lengths
    from allocator.pool import resolve_device
    from allocator.trace import arrival_seconds, load_trace

    if torch is None:
        raise DeviceUnavailable("the engine needs torch; pip install 'odma-hw[torch]'")
    policies = parse_policies(args.policy, extra=("hf",))
    config, weights = load_config(args.model)
    trace = load_trace(args.trace)
    if args.requests is not None:
        trace = trace.head(args.requests)
    if args.prompt_cap:
        trace.prompt = np.minimum(trace.prompt, args.prompt_cap)
    if args.output_cap:
        trace.generated = np.minimum(trace.generated, args.output_cap)
    limit = types.SimpleNamespace(name=args.model, max_context=config.max_position_embeddings)
    prompt, gen, keep, cap, dropped, truncated = fit_lengths(trace, args.max_model_len, limit,
                                                             args.clip)
    arrivals = arrival_seconds(trace, args.rate, 1.0, args.seed)[keep]
    dev, owned = resolve_device(args.device)
    try:
        if not hasattr(dev, "dev"):
            raise BadArgument(f"the engine runs on a torch device (torch:cpu, torch:cuda:0, ...), "
                              f"not {args.device}")
        device = str(dev.dev)
    finally:
        if owned:
            dev.close()
    bpt = kv_bytes_per_token(config, args.dtype)
    pool = int(args.kv_pool_mb * 1e6)
    if pool < cap * bpt:
        raise BadArgument(f"--kv-pool-mb {args.kv_pool_mb:g} holds {pool // bpt} tokens of KV, "
                          f"less than one {cap}-token request ({bpt} B per token)")
    return dict(policies=policies, config=config, weights=weights, prompt=prompt, gen=gen,
                arrivals=arrivals, pool=pool, max_model_len=cap, device=device,
                dropped=dropped, truncated=truncated, trace=trace.name, bpt=bpt)


def compute(args, results: list | None = None) -> dict:
    """The JSON object of `odma-hw engine` (results appended to `results` as they finish, so
    that a caller keeps them when a later policy is interrupted)."""
    from allocator.serving.hf_reference import run_hf

    p = prepare(args)
    model = build_model(p["config"], args.dtype, p["device"], args.seed, p["weights"])
    prompts = prompt_ids(len(p["prompt"]), p["prompt"], p["config"].vocab_size, args.seed)
    settings = {"model": args.model, "dtype": args.dtype, "device": f"torch:{p['device']}",
                "trace": p["trace"], "max_model_len": p["max_model_len"],
                "max_batch": args.max_batch, "kv_pool_mb": args.kv_pool_mb,
                "kv_bytes_per_token": p["bpt"], "page_tokens": args.page_tokens,
                "predictor": args.predictor, "seed": args.seed, "rate": args.rate,
                "dropped_over_length": p["dropped"], "truncated_over_length": p["truncated"],
                "weights": "loaded" if p["weights"] else "random (seeded)"}
    out = [] if results is None else results
    # untimed: torch's one-time start-up (thread pools, first kernels) must not land on the
    # first policy measured
    serve(model, prompts[:2], [2, 2], [0.0, 0.0], "static", pool_bytes=p["pool"],
          max_model_len=p["max_model_len"])
    for policy in p["policies"]:
        show = progress(policy) if not args.json or os.isatty(2) else None
        if policy == "hf":
            run = run_hf(model, prompts, p["gen"], p["arrivals"], max_batch=args.max_batch,
                         progress=show)
        else:
            run = serve(model, prompts, p["gen"], p["arrivals"], policy, pool_bytes=p["pool"],
                        max_model_len=p["max_model_len"], max_batch=args.max_batch,
                        page_tokens=args.page_tokens, predictor=args.predictor,
                        seed=args.seed, progress=show, keep_logits=args.check)
        r = summarise(policy, run, settings)
        if args.check:
            r.update(check_tokens(model, prompts, run["tokens"], run["top_logits"]))
        out.append(r)
    return {"schema": SCHEMA, "results": out}


def progress(policy: str, stream=None):
    """A progress callback: one line per second on stderr."""
    import sys

    stream = stream or sys.stderr

    def show(done, total, seconds):
        stream.write(f"engine {policy}: {done}/{total} requests, {seconds:.0f} s\n")
        stream.flush()
    return show


def format_table(results: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else (f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s")
    head = ["policy", "tok/s", "req/s", "TTFT p50", "TPOT p50", "E2E p50", "util", "batch",
            "preempt", "migr", "mismatches"]
    rows = [head]
    for r in results:
        rows.append([r["policy"], f"{r['output_tps']:.1f}", f"{r['requests_per_s']:.2f}",
                     ms(r["ttft_s"]["p50"]), ms(r["tpot_s"]["p50"]), ms(r["e2e_s"]["p50"]),
                     "-" if r["utilization"] is None else f"{r['utilization']:.3f}",
                     "-" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}",
                     str(r["preemptions"]), str(r["migrations"]),
                     "-" if r["mismatches"] is None else
                     f"{r['mismatches']} ({r['near_ties']} near ties)"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = results[0]["settings"]
    lines.append(f"{s['trace']}: {results[0]['requests']} requests; {s['model']} {s['dtype']} "
                 f"({s['weights']} weights) on {s['device']}; KV pool {s['kv_pool_mb']:g} MB; "
                 f"max model len {s['max_model_len']}")
    return "\n".join(lines)


def _cmd(args) -> int:
    from odma_hw import jsonout

    results: list = []
    try:
        compute(args, results)
    except KeyboardInterrupt:
        if results:
            print(jsonout.dumps({"schema": SCHEMA, "results": results}, indent=1) if args.json
                  else format_table(results))
        raise
    print(jsonout.dumps({"schema": SCHEMA, "results": results}, indent=1) if args.json
          else format_table(results))
    return 0


def register(subparsers) -> None:
    from odma_hw import argtypes

    p = subparsers.add_parser(
        "engine", help="serve a trace with a real transformer whose KV lives in allocator blocks",
        description="A Hugging Face decoder (Llama, Qwen2, Mistral) serves a request trace on a "
                    "torch device with continuous batching; every KV byte lives in blocks of the "
                    "policy's allocator and every scheduling decision is the one `simulate` "
                    "makes. --check compares every token and its logits with transformers' own "
                    "forward of the model.")
    p.add_argument("--trace", required=True, metavar="CSV",
                   help="request trace: num_prefill_tokens, num_decode_tokens [, arrived_at]")
    p.add_argument("--requests", type=argtypes.positive_int, default=None, metavar="N",
                   help="serve only the first N requests")
    p.add_argument("--rate", type=argtypes.positive_float, default=None, metavar="R",
                   help="Poisson arrivals at R requests/s (default: the trace's arrived_at, "
                        "else all at once)")
    p.add_argument("--model", default="tiny-qwen2", metavar="CONFIG",
                   help=f"a config.json, a directory with config.json (and safetensors weights), "
                        f"or one of {', '.join(shipped_configs())} (default tiny-qwen2)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default="torch:cpu", metavar="torch:DEV",
                   help="the torch device (default torch:cpu)")
    p.add_argument("--policy", default="odma,static,paged", metavar="P[,P...]",
                   help="allocation policies (odma, static, s3, oracle, paged; default "
                        "odma,static,paged)")
    p.add_argument("--predictor", default="online", help="ODMA's length predictor")
    p.add_argument("--max-batch", type=argtypes.positive_int, default=32,
                   help="running requests at most (default 32)")
    p.add_argument("--kv-pool-mb", type=argtypes.positive_float, default=64.0,
                   help="KV pool in MB (default 64; small forces preemption)")
    p.add_argument("--page-tokens", type=argtypes.positive_int, default=16,
                   help="tokens per page of the paged policy (default 16)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="longest request (default: the trace's longest)")
    p.add_argument("--clip", action="store_true",
                   help="drop prompts longer than --max-model-len and cut generations there")
    p.add_argument("--prompt-cap", type=argtypes.positive_int, default=None, metavar="N",
                   help="cut every prompt to at most N tokens (a CPU run takes minutes, not hours)")
    p.add_argument("--output-cap", type=argtypes.positive_int, default=None, metavar="N",
                   help="make at most N tokens per request")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seeds the weights, the prompts and the arrivals (default 0)")
    p.add_argument("--check", action="store_true",
                   help="compare every token and its logits with transformers' forward")
    p.add_argument("--json", action="store_true", help=f"print one JSON object ({SCHEMA})")
    p.set_defaults(func=_cmd)
