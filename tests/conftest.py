"""What every test may assume of the process it runs in."""

import signal

import pytest

from test_allocator_fakes import backend_params, open_or_skip

# A shell starts background jobs with Ctrl-C ignored, and an ignored signal stays ignored in
# every child: the Ctrl-C tests (which interrupt odma-hw and expect exit 130) would then test
# nothing. Python's own handler here, and the default disposition in the children it starts.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(params=backend_params())
def device(request):
    """Each device backend here in turn: host, emulated, torch:cpu, and any GPU or MLU found."""
    dev = open_or_skip(request.param)
    yield dev
    dev.close()
