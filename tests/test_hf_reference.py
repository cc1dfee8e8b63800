"""The hf reference: transformers' own continuous batching serves a trace and makes exactly the
tokens generate() makes, each request its full number of tokens (end-of-sequence ignored), never
before its arrival and never more than max_batch at once; its run summarises like serve()'s."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from allocator.serving import models  # noqa: E402
from allocator.serving.core.metrics import summarise_engine  # noqa: E402
from allocator.serving.engine import hf_reference as hf  # noqa: E402
from allocator.serving.engine import serve as te  # noqa: E402
from odma_cli.errors import DeviceUnavailable  # noqa: E402

ON_CPU = not torch.cuda.is_available()
# without an accelerator transformers sizes its cache against host memory read with psutil
needs_memory_probe = pytest.mark.skipif(
    ON_CPU and importlib.util.find_spec("psutil") is None,
    reason="transformers' continuous batching on CPU needs psutil")


def requests(n=12, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    plen = rng.integers(5, 61, n)
    gen = [int(g) for g in rng.integers(1, 41, n)]
    return te.prompt_ids(n, plen, vocab, seed), gen


def reference(model, prompts, gen):
    """generate()'s greedy tokens with end-of-sequence off, as serve() and run_hf make them."""
    out = []
    for p, g in zip(prompts, gen):
        ids = model.generate(p[None].to(model.device), max_new_tokens=g, min_new_tokens=g,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, p.numel():].tolist())
    return out


@pytest.fixture(scope="module", params=("tiny-qwen2", "tiny-llama"))
def tiny(request):
    cfg, _ = models.load_config(request.param)
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    prompts, gen = requests(vocab=cfg.vocab_size)
    return request.param, model, prompts, gen, reference(model, prompts, gen)


@needs_memory_probe
def test_makes_generates_tokens_in_arrival_order_within_max_batch(tiny):
    name, model, prompts, gen, ref = tiny
    arrivals = np.sort(np.random.default_rng(1).uniform(0.0, 0.3, len(gen)))
    run = hf.run_hf(model, prompts, gen, arrivals, max_batch=4)
    assert run["tokens"] == ref, name
    for r, g, a in zip(run["requests"], gen, arrivals):
        assert r.made == g and len(run["tokens"][r.rid]) == g
        assert r.arrival == a
        assert r.first_token is not None and r.finish is not None
        assert a <= r.first_token <= r.finish <= run["seconds"]
    assert 1 <= run["peak_batch"] <= 4
    assert run["batch_sum"] >= run["steps"] >= max(gen)
    assert run["preemptions"] == 0
    assert run["startup_seconds"] > 0
    assert model.config._attn_implementation == "sdpa"      # left as it was
    s = summarise_engine("hf", run, {"model": name})
    assert s["completed"] == len(gen) and s["output_tokens"] == sum(gen)
    assert s["mean_batch"] <= 4


@needs_memory_probe
def test_at_most_max_batch_requests_run_at_once(tiny):
    name, model, prompts, gen, ref = tiny
    run = hf.run_hf(model, prompts, gen, np.zeros(len(gen)), max_batch=3)
    assert run["tokens"] == ref, name
    assert run["peak_batch"] == 3
    # a request runs from its first token to its last: never four of those spans overlap
    spans = [(r.first_token, r.finish) for r in run["requests"]]
    for t, _ in spans:
        assert sum(a <= t <= b for a, b in spans) <= 3


@needs_memory_probe
def test_the_models_end_of_sequence_token_does_not_stop_a_request():
    cfg, _ = models.load_config("tiny-qwen2")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    prompts, _ = requests(n=2, vocab=cfg.vocab_size)
    gen = [24, 24]
    ref = reference(model, prompts, gen)
    # make a token each request emits early the model's end of sequence
    eos = [ref[0][3], ref[1][5]]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    run = hf.run_hf(model, prompts, gen, [0.0, 0.0], max_batch=2)
    assert run["tokens"] == ref
    assert [len(t) for t in run["tokens"]] == gen


def test_no_continuous_batching_is_device_unavailable(monkeypatch):
    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    prompts, gen = requests(n=1, vocab=cfg.vocab_size)
    # the module as imported now: transformers may have swapped its sys.modules entry meanwhile
    monkeypatch.setattr(sys.modules["transformers"], "ContinuousBatchingConfig", None)
    with pytest.raises(DeviceUnavailable, match="no continuous batching"):
        hf.run_hf(model, prompts, gen, [0.0], max_batch=1)


@pytest.mark.skipif(not ON_CPU, reason="with an accelerator transformers reads its memory")
def test_no_psutil_on_cpu_is_device_unavailable(monkeypatch):
    cfg, _ = models.load_config("tiny-llama")
    model = te.build_model(cfg, "float32", "cpu", seed=0)
    prompts, gen = requests(n=1, vocab=cfg.vocab_size)
    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(DeviceUnavailable, match="psutil"):
        hf.run_hf(model, prompts, gen, [0.0], max_batch=1)
