"""What every test may assume of the process it runs in."""

import importlib
import os
import pathlib
import signal
import sys

import pytest

from odma_cli.main import end_on_sigterm_as_on_ctrl_c
from test_allocator_fakes import backend_params, open_or_skip

# A shell starts background jobs with Ctrl-C ignored, and an ignored signal stays ignored in
# every child: the Ctrl-C tests (which interrupt odma-hw and expect exit 130) would then test
# nothing. Python's own handler here, and the default disposition in the children it starts.
signal.signal(signal.SIGINT, signal.default_int_handler)
# A time limit's SIGTERM ends the run as Ctrl-C does: pytest reports what ran and what failed
# (bench/gpu_check.sh's pytest_gpu step), where the default would end it with no summary.
end_on_sigterm_as_on_ctrl_c()


@pytest.fixture(params=backend_params())
def device(request):
    """Each device backend here in turn: host, emulated, torch:cpu, and any GPU or MLU found."""
    dev = open_or_skip(request.param)
    yield dev
    dev.close()


class _QuietHost:
    """What the engine sees of other processes' CPU share in the tests: nothing (None)."""

    def share(self):
        return None


@pytest.fixture(autouse=True)
def _quiet_host(monkeypatch):
    """The engine's busy-host warning depends on whatever else the machine runs (another test
    run, a helper's build): tests that count the engine's stderr lines must not see it, so it
    is off here; tests/test_engine.py sets the share it tests the warning with."""
    try:
        from allocator.serving.engine import cli as engine_cli
    except ImportError:             # the tests that do not need the engine still run
        return
    monkeypatch.setattr(engine_cli, "OtherLoad", _QuietHost)


@pytest.fixture
def tri(monkeypatch):
    """The device the Triton kernels run on: CUDA, or the CPU under the interpreter."""
    pytest.importorskip("triton")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


@pytest.fixture
def bench():
    """bench(NAME): the script bench/NAME.py as a module, bench/ on sys.path while it imports
    (the scripts import their neighbours by name)."""
    folder = str(pathlib.Path(__file__).resolve().parents[1] / "bench")

    def load(name: str):
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.pop(0)
    return load
