"""odma-hw's shell: the command line (main.py) and the registry of commands (commands.py) that
every package offers its commands through, the sweep over any command (sweep/), and what every
command shares: its errors and exit statuses (errors.py), option types (argtypes.py), JSON
output (jsonout.py), plots (plotting.py) and TOML input (tomlread.py).

It sits below both the hardware layer (odma_hw) and the allocator: it imports neither, and
reaches their commands only by the names the registry holds (tests/test_layering.py).
"""

__version__ = "0.1.0"
