"""Start-up compile in parallel: a launcher's kernels compiled at once on a thread pool, before
it launches them.

Why: Triton compiles a kernel the first time it is launched with a new specialization, on the
launching thread, so a launcher that makes several launches compiles its kernels one after
another (flash's prefill: two prepare variants, then the recurrence or the segment map, scan and
output kernels). Most of one compile (MLIR and LLVM passes, ptxas) runs without the interpreter
lock: two threads compiling two of flash's prepare variants took 1.57 s against 2.4 s one after
the other on a 2-core CPU (perf-notes, twenty-second session), and the GPU host has 16 cores.

How: a launcher decorated with `compiles_ahead`, called while `warming_up()` is active (the
engine's start-up warm-up, benchmarks of start-up), runs twice: first with every Triton launch
turned into Triton's own warm-up (compile, do not launch) under `AsyncCompileMode`, which hands
each compile to the pool, then, once every compile is done, for real (each kernel then found in
Triton's cache). Outside `warming_up()` the decorator costs one context-variable read per call.

What a decorated launcher must be: its first pass launches nothing, so it may neither read
device data on the host nor pass a kernel's output to a torch op whose result it uses (an index
that would then be garbage), and it must be safe to call twice (it rewrites the same outputs).
Launchers whose calls differ only in data compile once; the first pass costs only host time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_warming_up: ContextVar[bool] = ContextVar("kdaserve_warming_up", default=False)
_compile_only: ContextVar[bool] = ContextVar("kdaserve_compile_only", default=False)
_in_launcher: ContextVar[bool] = ContextVar("kdaserve_in_compiled_ahead_launcher", default=False)
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_patched_depth = 0
_original_run = None


def warming_up() -> bool:
    return _warming_up.get()


def compiling_ahead() -> bool:
    """In a compile pass: launches compile and launch nothing (a launcher may then also launch
    the variants it will need later, to compile them in the same round)."""
    return _compile_only.get()


@contextlib.contextmanager
def warm_up_compiles() -> Iterator[None]:
    """While inside (this thread and what it calls), decorated launchers compile their kernels in
    parallel before launching them."""
    token = _warming_up.set(True)
    try:
        yield
    finally:
        _warming_up.reset(token)


COMPILE_THREADS_ENV = "KDASERVE_COMPILE_THREADS"


def compile_workers() -> int:
    """Threads compiling at once: $KDASERVE_COMPILE_THREADS, else the cores this process may use
    (at most 32). 1 turns compiling ahead off (each kernel compiles at its first launch)."""
    value = os.environ.get(COMPILE_THREADS_ENV)
    if value is not None:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{COMPILE_THREADS_ENV} must be a whole number of threads >= 1 (1: compile each kernel "
                             f"at its first launch); got {value!r}")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(32, cores))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(compile_workers(), thread_name_prefix="kdaserve-compile")
        return _pool


def _patch_run() -> None:
    """Route JITFunction.run through the compile-only switch, for as long as some thread is in a
    compile-only pass (only the switched thread's launches change; Triton's class is restored
    when the last pass ends, so nothing of this stays in the serving path)."""
    global _patched_depth, _original_run
    from triton.runtime.jit import JITFunction

    with _lock:
        if _patched_depth == 0:
            _original_run = original = JITFunction.run

            def run(self, *args, grid, warmup, **kwargs):
                return original(self, *args, grid=grid, warmup=warmup or _compile_only.get(), **kwargs)

            JITFunction.run = run
        _patched_depth += 1


def _unpatch_run() -> None:
    global _patched_depth, _original_run
    from triton.runtime.jit import JITFunction

    with _lock:
        _patched_depth -= 1
        if _patched_depth == 0:
            JITFunction.run = _original_run
            _original_run = None


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Inside, this thread's Triton launches compile on the pool and launch nothing; on leaving,
    every compile submitted has finished (or raised here)."""
    from triton.runtime._async_compile import AsyncCompileMode, active_mode

    if _compile_only.get() or active_mode.get() is not None:   # nested: the outer pass compiles it all
        yield
        return
    _patch_run()
    token = _compile_only.set(True)
    try:
        with AsyncCompileMode(_executor()):
            yield
    finally:
        _compile_only.reset(token)
        _unpatch_run()


def compiles_ahead(launcher: F) -> F:
    """Decorate a launcher (see the module's rules) so that, while warming up, its kernels compile
    in parallel before it launches them."""

    @functools.wraps(launcher)
    def wrapper(*args, **kwargs):
        if not _warming_up.get() or _in_launcher.get() or not _compiles_natively() or compile_workers() < 2 \
                or _capturing():
            return launcher(*args, **kwargs)
        token = _in_launcher.set(True)   # launchers it calls: compiled by this one's pass
        try:
            with compile_only():
                launcher(*args, **kwargs)
            return launcher(*args, **kwargs)
        finally:
            _in_launcher.reset(token)

    return wrapper   # type: ignore[return-value]


def _capturing() -> bool:
    """A CUDA graph is being captured on this stream: a first pass would put its torch ops (the
    launchers' allocations and casts) into the graph, replayed at every step."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _compiles_natively() -> bool:
    """Triton compiles for a GPU here (its interpreter, used on CPUs, compiles nothing)."""
    import triton

    return not triton.knobs.runtime.interpret
