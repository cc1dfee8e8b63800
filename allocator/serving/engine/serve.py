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
- KV: every policy keeps a request's KV in regions of the pool laid out head-major, [layers,
  2 (K, V), kv_heads, capacity, head_dim]: a contiguous block is one region, an extent block one
  per extent, a paged block one per page (allocator/serving/engine/kv_runs.py). Since a token's place
  depends on the capacity, a migration is the engine's own copy (the allocator's grow(copy=...)).
- Steps: every step is one batched forward pass (allocator/serving/engine/runner.py) over what the
  Scheduler put in it: prefill-first, the prompts admitted together (and, after a preemption,
  the tokens each had made), or one token of every running request; chunked
  (max_batched_tokens), one token of every running request and the prompt chunks riding with
  them. All the step's tokens go through the projections and MLPs as one packed batch; each
  request attends over its own KV through the step's run tables, read by one kernel family
  for every layout (allocator/serving/engine/run_attention.py); decode steps replay CUDA graphs on a
  GPU.
- The check (check=True): transformers' own forward of the model over each request's prompt and
  the tokens the engine made (what generate() runs, one position at a time), compared position
  by position: the chosen token, and the logits at the engine's top LOGIT_CHECK_K tokens. Where
  the engine's token is behind the reference's best by no more than near_tie, or than the two
  tokens' logits moved between engine and reference (each within the logit tolerance), a
  different token is a near tie, not a mismatch.
"""

from __future__ import annotations

import math
import time

import numpy as np

from odma_cli.errors import BadArgument

from allocator.config import AllocatorConfig
from allocator.policies import make_allocator
from allocator.policies import policy as policy_spec
from allocator.serving.core.build import SchedulingOptions, build_scheduler
from allocator.serving.core.drive import drive
from allocator.serving.core.plan import PREFILL, Executor, Outcome, Plan
from allocator.serving.core.requests import RequestState
from allocator.serving.engine import run_attention, run_kernels
from allocator.serving.engine.kv_runs import KVPool
from allocator.serving.engine.runner import Runner, make_graphs
from allocator.serving.models import DTYPES, check_weights, head_dim, kv_bytes_per_token, need

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
    """Load the safetensors files of `folder` (as models.check_weights finds and checks them)
    into `model`: BadArgument for weights that do not match the config, a tied config whose
    files give an LM head other than the embedding (one of the two would be dropped without a
    word), or a tensor that is not finite (every logit would be NaN)."""
    safetensors = need("safetensors.torch", "engine")
    state = {}
    for f in check_weights(folder):
        state.update(safetensors.load_file(str(f)))
    for key, t in state.items():
        if not bool(torch.isfinite(t).all()):
            raise BadArgument(f"the weights in {folder}: tensor {key!r} holds values that are "
                              f"not finite (NaN or infinity)")
    embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if model.config.tie_word_embeddings:
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise BadArgument(f"the weights in {folder}: the config ties the LM head to the "
                              f"embedding (tie_word_embeddings), but lm_head.weight differs "
                              f"from model.embed_tokens.weight")
        if embed is not None:
            state.setdefault("lm_head.weight", embed)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        raise BadArgument(f"the weights in {folder} do not match the config: "
                          f"{' '.join(first[:2])[:300]}") from None


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
          attention: str = "auto", cuda_graphs: str = "auto", fused_layers: str = "auto",
          prompt_attention: str = "dense", progress=None, log: list | None = None,
          keep_logits: bool = False) -> dict:
    """Serve the requests (prompt token ids, tokens to make, arrival seconds from the start) with
    `policy`, prefill-first or chunked (max_batched_tokens), open or closed loop (concurrency),
    a preempted request recomputed or swapped to host memory (swap_bytes of it), co-batching
    by bucket tag over a window of `cobatch` waiting requests (0: off); attention by the
    run-table kernels of `attention` ("auto", "triton", "torch"), decode steps from CUDA graphs
    per `cuda_graphs` ("auto": on CUDA with the Triton kernels; "on"; "off"), the layers fused
    per `fused_layers` (runner.FusedLayers: "auto": on the Triton path where the model allows;
    "on"; "off"), whole prompts attending per `prompt_attention` (runner.PROMPT_ATTENTION); their
    tokens, times, and the allocator's and scheduler's counts."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    spec = f"torch:{dev}"
    n = len(prompts)
    backend = run_attention.attention_backend(dev, None if attention == "auto" else attention)
    graphs = use_graphs(cuda_graphs, dev, backend)
    reqs = [RequestState(i, int(prompts[i].numel()), int(gen[i]), float(arrivals[i]))
            for i in range(n)]
    bpt = kv_bytes_per_token(model.config, str(dtype).removeprefix("torch."))
    options = SchedulingOptions(max_batch, max_model_len, max_prefill, max_batched_tokens,
                                concurrency, preemption, swap_bytes, cobatch)
    config = config or AllocatorConfig(background_refresh=False)
    alloc = make_allocator(policy, spec, pool_bytes, bpt, max_model_len, config,
                           page_tokens=page_tokens)
    try:
        kv = KVPool(alloc, model.config, dtype, head_dim(model.config))
        sched = build_scheduler(policy_spec(policy), alloc, reqs, options, predictor=predictor,
                                bytes_per_token=bpt, seed=seed, log=log,
                                migrate=None if kv.page_tokens is not None else kv.migrate)
        runner = Runner(model, kv, backend, fused_layers, prompt_attention)
        if graphs:
            # the most runs a request can have: one per page, or one per extent of whole token
            # alignments and one shorter at the max model length (a step with more runs, if
            # any, is run eagerly)
            unit = kv.page_tokens if kv.page_tokens is not None else config.token_alignment
            make_graphs(runner, max_batch, max_batch * (-(-max_model_len // unit) + 1))
        executor = RunnerExecutor(runner, sched, prompts, keep_logits, progress)
        compiled = run_kernels.compilations()
        drive(sched, executor)
        out = executor.result()
        # kernels compiled while the clock ran (a shape the warm-up missed): their seconds
        # are in this run's times, and the engine says so
        out["kernel_compiles"] = run_kernels.compilations() - compiled
        out["attention"] = backend
        out["cuda_graphs"] = runner.graphs is not None
        out["fused_layers"] = runner.fused is not None
        out["prompt_attention"] = prompt_attention
        return out
    finally:
        alloc.close()


def use_graphs(cuda_graphs: str, device, backend: str) -> bool:
    """Whether decode steps are captured as CUDA graphs: "auto" where they can be (a CUDA
    device and the Triton kernels, whose launches need no host values); "on" refused where
    they cannot be, in one line."""
    if cuda_graphs not in ("auto", "on", "off"):
        raise BadArgument(f"--cuda-graphs takes auto, on or off, not {cuda_graphs!r}")
    able = torch.device(device).type == "cuda" and backend == "triton"
    if cuda_graphs == "on" and not able:
        raise BadArgument("--cuda-graphs on needs a CUDA device and the Triton attention "
                          f"kernels (here: {device}, {backend} attention)")
    return able and cuda_graphs != "off"


class RunnerExecutor(Executor):
    """The engine's executor: each plan is one batched forward pass of the Runner, each decode
    and each completed prompt picks its token greedily, and the clock is wall time."""

    name = "engine"

    def __init__(self, runner, sched, prompts, keep_logits, progress=None):
        self.runner = runner
        self.sched = sched
        self.alloc = sched.alloc
        self.prompts = prompts
        self.keep_logits = keep_logits
        self.progress = progress
        n = len(prompts)
        self.made = [[] for _ in range(n)]      # tokens made, kept across preemptions
        self.top = [[] for _ in range(n)]       # (values, indices) of the top logits per token
        self.times = [[] for _ in range(n)]     # seconds at which each token was read back
        self.host: dict = {}                    # swapped requests' KV
        self.steps = self.batch_sum = self.peak_batch = 0
        self.executed = 0                       # plans of any kind executed so far
        # decode-only steps: (step index, start, forward issued, tokens read back)
        self.decode_marks: list = []
        self.start = self.last_progress = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def wait(self, until: float) -> None:
        time.sleep(max(0.0, min(0.05, until - self.now())))

    def pick(self, logits):
        """The token each row of a step's `logits` chooses, read back once for the whole step
        (and, for the check, the rows' top logits), and when it was read back."""
        tokens = logits.argmax(-1).tolist()
        if not self.keep_logits:
            return tokens, None, self.now()
        v, ix = torch.topk(logits.float(), min(LOGIT_CHECK_K, logits.shape[-1]))
        return tokens, (v.cpu(), ix.cpu()), self.now()

    def emit(self, i, picked, j) -> None:
        """Request i takes the token of row j of what pick() read."""
        tokens, top, t = picked
        self.made[i].append(tokens[j])
        self.times[i].append(t)
        if top is not None:
            self.top[i].append((top[0][j], top[1][j]))

    def context(self, i):
        """Request i's context: its prompt and, after a preemption, every token it made."""
        p = self.prompts[i]
        return torch.cat([p, torch.tensor(self.made[i], dtype=p.dtype)])

    def execute(self, plan: Plan) -> Outcome:
        self.executed += 1
        if plan.kind == PREFILL:
            batch = [(a.id, self.context(a.id), 0) for a in plan.admitted]
            if batch:
                picked = self.pick(self.runner.forward(batch))
                for j, (i, _, _) in enumerate(batch):
                    self.emit(i, picked, j)
            return Outcome(self.now())
        ids, chunks, reqs = plan.decodes, plan.chunks, self.sched.reqs
        if not ids and not chunks:             # only swapped requests come back
            return Outcome(self.now())
        # each decode feeds its last token, at the position after its context
        batch = [(i, self.made[i][-1:], reqs[i].prompt + reqs[i].made - 1) for i in ids]
        batch += [(c.id, self.context(c.id)[c.start:c.start + c.tokens], c.start)
                  for c in chunks]
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        t1 = time.perf_counter()
        # what needs no token value, done while a GPU computes them: which requests finish
        # with this step's token, and which next one has no room in its block
        finished, outgrown = [], []
        for i, blk in zip(ids, self.alloc.blocks(ids)):
            r = reqs[i]
            r.made += 1
            if r.made >= r.gen:
                finished.append(i)
            elif r.prompt + r.made + 1 > blk.capacity_tokens:
                outgrown.append(i)
        picked = self.pick(logits)
        if not chunks:
            self.decode_marks.append((self.executed, t0, t1, time.perf_counter()))
        for j, i in enumerate(ids):
            self.emit(i, picked, j)
        for j, c in enumerate(chunks):
            if c.last:
                self.emit(c.id, picked, len(ids) + j)
        if ids:
            self.steps += 1
            self.batch_sum += len(ids)
        return Outcome(self.now(), finished=finished, outgrown=outgrown)

    def settle(self, plan: Plan, outcome: Outcome) -> None:
        if plan.kind == PREFILL or plan.decodes or plan.chunks:
            self.peak_batch = max(self.peak_batch, len(self.sched.running))
        if self.progress and time.perf_counter() - self.last_progress > 1.0:
            self.last_progress = time.perf_counter()
            self.progress(self.sched.done, len(self.sched.reqs), self.now())

    def swap_out(self, i, r, tokens: int) -> None:
        self.host[i] = self.runner.kv.save(i, tokens)

    def swap_in(self, i, r, tokens: int) -> None:
        self.runner.kv.load(i, self.host.pop(i))

    def decode_step_us(self) -> dict | None:
        """Where a decode-only step's time goes, medians in microseconds over the decode-only
        steps that another one follows: `issue` (the batch, its step tables and inputs, its
        launches or graph replay issued), `wait` (then until its tokens are read back, the
        bookkeeping that needs no token value done meanwhile: on a GPU the device's work the
        host did not hide; on a CPU the host computes in `issue`) and `other` (then until the
        next step starts: the tokens recorded, the scheduler's update and next plan)."""
        marks = self.decode_marks
        cycles = [(t1 - t0, t2 - t1, n0 - t2) for (k, t0, t1, t2), (k1, n0, _, _)
                  in zip(marks, marks[1:]) if k1 == k + 1]
        if not cycles:
            return None
        med = np.median(np.array(cycles), axis=0) * 1e6
        return {"steps": len(cycles), "issue": float(med[0]), "wait": float(med[1]),
                "other": float(med[2])}

    def result(self) -> dict:
        sched = self.sched
        alloc, tot = sched.alloc, sched.tot
        return {"requests": sched.reqs, "tokens": self.made, "token_times": self.times,
                "decode_step_us": self.decode_step_us(),
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
    by more than `near_tie` and more than the two tokens' logits moved (engine against
    reference, where the engine kept both among its top ones), when a logit at
    the engine's top-LOGIT_CHECK_K tokens differs by more than logit_rtol x (1 + the position's
    largest logit) (default 1e-4 for float32, 3e-2 for bfloat16), or when a logit of either is
    not finite: NaN compares equal to nothing, so such a check would check nothing. Those
    requests are also counted apart (non_finite)."""
    dtype = next(model.parameters()).dtype
    if logit_rtol is None:
        logit_rtol = 1e-4 if dtype == torch.float32 else 3e-2
    dev = next(model.parameters()).device
    mismatches = near_ties = non_finite = 0
    worst = 0.0
    for p, toks, tops in zip(prompts, tokens, top or [None] * len(tokens)):
        seq = torch.cat([p, torch.tensor(toks, dtype=p.dtype)])[None].to(dev)
        with torch.no_grad():
            ref = model(seq).logits[0, p.numel() - 1:p.numel() - 1 + len(toks)].float().cpu()
        finite = bool(torch.isfinite(ref).all()) and all(
            bool(torch.isfinite(values).all()) for values, _ in (tops or []))
        non_finite += not finite
        bad = not finite
        if not finite:
            worst = math.nan            # no difference to speak of (JSON null)
        for j, tok in enumerate(toks if finite else ()):
            best = int(torch.argmax(ref[j]))
            moved = 0.0        # how far the two tokens' logits moved, where the engine kept both
            if tops is not None:               # a run that kept no logits (hf): tokens only
                values, index = tops[j]
                error = (values - ref[j, index]).abs()
                diff = float(error.max())
                worst = max(worst, diff)
                if diff > logit_rtol * (1.0 + float(ref[j].abs().max())):
                    bad = True
                kept = index.tolist()
                if tok != best and tok in kept and best in kept:
                    moved = float(error[kept.index(tok)] + error[kept.index(best)])
            if tok != best:
                # a near tie: the engine's token behind the reference's best by no more than
                # near_tie, or than their two logits moved (each within logit_rtol, checked
                # above): in bfloat16 one ulp of difference reorders two logits an ulp apart
                if float(ref[j, best] - ref[j, tok]) <= max(near_tie, moved):
                    near_ties += 1
                else:
                    bad = True
        mismatches += bad
    return {"mismatches": mismatches, "near_ties": near_ties, "non_finite": non_finite,
            "max_logit_diff": worst if top is not None else None,
            "near_tie": near_tie, "logit_rtol": logit_rtol}
