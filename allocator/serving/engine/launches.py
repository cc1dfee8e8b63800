"""Kernel launches of a piece of the engine, counted on any device: every torch operator that
computes (views and allocations are not launches) and every Triton kernel launch. On a GPU at
a decode batch each launch costs a few microseconds whatever it computes, so their count is
what a layer costs there; counted on the CPU (Triton under TRITON_INTERPRET=1) it is the same
count, since the same operators and kernels run.

    with Launches() as n:
        runner.decode(...)
    n.total, n.by_name

Around Runner steps: inside the block the kernels are wrapped, so serve()'s count of kernel
compilations (which reads the kernels' own caches) would not work there.
"""

from __future__ import annotations

import collections
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

from allocator.serving.engine import run_kernels

# operators that allocate or reshape without computing: no kernel runs
_NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like",
              "_unsafe_view"}


class Launches(TorchDispatchMode):
    """Counts launches inside its `with` block: by_name (a Counter: aten operator names and
    "triton:<kernel>") and total; on_launch(name, args, kwargs), where given, sees each one as
    it is made (a Triton launch's args start with its grid)."""

    def __init__(self, on_launch=None):
        super().__init__()
        self.by_name: collections.Counter = collections.Counter()
        self.on_launch = on_launch
        self._inside_triton = 0
        self._patch = None

    def _count(self, name, args, kwargs):
        self.by_name[name] += 1
        if self.on_launch is not None:
            self.on_launch(name, args, kwargs or {})

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside_triton and not func.is_view and name not in _NO_KERNEL:
            self._count(name, args, kwargs)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        kernels = run_kernels.kernels(run_kernels.interpreting())
        counter = self

        class Counted:
            """A kernel whose launch counts once; what it runs inside (the interpreter's own
            tensor work on the CPU) does not."""

            def __init__(self, name, kern):
                self.name, self.kern = name, kern

            def __getitem__(self, grid):
                launch = self.kern[grid]

                def run(*args, **kwargs):
                    counter._count("triton:" + self.name, (grid, *args), kwargs)
                    counter._inside_triton += 1
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        counter._inside_triton -= 1
                return run

        counted = {name: Counted(name, kern) for name, kern in kernels.items()}
        self._patch = mock.patch.object(run_kernels, "kernels", lambda interpret: counted)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patch.stop()


def step_launches(config, backend: str, fused: str, device: str = "cpu", batch: int = 4,
                  step: str = "decode", prompts: str = "dense") -> tuple[int, int,
                                                                       collections.Counter]:
    """(launches a layer, launches of the rest of the step, the 4-layer step's launches by
    name) of one step on the model of `config` (random weights, float32): a decode step of
    `batch` requests with 9 tokens of context, or (step="prefill") a step of `batch` whole
    prompts of 9 tokens, attending per `prompts` (runner.PROMPT_ATTENTION). The same step is
    counted on the model cut to 2 and to 4 layers, so the layer's count is exact."""
    import torch

    from allocator.config import AllocatorConfig
    from allocator.policies import make_allocator
    from allocator.serving import models
    from allocator.serving.engine.kv_runs import KVPool
    from allocator.serving.engine.runner import Runner
    from allocator.serving.engine.serve import build_model

    counts = []
    for layers in (2, 4):
        cut = models.with_layers(config, layers)
        model = build_model(cut, "float32", device, seed=0)
        bpt = models.kv_bytes_per_token(cut, "float32")
        alloc = make_allocator("odma", f"torch:{device}", batch * 64 * bpt, bpt, 32,
                               AllocatorConfig(background_refresh=False))
        try:
            runner = Runner(model, KVPool(alloc, cut, torch.float32, models.head_dim(cut)),
                            backend, fused, prompts)
            for i in range(batch):
                alloc.reserve(i, 16, 4.0, 0.0)
            prefill = [(i, list(range(3, 12))) for i in range(batch)]
            if step == "decode":
                runner.prefill(prefill)
            with Launches() as n:
                if step == "decode":
                    runner.decode(list(range(5, 5 + batch)), [9] * batch, list(range(batch)))
                else:
                    runner.prefill(prefill)
            counts.append(n.total)
        finally:
            alloc.close()
    per_layer = (counts[1] - counts[0]) // 2
    return per_layer, counts[0] - 2 * per_layer, n.by_name
