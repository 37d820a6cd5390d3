"""Synchronous user code (a tool function, an environment's methods) run off the event loop, in daemon threads.

Python cannot stop a thread, so a call that hangs past its timeout is abandoned. asyncio's executors use
threads the interpreter joins at exit: one abandoned hung call would hold the whole process after the run is
done (for a call that never returns, forever). A daemon thread per call is never joined: the process exits on
time; `running()` counts the abandoned ones still alive (multi_turn/hung_tool_threads).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from typing import Any, Callable

_live: set[threading.Thread] = set()
_lock = threading.Lock()


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # its caller timed out or was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


async def run_sync(fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` in a daemon thread of its own (with this task's context vars), awaited."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)

    def work() -> None:
        value, error = None, None
        try:
            value = call()
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task, which counts it
            error = err
        finally:
            with _lock:
                _live.discard(threading.current_thread())
        try:
            loop.call_soon_threadsafe(_settle, future, value, error)
        except RuntimeError:
            pass  # the loop is closed: the batch ended without this call (a hang past its timeout)

    thread = threading.Thread(target=work, daemon=True, name=f"mgrpo-sync-{getattr(fn, '__name__', 'call')}")
    with _lock:
        _live.add(thread)
    thread.start()
    return await future


def running() -> int:
    """Threads of synchronous user code still running (those of calls abandoned at their timeout among them)."""
    with _lock:
        return len(_live)
