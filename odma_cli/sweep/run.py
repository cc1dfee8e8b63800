"""Running cells on Ray: the worker side, starting or joining a cluster, dispatch, progress and
Ctrl-C.

Ray is optional (pip install 'odma-hw[sweep]') and imported only when cells are to run. By
default `ray.init()` starts a single-machine cluster with one worker per core; an address joins
a running cluster, and one where none answers fails in seconds with one line, not after Ray's
20 to 35 s of retries. Each cell calls the command's compute() in a Ray task holding one CPU
(in-process: no shell), in the driver's folder where it exists, so relative paths mean what
they mean on the command line. Ctrl-C keeps every finished cell; further Ctrl-C while Ray shuts
down wait for it to finish.

Numba: a worker process runs one small emulate before its first cell of a command that uses
the emulator (warm_up_seconds on that row), so no wall_seconds includes compilation or cache
loading, and runs Numba on the one CPU its task holds unless the cell gives --threads.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from odma_cli.argtypes import parse_line
from odma_cli.errors import BadArgument, OdmaError
from odma_cli.sweep.cells import Plan
from odma_cli.sweep.grid import INSTALL_HINT, command_parser, uses_numba
from odma_cli.sweep.log import OutputError, ResultLog, cell_records, output_rows

TCP_TIMEOUT_S = 3.0
# Ray's settings for how long joining a cluster waits (seconds): the GCS's tries, one a
# second; the Ray client's first and longest connection timeouts (three tries)
JOIN_TIMEOUTS = {"RAY_gcs_server_port_wait_time_s": "5",
                 "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1",
                 "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "2"}
# the authentication mode of a cluster the sweep starts itself: the one Ray picks for a new
# local cluster (only Ray then also warns on every start that it picked it)
LOCAL_AUTH_MODE = {"RAY_AUTH_MODE": "token"}


# ------------------------------------------------------------------------ the Ray worker side
_WORKER = {"warm": False}


def warm_up(module: str) -> float:
    """Run the command module's warm_up() (its Numba code loaded or compiled) in this process
    once; its seconds."""
    if _WORKER["warm"]:
        return 0.0
    t0 = time.perf_counter()
    importlib.import_module(module).warm_up()
    _WORKER["warm"] = True
    return time.perf_counter() - t0


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def run_cell(module: str, argv: list, cwd: str | None, numba_threads: int | None) -> dict:
    """One cell, in a Ray worker: the command's parser and compute(), nothing printed. The
    cell's own failure comes back as status 'failed' with a one-line error, never raised.
    numba_threads: warm the emulator up first and run it on this many threads."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # relative paths in a grid mean the driver's folder, as on a command line
    warm = 0.0
    result = {"status": "ok", "error": None, "rows": []}
    t0 = time.perf_counter()
    try:
        if numba_threads:
            warm = warm_up(module)
            import numba

            numba.set_num_threads(min(numba_threads, numba.config.NUMBA_NUM_THREADS))
        t0 = time.perf_counter()
        args = parse_line(command_parser(module, argv[0]), list(argv[1:]))
        result["rows"] = output_rows(importlib.import_module(module).compute(args))
    except Exception as exc:
        result.update(status="failed", error=one_line(exc))
    ray = sys.modules.get("ray")
    node = ""
    if ray is not None and ray.is_initialized():  # in a Ray worker: which node it ran on
        node = "@" + ray.get_runtime_context().get_node_id()[:8]
    result.update(wall_seconds=time.perf_counter() - t0, warm_up_seconds=warm,
                  worker=f"{socket.gethostname()}:{os.getpid()}{node}")
    return result


# ------------------------------------------------------------------------------ progress
class Progress:
    """Cells done / failed / total and an ETA on stderr: one line rewritten on a terminal,
    otherwise a line per tenth of the cells (or every 30 s)."""

    def __init__(self, stream, name: str, total: int, skipped: int):
        self.stream, self.name, self.total = stream, name, total
        self.done = self.skipped = skipped
        self.failed = 0
        self.tty = stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.shown = -1
        self.text = ""
        if skipped:
            print(f"sweep {name}: {skipped} of {total} cells already done (--resume)",
                  file=stream, flush=True)

    def finished(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok

    def line(self, running: int) -> str:
        ran = self.done - self.skipped
        elapsed = time.perf_counter() - self.t0
        eta = "-"
        if ran:
            eta = str(datetime.timedelta(seconds=round(elapsed / ran * (self.total - self.done))))
        return (f"sweep {self.name}: {self.done}/{self.total} cells done, {self.failed} failed, "
                f"{running} running, ETA {eta}")

    def show(self, running: int = 0, final: bool = False) -> None:
        now = time.perf_counter()
        text = self.line(running)
        if self.tty:
            end = "\n" if final else ""
            print("\r" + text.ljust(78), end=end, file=self.stream, flush=True)
            return
        tenth = 10 * self.done // max(1, self.total)
        if (final or tenth > self.shown or now - self.last > 30) and text != self.text:
            self.shown, self.last, self.text = tenth, now, text
            print(text, file=self.stream, flush=True)


# ------------------------------------------------------------------------ starting Ray
def choose_local_auth() -> None:
    """Name the authentication mode of the local cluster this process is about to start, where
    the user has not (RAY_AUTH_MODE) and no RAY_ADDRESS points elsewhere: token, what Ray picks
    itself, which it otherwise announces in a warning on every start. Ray reads the mode once,
    when it is imported, so this happens before that or not at all: set later, the driver
    would keep the mode it read and the cluster's processes would refuse it."""
    if "ray" in sys.modules or "RAY_AUTH_MODE" in os.environ or os.environ.get("RAY_ADDRESS"):
        return
    os.environ.update(LOCAL_AUTH_MODE)


def import_ray():
    """The ray module, or BadArgument saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise BadArgument(f"sweep needs Ray ({exc}): {INSTALL_HINT}") from None
    return ray


def _host_port(address: str) -> tuple[str, int]:
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BadArgument(f"--address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def resolve_address(address: str) -> str:
    """`auto` -> the running cluster's HOST:PORT (RAY_ADDRESS, else the latest `ray start` on
    this machine); other forms as given, checked for shape."""
    if address != "auto":
        _host_port(address)
        return address
    import_ray()
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except Exception as exc:
        raise BadArgument(f"--address auto: no running Ray cluster found ({one_line(exc)}); "
                          f"start one with `ray start --head`") from None
    if not found:
        raise BadArgument("--address auto: no running Ray cluster found; start one with "
                          "`ray start --head`")
    return found


def check_reachable(address: str, timeout: float = TCP_TIMEOUT_S) -> None:
    """BadArgument unless the cluster's port accepts a TCP connection within `timeout` (the
    quick answer for a host that is down or a port nobody listens on)."""
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise BadArgument(f"--address {address}: no Ray cluster answers at {host}:{port} "
                          f"({exc.strerror or exc})") from None


@contextlib.contextmanager
def _join_timeouts():
    """Ray's own waits for a cluster to answer, bounded to seconds while joining (where the
    user has not set them): the TCP check passes wherever something, a proxy say, accepts
    connections, and Ray would then retry for 20 s (GCS) or 35 s (Ray client)."""
    added = [k for k in JOIN_TIMEOUTS if k not in os.environ]
    os.environ.update({k: JOIN_TIMEOUTS[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def _held_stderr():
    """Hold back what is written to file descriptor 2 (Ray's C++ client logs every failed try
    to reach a cluster there); pass it on only when the block succeeds, so a failure is one
    line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
                sys.stderr.flush()


def connect(ray, address: str | None, workers: int | None) -> bool:
    """Start or join Ray unless this process already has; True when this call started it (and
    so must shut it down)."""
    if ray.is_initialized():
        return False
    # before init: a Ctrl-C that cuts starting Ray short leaves it to the exit too
    atexit.register(_shut_down_at_exit, ray)
    try:
        if address is None:
            ray.init(num_cpus=workers or os.cpu_count() or 1, include_dashboard=False,
                     log_to_driver=False, logging_level=logging.WARNING)
        else:
            with _join_timeouts(), _held_stderr():
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:
        if address is None:
            raise OdmaError(f"cannot start Ray: {one_line(exc)}") from None
        raise BadArgument(f"--address {address}: cannot join a Ray cluster there: "
                          f"{one_line(exc)} (a cluster with token authentication also needs "
                          f"RAY_AUTH_MODE=token here)") from None
    return True


def shut_down(ray) -> None:
    """Shut down the Ray that connect() started, so that the exit has nothing left to do."""
    ray.shutdown()
    atexit.unregister(_shut_down_at_exit)


def _shut_down_at_exit(ray) -> None:
    # Ray's own exit hook sleeps half a second for its logs before it shuts down, and a Ctrl-C
    # then prints a traceback; this one runs before it (registered later) and ignores Ctrl-C,
    # which can only ask for the exit already under way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ray.shutdown()


def cluster_cpus(ray) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


# ------------------------------------------------------------------------ dispatch
@dataclass
class Outcome:
    ran: int = 0
    failed: int = 0
    interrupted: bool = False
    output_error: OutputError | None = None     # the log could not be written: the sweep stopped


@contextlib.contextmanager
def ctrl_c_held():
    """Hold Ctrl-C off while the block runs (shutting Ray down: cut short, Ray's own exit hook
    would do it again and a further Ctrl-C there prints a traceback); yields a list that holds a
    SIGINT for each Ctrl-C that came meanwhile. Only the main thread can hold signals; elsewhere
    the block runs as it is."""
    came = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


def dispatch(ray, the_plan: Plan, todo, log: ResultLog, progress: Progress, *,
             window: int, retries: int = 1, cancel: bool = True) -> Outcome:
    """Run the `todo` cells (any iterable, taken as needed) as Ray tasks, at most `window` in
    flight (so the driver holds a bounded number of references however large the grid); each
    cell's rows are logged as it finishes. Ctrl-C returns, marked interrupted, and a log that
    cannot be written returns with its OutputError, after cancelling the tasks in flight when
    `cancel` (a cluster this process started is better shut down: its workers die with it, and
    Ray's driver can abort when a cancelled task's completion races the shutdown)."""
    command = the_plan.grid.command
    cpus = cluster_cpus(ray)
    task = ray.remote(run_cell).options(num_cpus=1, max_retries=retries, retry_exceptions=False)
    threads = 1 if uses_numba(command) else None
    cwd = os.getcwd()
    pending = iter(todo)
    more = True
    in_flight = {}
    outcome = Outcome()
    try:
        while more or in_flight:
            while more and len(in_flight) < window:
                cell = next(pending, None)
                if cell is None:
                    more = False
                    break
                in_flight[task.remote(the_plan.module, list(cell.argv), cwd, threads)] = cell
            if not in_flight:
                break
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)
            for ref in ready:
                cell = in_flight.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker died, a node was lost
                    result = {"status": "failed", "error": one_line(exc), "rows": [],
                              "wall_seconds": None, "warm_up_seconds": None, "worker": None}
                log.write(cell_records(cell, result))
                outcome.ran += 1
                outcome.failed += result["status"] != "ok"
                progress.finished(result["status"] == "ok")
            progress.show(min(len(in_flight), cpus))
    except KeyboardInterrupt:
        outcome.interrupted = True
    except OutputError as exc:
        outcome.output_error = exc
    if cancel and in_flight and (outcome.interrupted or outcome.output_error):
        with ctrl_c_held() as came:
            for ref in in_flight:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # already finished or its worker already gone
                    pass
        outcome.interrupted |= bool(came)
    return outcome
