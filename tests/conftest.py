"""What every test may assume of the process it runs in."""

import signal

# A shell starts background jobs with Ctrl-C ignored, and an ignored signal stays ignored in
# every child: the Ctrl-C tests (which interrupt odma-hw and expect exit 130) would then test
# nothing. Python's own handler here, and the default disposition in the children it starts.
signal.signal(signal.SIGINT, signal.default_int_handler)
