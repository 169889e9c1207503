"""A line on standard error when tandv's numba kernels compile for longer than a moment.

numba compiles a kernel at its first call for each argument signature and caches the
machine code beside the source. On a new install the first tracked step (PyTorch on the
CPU) or the first tracker (JAX on the CPU) therefore compiles for 5-30 s on a 2-core
machine, and without a word it looks like a hang. numba broadcasts a ``numba:compile``
event around each compile (not around a load from its cache); this listener counts the
compiles of tandv's own functions under way and, when one has run for
:data:`NOTICE_AFTER_S`, says once per process what is happening and that it happens once.
"""

from __future__ import annotations

import sys
import threading

from numba.core import event

#: Seconds a compile of tandv's kernels runs before the notice is printed.
NOTICE_AFTER_S = 2.0

NOTICE = (
    "tandv: compiling its summary kernels for this machine (numba; once per install and "
    "dtype, then cached): about 5-30 s"
)


class _Notice(event.Listener):
    """Counts tandv's compiles under way (nested: a kernel's callees compile inside it);
    the outermost one starts a timer that prints :data:`NOTICE`, its end stops it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._timer: threading.Timer | None = None
        self.said = False

    @staticmethod
    def _ours(ev: event.Event) -> bool:
        dispatcher = (ev.data or {}).get("dispatcher")
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
        return module.startswith("tandv.")

    def on_start(self, ev: event.Event) -> None:
        if not self._ours(ev):
            return
        with self._lock:
            self._depth += 1
            if self._depth == 1 and not self.said:
                self._timer = threading.Timer(NOTICE_AFTER_S, self._say)
                self._timer.daemon = True
                self._timer.start()

    def on_end(self, ev: event.Event) -> None:
        if not self._ours(ev):
            return
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _say(self) -> None:
        with self._lock:
            if self.said or self._depth == 0:
                return
            self.said = True
        print(NOTICE, file=sys.stderr, flush=True)


#: The process's listener, registered when this module is first imported (by
#: :mod:`tandv.stats.host`, which every numba kernel of tandv imports from).
listener = _Notice()
event.register("numba:compile", listener)  # type: ignore[no-untyped-call]
