"""The engine's batched step: every layout's blocks become run tables that satisfy the kernels'
contract and address exactly the block's bytes; CUDA graphs are captured for the padded batch
sizes vLLM pads to; a step on the kernels' path reads back nothing but its tokens; options that
cannot run here are refused in one line before any work."""

from __future__ import annotations

import collections
import types

import numpy as np

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from allocator.config import AllocatorConfig  # noqa: E402
from allocator.policies import make_allocator  # noqa: E402
from allocator.serving import models  # noqa: E402
from allocator.serving.engine import run_attention  # noqa: E402
from allocator.serving.engine.kv_runs import KVPool  # noqa: E402
from allocator.serving.engine.runner import graph_sizes  # noqa: E402
from allocator.serving.engine.serve import use_graphs  # noqa: E402
from odma_cli.errors import BadArgument  # noqa: E402
from odma_cli.main import main  # noqa: E402

TRACE_ROWS = "num_prefill_tokens,num_decode_tokens\n12,4\n30,3\n"


def test_graph_sizes_are_vllms_padding_up_to_the_largest_batch():
    assert graph_sizes(1) == [1]
    assert graph_sizes(5) == [1, 2, 4, 5]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(128)[-3:] == [112, 120, 128]


@pytest.mark.parametrize("policy,page_tokens", [("odma", 16), ("paged", 4), ("paged", 1),
                                                ("extent", 16)])
def test_step_tables_address_each_token_where_its_block_holds_it(policy, page_tokens):
    """Tokens written through the step's slots read back through its run tables (the torch
    gather) in token order, and equal what the block's own region views hold."""
    cfg, _ = models.load_config("tiny-llama")
    D = models.head_dim(cfg)
    bpt = models.kv_bytes_per_token(cfg, "float32")
    extents = dict(token_alignment=4, extent_knee_tokens=4, extent_max=8)
    alloc = make_allocator(policy, "torch:cpu", 400 * bpt, bpt, 96, AllocatorConfig(
        background_refresh=False, **(extents if policy == "extent" else {})),
        page_tokens=page_tokens)
    try:
        kv = KVPool(alloc, cfg, torch.float32, D)
        kv.flat.zero_()
        lengths = {0: 9, 1: 23, 2: 1}
        for i, n in lengths.items():
            alloc.reserve(i, n, 4.0, 0.0)
            alloc.grow(i, n + 5)                     # several extents or pages, room past n
        tables = kv.step_tables(list(lengths.items()), [(i, 0, n) for i, n in lengths.items()])
        runs = run_attention.RunTable(**{f: torch.from_numpy(getattr(tables, f))
                                         for f in run_attention.TABLE_FIELDS})
        runs.validate(kv.flat.numel(), kv.layers, kv.kv_heads, D)
        if policy == "paged":
            assert int(tables.run_start[2]) - int(tables.run_start[1]) == -(-23 // page_tokens)
        N = sum(lengths.values())
        gen = torch.Generator().manual_seed(0)
        for layer in range(kv.layers):
            k = torch.randn(N, kv.kv_heads, D, generator=gen)
            v = torch.randn(N, kv.kv_heads, D, generator=gen)
            run_attention.store_kv(kv.flat, k, v, torch.from_numpy(tables.slot),
                                   torch.from_numpy(tables.slot_cap), layer, kv.kv_heads, D,
                                   backend="torch")
            K, V = runs.gather_index(kv.kv_heads, D).kv(kv.flat, layer, D)
            first = 0
            for b, (i, n) in enumerate(lengths.items()):
                assert torch.equal(K[b, :, :n], k[first:first + n].transpose(0, 1))
                assert torch.equal(V[b, :, :n], v[first:first + n].transpose(0, 1))
                held = torch.cat([view[layer, :, :, :min(cap, n - at)]
                                  for at, cap, view in kv.views(i) if at < n], dim=2)
                assert torch.equal(held[0], K[b, :, :n]) and torch.equal(held[1], V[b, :, :n])
                first += n
    finally:
        alloc.close()


def test_a_slot_past_the_block_is_refused_not_written():
    cfg, _ = models.load_config("tiny-llama")
    bpt = models.kv_bytes_per_token(cfg, "float32")
    alloc = make_allocator("paged", "torch:cpu", 64 * bpt, bpt, 32,
                           AllocatorConfig(background_refresh=False), page_tokens=4)
    try:
        kv = KVPool(alloc, cfg, torch.float32, models.head_dim(cfg))
        alloc.reserve(0, 4, 0.0, 0.0)
        with pytest.raises(ValueError, match="past its block"):
            kv.step_tables([], [(0, 4, 1)])
    finally:
        alloc.close()


def test_cuda_graphs_and_triton_are_refused_where_they_cannot_run(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)     # the CPU runs no Triton then
    assert use_graphs("auto", "cpu", "torch") is False
    assert use_graphs("off", "cpu", "torch") is False
    with pytest.raises(BadArgument, match="needs a CUDA device"):
        use_graphs("on", "cpu", "torch")
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE_ROWS)
    for flags, words in ((["--cuda-graphs", "on"], "needs a CUDA device"),
                         (["--attention", "triton"], "triton")):
        code = main(["engine", "--trace", str(trace), "--model", "tiny-llama",
                     "--policy", "odma", *flags])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and words in err, err


def eager_graphs(monkeypatch, forward=None) -> list:
    """serve()'s decode graphs on the CPU: made as a GPU makes them, each size "captured" by
    one forward over the empty static inputs, each replay running forward(graphs, size) again
    (default graphs._forward(size), the function a GPU captures). Returns the list that the
    size of every decode batch a graph served is appended to."""
    from allocator.serving.engine import runner as runner_mod
    from allocator.serving.engine import serve as te

    forward = forward or (lambda graphs, size: graphs._forward(size))
    batches: list = []

    class Replay:
        def __init__(self, graphs, size):
            self.graphs, self.size = graphs, size
            forward(graphs, size)

        def replay(self):
            self.graphs.logits[self.size] = forward(self.graphs, self.size)

    def make_graphs(runner, max_batch, max_runs):
        graphs = runner_mod.DecodeGraphs(runner, max_batch, max_runs)
        graphs.graphs = {s: Replay(graphs, s) for s in reversed(graphs.sizes)}
        real = graphs.decode

        def decode(batch):
            logits = real(batch)
            assert logits is not None, "a decode step outgrew the graphs' run tables"
            batches.append(len(batch))
            return logits
        graphs.decode = decode
        runner.graphs = graphs

    monkeypatch.setattr(te, "use_graphs", lambda *a: True)
    monkeypatch.setattr(te, "make_graphs", make_graphs)
    return batches


def graph_requests(cfg, n=7, seed=3, longest=29):
    """n seeded requests: prompts of 3 to `longest` tokens, 1 to 19 tokens made of each."""
    from allocator.serving.engine import serve as te

    rng = np.random.default_rng(seed)
    prompts = te.prompt_ids(n, rng.integers(3, longest + 1, n), cfg.vocab_size, seed)
    return prompts, [int(g) for g in rng.integers(1, 20, n)]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_padded_decode_graph_steps_make_generates_tokens(monkeypatch, attention):
    """The decode graphs' static buffers, padding and table packing, replayed eagerly on the
    CPU (a CUDA graph replays exactly what it captured): every policy's tokens are still
    generate()'s, with batches that pad up to a larger size and lanes left empty; with the
    Triton kernels (interpreted) and the fused layers too, as a GPU captures them."""
    policies = ("odma", "paged", "extent", "elastic")
    if attention == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        policies = ("paged",)
    from allocator.serving.engine import serve as te

    replays = eager_graphs(monkeypatch)
    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    prompts, gen = graph_requests(cfg)
    reference = [model.generate(p[None], max_new_tokens=g, min_new_tokens=g, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, p.numel():].tolist()
                 for p, g in zip(prompts, gen)]
    bpt = models.kv_bytes_per_token(cfg, "float32")
    for policy in policies:
        replays.clear()
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=400 * bpt,
                       max_model_len=64, max_batch=6, page_tokens=4, predictor="noisy",
                       attention=attention,
                       config=AllocatorConfig(background_refresh=False, token_alignment=4,
                                              extent_knee_tokens=4, extent_max=4))
        assert run["tokens"] == reference, policy
        assert run["fused_layers"] is (attention == "triton")
        assert {3, 5} & set(replays), replays        # batches padded to 4 and 6


def test_every_decode_step_from_a_graph_makes_the_launches_it_captured(tri, monkeypatch):
    """A CUDA graph replays the launches it captured, with the arguments they had then: only
    the values in memory change. So every decode step through the graph of one padded size
    must make the capture's launches (the capture ran over the empty static inputs): the same
    operators and kernels, grids, Python numbers, shapes, strides and dtypes, the same memory
    for every tensor that outlives the step (weights, the pool, the static inputs) and the
    same host values copied in. A value of one step reaching a launch another way would be
    replayed stale on a GPU: wrong tokens and no error. Fused layers and Triton kernels, pages
    and extents."""
    from unittest import mock

    from torch.overrides import TorchFunctionMode

    from allocator.serving.engine import serve as te
    from allocator.serving.engine.launches import Launches

    captured: dict = {}
    replayed = collections.Counter()
    numpy_tensor = torch.from_numpy

    def recorded(graphs, size):
        r = graphs.runner
        lasting = {t.untyped_storage().data_ptr() for t in (
            *r.model.parameters(), *r.model.buffers(), r.kv.flat, graphs.device_bytes)}

        def arg(a):
            if isinstance(a, torch.Tensor):
                kept = a.untyped_storage().data_ptr() in lasting
                return (tuple(a.shape), a.stride(), a.dtype, a.data_ptr() if kept else None)
            if isinstance(a, (list, tuple)):
                return tuple(arg(b) for b in a)
            if isinstance(a, dict):
                return tuple((k, arg(v)) for k, v in sorted(a.items()))
            return a            # a Python number, a dtype, None

        calls: list = []

        class HostData(TorchFunctionMode):     # torch.tensor(...) of Python values
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in (torch.tensor, torch.as_tensor) and not torch.is_tensor(args[0]):
                    calls.append(("host data", np.asarray(args[0]).tolist()))
                return func(*args, **(kwargs or {}))

        def from_numpy(array):
            calls.append(("host data", array.tolist()))
            return numpy_tensor(array)

        with mock.patch.object(torch, "from_numpy", from_numpy), HostData(), \
                Launches(lambda name, args, kwargs: calls.append((name, arg(args), arg(kwargs)))):
            logits = graphs._forward(size)
        if size not in captured:
            captured[size] = calls
        else:
            replayed[size] += 1
            assert calls == captured[size], f"a step through the graph of {size} launches " \
                f"otherwise than its capture"
        return logits

    batches = eager_graphs(monkeypatch, recorded)
    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "float32", tri, seed=0)
    prompts, gen = graph_requests(cfg)
    bpt = models.kv_bytes_per_token(cfg, "float32")
    for policy in ("paged", "extent"):
        captured.clear()
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=400 * bpt,
                       max_model_len=64, max_batch=6, page_tokens=4, attention="triton",
                       config=AllocatorConfig(background_refresh=False, token_alignment=4,
                                              extent_knee_tokens=4, extent_max=4))
        assert run["fused_layers"] is True and all(c for c in captured.values())
    assert len(batches) == sum(replayed.values()) and len(replayed) >= 3, replayed


def test_a_capture_that_fails_once_is_tried_again_with_the_collector_kept_out(monkeypatch):
    import gc
    import io

    from allocator.serving.engine import runner as runner_mod

    tries = []

    def capture(self):
        tries.append(gc.isenabled())
        if len(tries) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(runner_mod.DecodeGraphs, "__init__", lambda self, *a: None)
    monkeypatch.setattr(runner_mod.DecodeGraphs, "capture", capture)
    monkeypatch.setattr(runner_mod.torch.cuda, "synchronize", lambda: None)
    runner = types.SimpleNamespace(graphs=None)
    warn = io.StringIO()
    graphs = runner_mod.make_graphs(runner, 4, 16, warn=warn)
    assert graphs is not None and runner.graphs is graphs
    assert tries == [False, False] and gc.isenabled()
    assert warn.getvalue() == ""


def test_a_failed_capture_runs_eagerly_after_one_line():
    """Where capture fails (here: no CUDA at all), the runner keeps no graphs and says so in one
    line; its steps then run eagerly."""
    import io

    from allocator.serving.engine import runner as runner_mod
    from allocator.serving.engine import serve as te

    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    bpt = models.kv_bytes_per_token(cfg, "float32")
    alloc = make_allocator("odma", "torch:cpu", 200 * bpt, bpt, 64,
                           AllocatorConfig(background_refresh=False))
    try:
        runner = runner_mod.Runner(model, KVPool(alloc, cfg, torch.float32, models.head_dim(cfg)))
        warn = io.StringIO()
        assert runner_mod.make_graphs(runner, 4, 16, warn=warn) is None
        assert runner.graphs is None
        lines = warn.getvalue().strip().splitlines()
        assert len(lines) == 1 and "running eagerly" in lines[0], lines
        alloc.reserve(0, 5, 2.0, 0.0)
        assert runner.prefill([(0, [3, 4, 5, 6, 7])]).shape == (1, cfg.vocab_size)
    finally:
        alloc.close()


@pytest.mark.parametrize("attention,policy,chunk", [
    ("torch", "extent", None), ("triton", "odma", None), ("triton", "paged", 16)],
    ids=["torch-extent", "triton-odma", "triton-paged-chunked"])
def test_whole_prompts_over_run_tables_make_generates_tokens(request, attention, policy, chunk):
    """--prompt-attention runs: whole prompts (and first chunks) go with the chunks through the
    run-table prefill kernel, reading back the K and V just stored, in place of a dense
    attention per prompt; the tokens are still generate()'s, on both backends."""
    from allocator.serving.engine import serve as te
    from test_hf_reference import reference

    device = request.getfixturevalue("tri") if attention == "triton" else "cpu"
    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", device, seed=0)
    rng = np.random.default_rng(7)
    prompts = te.prompt_ids(6, rng.integers(1, 30, 6), cfg.vocab_size, 7)
    gen = [int(g) for g in rng.integers(1, 8, 6)]
    bpt = models.kv_bytes_per_token(cfg, "float32")
    run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=300 * bpt,
                   max_model_len=48, max_batch=4, page_tokens=4, max_batched_tokens=chunk,
                   attention=attention, prompt_attention="runs",
                   config=AllocatorConfig(background_refresh=False, token_alignment=4,
                                          extent_knee_tokens=4, extent_max=4))
    assert run["prompt_attention"] == "runs"
    assert run["tokens"] == reference(model, prompts, gen)


def test_whole_prompts_over_run_tables_are_one_launch_a_layer_for_any_prompt_count(tri):
    """A prefill step's layer: the dense attention costs two launches a prompt (the attention,
    the copy into the step's rows); over run tables, one for all of them, and the fused layer is
    then the decode step's nine launches."""
    from allocator.serving.engine.launches import step_launches

    cfg, _ = models.load_config("tiny-qwen2")
    dense = [step_launches(cfg, "triton", "on", tri, n, "prefill", "dense")[0] for n in (1, 3)]
    runs = [step_launches(cfg, "triton", "on", tri, n, "prefill", "runs") for n in (1, 3)]
    assert dense[1] - dense[0] >= 2 * 2
    assert runs[0][0] == runs[1][0] <= 10
    assert runs[1][2]["triton:prefill"] == 4             # one a layer (the 4-layer count)
    with pytest.raises(BadArgument, match="--prompt-attention"):
        step_launches(cfg, "triton", "on", tri, 2, "prefill", "flash")


# the ways a tensor's values reach the host, each a wait for the device's queued work
HOST_READS = {"item", "tolist", "numpy", "cpu", "__array__", "__bool__", "__int__", "__float__",
              "__index__"}
# operators whose result depends on values the host must see (sizes, Python scalars)
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "equal",
               "_unique2", "unique_consecutive"}
# and these where an index is a boolean mask (on a GPU, its nonzero() first)
MASKABLE_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


def waits_for_values(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in MASKABLE_OPS and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return name in SYNCING_OPS


@pytest.mark.parametrize("policy,pool,sched,paths", [
    ("extent", 70, dict(preemption="swap", swap_bytes=1 << 20, max_batched_tokens=12,
                        prompt_attention="runs"), {"chunk", "migrate", "swap", "resume"}),
    ("paged", 60, {}, {"preempt"})], ids=["extent-chunked-swapped", "paged-prompts-recomputed"])
def test_a_step_on_the_kernels_path_reads_back_only_its_tokens(tri, monkeypatch, policy, pool,
                                                               sched, paths):
    """No host synchronisation inside a step where a GPU runs it (the Triton kernels, here
    interpreted): no operator of the forward pass waits for values (.item(), a boolean mask),
    the forward reads no tensor but the token ids it is given (host memory), and the one read
    of a step is its chosen tokens, once for the whole batch; over extents and pages, through
    an extent merge, preemptions (recomputed and swapped), whole prompts and chunks. A read
    inside the forward would stall the device every step, and a CUDA graph could not capture
    it."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from allocator.serving.engine import runner as runner_mod
    from allocator.serving.engine import serve as te

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if waits_for_values(func, args):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.reads, self.inputs = [], set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if (name in HOST_READS and args and isinstance(args[0], torch.Tensor)
                    and id(args[0]) not in self.inputs):
                self.reads.append(name)
            return func(*args, **(kwargs or {}))

    reads, syncs, forwards = Reads(), Syncs(), []
    forward = runner_mod.Runner.forward

    def watched(self, batch):
        reads.inputs = {id(ids) for _, ids, _ in batch if isinstance(ids, torch.Tensor)}
        before = len(reads.reads)
        with syncs:
            logits = forward(self, batch)
        forwards.append(len(reads.reads) - before)
        return logits

    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "float32", tri, seed=0)
    prompts, gen = graph_requests(cfg, n=6, seed=12, longest=25)
    log: list = []
    bpt = models.kv_bytes_per_token(cfg, "float32")
    monkeypatch.setattr(runner_mod.Runner, "forward", watched)
    with reads:
        run = te.serve(model, prompts, gen, np.zeros(len(gen)), policy, pool_bytes=pool * bpt,
                       max_model_len=48, max_batch=6, page_tokens=4, predictor="noisy",
                       attention="triton", log=log,
                       config=AllocatorConfig(background_refresh=False, token_alignment=4,
                                              extent_knee_tokens=4, extent_max=2), **sched)
    assert run["attention"] == "triton" and all(r.made == g for r, g in zip(run["requests"], gen))
    assert {w for w, _ in log} >= paths | {"preempt"}, log     # the paths above were taken
    assert syncs.ops == []
    assert forwards and set(forwards) == {0}, "the forward pass read a tensor back"
    assert reads.reads == ["tolist"] * len(forwards)          # each step's tokens, once
