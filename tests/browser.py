"""Open a page in headless Chromium and report what a user would see and what went wrong.

Talks the Chrome DevTools Protocol over ``--remote-debugging-pipe`` (fd 3 in, fd 4
out, NUL-separated JSON), so it needs nothing beyond the ``chromium`` binary: no
websocket client, no Selenium. It records console errors, uncaught exceptions, log
entries of level error (failed resource loads among them) and every request to a
URL other than ``file:``/``data:``/``about:``, and takes a full-page screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

LOCAL_SCHEMES = ("file:", "data:", "about:", "blob:", "chrome:", "devtools:")


def chromium_path() -> str | None:
    """The Chromium binary on PATH (Debian's package installs ``chromium``)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageResult:
    """What loading one page produced."""

    screenshot_png: bytes
    console_errors: list[str] = field(default_factory=list)
    network_requests: list[str] = field(default_factory=list)


class Browser:
    """A headless Chromium driven over a DevTools pipe; use as a context manager."""

    def __init__(self, timeout: float = 60.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed (apt-get install chromium)")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="tandv-chromium-")
        cmd_r, cmd_w = os.pipe()  # we write commands, Chromium reads them on fd 3
        ev_r, ev_w = os.pipe()  # Chromium writes replies and events on fd 4
        args = [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            f"--user-data-dir={self._profile}",
            "--remote-debugging-pipe",
        ]
        quoted = " ".join(f"'{a}'" for a in args)
        self._proc = subprocess.Popen(
            ["bash", "-c", f"exec {quoted} 3<&{cmd_r} 4>&{ev_w}"],
            pass_fds=(cmd_r, ev_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(ev_w)
        self._out, self._in = cmd_w, ev_r
        self._buf = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._send("Browser.close", wait=False)
        except OSError:
            pass
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("no reply from Chromium")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def _send(
        self, method: str, params: dict | None = None, session: str | None = None, wait: bool = True
    ) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        if not wait:
            return {}
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def _wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(
            e.get("method") == method and e.get("sessionId") == session for e in self._events
        ):
            self._events.append(self._read_message(deadline))

    def open(
        self, url: str, width: int = 1280, height: int = 900, settle: float = 0.5
    ) -> PageResult:
        """Load ``url`` in a fresh tab, wait for its load event, and screenshot the full page."""
        self._events = []
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self._send(f"{domain}.enable", session=session)
        self._send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        self._send("Page.navigate", {"url": url}, session=session)
        self._wait_for("Page.loadEventFired", session)
        end = time.monotonic() + settle  # let late console messages arrive
        while time.monotonic() < end:
            try:
                self._events.append(self._read_message(min(end, time.monotonic() + 0.1)))
            except TimeoutError:
                pass
        shot = self._send(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True},
            session=session,
        )
        result = PageResult(base64.b64decode(shot["data"]))
        for e in self._events:
            if e.get("sessionId") != session:
                continue
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                result.console_errors.append(
                    " ".join(
                        str(a.get("value", a.get("description", ""))) for a in p.get("args", [])
                    )
                )
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                result.console_errors.append(
                    d.get("exception", {}).get("description") or d.get("text", "exception")
                )
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                result.console_errors.append(p["entry"].get("text", ""))
            elif m == "Network.requestWillBeSent":
                u = p.get("request", {}).get("url", "")
                if not u.startswith(LOCAL_SCHEMES):
                    result.network_requests.append(u)
        self._send("Target.closeTarget", {"targetId": target})
        return result
