"""Start ``python SCRIPT.py ...``, ``sslkit ...`` and ``torchrun ...`` for the tests as new processes forked from a
server that has torch imported, not as new interpreters that import it again.

A training command's interpreter spends about 5 s of a core importing torch, torch._dynamo (torch's optimizers
import it) and torchvision before sslkit's first line; the suite starts dozens of them. Here each one is a fork of
a server that imported them once (multiprocessing's fork server, with the preload sslkit's own launcher gives its
workers), which then takes on what a new interpreter would have: the command's argv, environment, working folder,
``sys.path`` (the script's folder, PYTHONPATH, site-packages), standard streams, its own session when asked, the
signal dispositions of an interpreter started from a terminal (SIGINT raising KeyboardInterrupt, SIGPIPE ignored,
the rest default, where a pytest-xdist worker's children would inherit its ignored SIGINT and SIGHUP),
glibc's malloc thresholds of ``tools/run.py``'s re-execution, no fork server or resource tracker of its parent's,
and ``atexit`` at the end. What only a new interpreter shows (what an import loads, the re-execution itself, a
torch that does not import) is tested with :func:`subprocess.run` directly; ``SSLKIT_TESTS_NEW_INTERPRETERS=1``
starts every command as a new interpreter.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import torch

from sslkit.distributed import WORKER_PRELOAD, ParentFd
from sslkit.launch.runtime import TUNED_MALLOC

__all__ = ["ForkedProcess", "ensure_server", "popen", "run"]

_CTX = multiprocessing.get_context("forkserver")
#: Console scripts installed beside this interpreter that are forked like ``python SCRIPT.py`` (torchrun's agent
#: starts its ranks as new interpreters itself).
CONSOLE_SCRIPTS = ("sslkit", "torchrun")
_BASE_PATH: list[str] = []
#: ensure_server and _base_path are called from several threads at once (tests/test_docs.py runs its commands in a
#: thread pool): one at a time, so that the environment ensure_server swaps and the path computed once are seen whole.
_LOCK = threading.Lock()
#: Composing a config asks torch whether CUDA is there (machine.device=auto), which starts CUDA's driver in the
#: server where a GPU is: every process forked from it then fails at its first CUDA call ("Cannot re-initialize
#: CUDA in forked subprocess"). On such a machine the forked processes compose for themselves.
_WARM = [] if torch.cuda.is_available() else ["forkwarm"]


def ensure_server() -> None:
    """Start this process's fork server once, with sslkit's worker preload and the malloc thresholds a run's
    processes have (read by glibc when a process starts, so they must be in the server's environment), and the
    small recipes composed (tests/forkwarm.py, found through the server's PYTHONPATH: a fork server starts with the
    interpreter's default ``sys.path``; each forked process gets its own ``sys.path`` and environment)."""
    with _LOCK:
        _ensure_server()


def _ensure_server() -> None:
    saved = dict(os.environ)
    tests = str(Path(__file__).resolve().parent)
    os.environ.update({**TUNED_MALLOC, "SSLKIT_MALLOC_TUNED": "1",
                       "PYTHONPATH": os.pathsep.join([tests, *filter(None, [saved.get("PYTHONPATH")])])})
    try:
        _CTX.set_forkserver_preload([*WORKER_PRELOAD, *_WARM])  # (forkwarm: the small recipes composed)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _base_path() -> list[str]:
    """``sys.path`` of a new interpreter without PYTHONPATH, less its first entry (the script's folder)."""
    with _LOCK:
        if not _BASE_PATH:
            _BASE_PATH.extend(_new_interpreter_path())
    return _BASE_PATH


def _new_interpreter_path() -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out)


def _script(argv: list[str]) -> str | None:
    """The Python file ``argv`` runs (``python FILE.py ...`` or a console script installed beside this
    interpreter), or None when it runs something else (``-c``, ``-m``, another program)."""
    if os.environ.get("SSLKIT_TESTS_NEW_INTERPRETERS") == "1" or not argv:
        return None
    if argv[0] == sys.executable and len(argv) > 1 and argv[1].endswith(".py"):
        return argv[1]
    program = Path(argv[0])
    if program.parent == Path(sys.executable).parent and program.name in CONSOLE_SCRIPTS:
        return str(program)
    return None


def _fd(stream: Any, default: int, devnull: int, stdout_fd: int | None = None) -> int:
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return devnull
    if stream == subprocess.STDOUT:
        assert stdout_fd is not None
        return stdout_fd
    return stream if isinstance(stream, int) else stream.fileno()


def _forget_parent_servers() -> None:
    """A new interpreter has no fork server or resource tracker yet and starts processes by the platform's default
    method: drop the server's, so that a run starting processes starts them as it would (as its children, in its
    process group)."""
    from multiprocessing import resource_tracker

    server = multiprocessing.forkserver._forkserver
    for fd in {server._forkserver_alive_fd, resource_tracker._resource_tracker._fd, *(server._inherited_fds or [])}:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # (the same descriptor under two names)
                pass
    server._forkserver_alive_fd = server._forkserver_address = server._forkserver_pid = None
    server._inherited_fds = None
    resource_tracker._resource_tracker._fd = resource_tracker._resource_tracker._pid = None
    # the forked process was told to start processes by the fork server, as its parent does: back to the platform's
    # default (fork on Linux), so that a DataLoader's workers are this process's children, as they would be
    multiprocessing.context._default_context._actual_context = None


def _fresh_signals() -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up


def _run_as_main(path: str) -> None:
    """Run the file ``path`` as the interpreter runs a script: as ``__main__`` with an absolute ``__file__``, leaving
    ``sys.argv`` as given (``runpy.run_path`` would put the path in ``sys.argv[0]``)."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__ = path, builtins, None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    exec(compile(Path(path).read_bytes(), path, "exec"), main.__dict__)


def _child(spec: bytes, stdin: int, stdout: int, stderr: int) -> None:
    """The forked process: become the command's interpreter, run its script as ``__main__``, exit with its code."""
    import atexit
    import io
    import signal
    import traceback

    script, argv, env, cwd, path, new_session = pickle.loads(spec)
    if new_session:
        os.setsid()
    for mine, theirs in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(theirs, mine)
    for fd in {stdin, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    _forget_parent_servers()
    _fresh_signals()
    os.environ.clear()
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None  # gettempdir() caches the server's answer: read TMPDIR of this environment again
    os.chdir(cwd)
    sys.path[:] = path
    sys.argv = argv
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered,
                                  line_buffering=os.isatty(1))
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    code = 0
    try:
        _run_as_main(os.path.abspath(script))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as an interpreter ends on an uncaught one: by SIGINT
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _wait_for_own_group(process: Any) -> None:
    import time

    while process.is_alive():
        try:
            if os.getpgid(process.pid) == process.pid:
                return
        except ProcessLookupError:
            return
        time.sleep(0.001)


class ForkedProcess:
    """What :class:`subprocess.Popen` gives for a command started by :func:`popen` on the fork server: ``pid``,
    ``returncode`` (negative: the signal that ended it), ``stdout`` / ``stderr`` when piped, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``terminate``."""

    def __init__(self, process: Any, args: list[str], stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        self._process, self.args, self.stdout, self.stderr = process, args, stdout, stderr
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the piped streams to their end (each in its own thread, so neither pipe fills up), then wait."""
        results: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda n=name, s=stream: results.__setitem__(n, s.read()), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        self.wait(timeout)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return results.get("out"), results.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)


def popen(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None, stdin: Any = None,
          stdout: Any = None, stderr: Any = None, text: bool = False,
          start_new_session: bool = False) -> ForkedProcess | subprocess.Popen[Any]:
    """``subprocess.Popen(argv, ...)`` with these arguments; a Python script or the ``sslkit`` command is forked
    from the server (see the module's docstring), anything else, or an environment that opts out of the malloc
    re-execution, is a new process as Popen starts it."""
    env = dict(os.environ if env is None else env)
    script = _script(argv)
    if script is None or "SSLKIT_MALLOC_TUNED" in env or stdin == subprocess.PIPE:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session)
    ensure_server()
    python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    cwd = str(Path(cwd or os.getcwd()).resolve())
    script_dir = str(Path(cwd, script).resolve().parent)
    # sys.argv as the interpreter gives it: the script's path as written, then its arguments
    args = argv[1:] if argv[0] == sys.executable else [argv[0], *argv[1:]]
    spec = pickle.dumps((script, args, {**env, **TUNED_MALLOC, "SSLKIT_MALLOC_TUNED": "1"}, cwd,
                         [script_dir, *python_path, *_base_path()], start_new_session))
    pipes: list[tuple[int, int]] = []

    def piped(stream: Any) -> Any:
        if stream == subprocess.PIPE:
            pipes.append(os.pipe())
            return pipes[-1][1]
        return stream

    with open(os.devnull, "r+b") as devnull:
        out = piped(stdout)
        err = piped(stderr)
        fds = (_fd(stdin, 0, devnull.fileno()),
               _fd(out, 1, devnull.fileno()), _fd(err, 2, devnull.fileno(), _fd(out, 1, devnull.fileno())))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        process = _CTX.Process(target=_child, args=(spec, *(ParentFd(fd) for fd in fds)), daemon=False)
        process.start()
    if start_new_session:  # as Popen returns: once the process leads its own group (a killpg reaches it)
        _wait_for_own_group(process)
    readers = []
    for read, write in pipes:
        os.close(write)
        readers.append(open(read, "r" if text else "rb", closefd=True))
    it = iter(readers)
    return ForkedProcess(process, argv, next(it) if stdout == subprocess.PIPE else None,
                         next(it) if stderr == subprocess.PIPE else None)


def run(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
        capture_output: bool = False, text: bool = False,
        timeout: float | None = None) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(argv, ...)`` through :func:`popen`: a command still running after ``timeout`` seconds is
    killed and raises :class:`subprocess.TimeoutExpired`, as there."""
    pipe = subprocess.PIPE if capture_output else None
    proc = popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)  # type: ignore[arg-type]
