"""Headless Chromium driven over the Chrome DevTools Protocol on a pipe (no Python dependency): the
browser reads JSON commands, each ended by a NUL byte, on its file descriptor 3 and writes replies and
events on its descriptor 4 (--remote-debugging-pipe).

Also a command line that photographs an explorer file for the README:
    python tests/browser.py checkpoints/<run>/eval/test/alignments.html docs/explorer.png ["s=3&l=5&h=mean&m=ref"]
(the hash: sentence, layer, head or mean; m=ref shows a sentence's reference rows, forced, with its links, m=encoder
and m=decoder a Transformer's self-attention), and
one that photographs make serve's page after translating a text:
    python tests/browser.py --serve http://127.0.0.1:8000/ docs/serve.png "En el principio creó Dios ..." ["In ..."]
    python tests/browser.py --serve-continue http://127.0.0.1:8000/ docs/serve_continue.png "Toda ..." "All"
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """One headless Chromium with one page of ``width`` x ``height`` CSS pixels (device scale 1, so
    screenshot pixels are CSS pixels)."""

    def __init__(self, width: int = 1280, height: int = 800, timeout: float = 30.0):
        binary = find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")
        self.timeout, self._next_id, self._buffer = timeout, 0, b""
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self.log = open(os.path.join(self.profile, "stderr.log"), "w+b")
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()

        def child_fds():  # the browser's fds 3 and 4; dup above 10 first so neither dup2 clobbers the other
            read, write = fcntl.fcntl(to_browser, fcntl.F_DUPFD, 10), fcntl.fcntl(from_browser, fcntl.F_DUPFD, 10)
            os.dup2(read, 3)
            os.dup2(write, 4)

        # pass_fds keeps 3 and 4 open in the child; they are open here too, as the log and the pipes took
        # the lowest free numbers
        self.process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            pass_fds=(3, 4),
            preexec_fn=child_fds,
        )
        os.close(to_browser)
        os.close(from_browser)
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.page(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
        except BaseException:
            self.close()
            raise

    # ---- protocol ----
    def call(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command and return its result, skipping the events that arrive before it."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._receive(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _receive(self, deadline: float, waiting_for: str) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError(f"{waiting_for}: no reply from chromium in {self.timeout} s{self._stderr()}")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError(f"{waiting_for}: chromium closed the pipe{self._stderr()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _stderr(self) -> str:
        self.log.seek(0)
        return "; its stderr ends:\n" + self.log.read()[-2000:].decode(errors="replace")

    def page(self, method: str, **params) -> dict:
        return self.call(method, session=self.session, **params)

    # ---- page helpers ----
    def open(self, path: str | os.PathLike, hash: str = "") -> None:
        """Navigate to a local file (and hash) and wait for the explorer's first heatmap."""
        url = Path(path).resolve().as_uri() + (f"#{hash}" if hash else "")
        self.evaluate("window.staleDocument = true")  # not ready until a new document replaced this one
        result = self.page("Page.navigate", url=url)
        if "errorText" in result:
            raise RuntimeError(f"{url}: {result['errorText']}")
        if "loaderId" not in result:  # only the hash changed: the same document stays, so load it afresh
            self.page("Page.reload")
        self.wait_for(
            "!window.staleDocument && document.readyState === 'complete' && "
            "(window.explorerReady ?? window.explorerError)"
        )
        if error := self.evaluate("window.explorerError"):
            raise RuntimeError(f"{url}: {error}")

    def open_url(self, url: str, ready: str) -> None:
        """Navigate to ``url`` (a server's page) and wait until the JavaScript expression ``ready`` is truthy."""
        self.evaluate("window.staleDocument = true")
        result = self.page("Page.navigate", url=url)
        if "errorText" in result:
            raise RuntimeError(f"{url}: {result['errorText']}")
        self.wait_for(f"!window.staleDocument && document.readyState === 'complete' && ({ready})")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.page("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"{expression!r}: {details.get('exception', {}).get('description', details['text'])}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float | None = None):
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline, error = time.monotonic() + (timeout or self.timeout), None
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError as e:  # e.g. mid-navigation, while the page's context is being replaced
                value, error = None, e
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{expression!r} still false after {timeout or self.timeout} s"
                    + (f" (last error: {error})" if error else "")
                )
            time.sleep(0.02)

    def center(self, selector: str) -> tuple[float, float]:
        """Viewport coordinates of the middle of the first element matching ``selector``."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        return box[0], box[1]

    def hover(self, x: float, y: float) -> None:
        self.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, x: float, y: float) -> None:
        self.hover(x, y)
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_text(self, text: str) -> None:
        self.page("Input.insertText", text=text)

    def screenshot(self) -> bytes:
        """PNG of the viewport."""
        return base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                try:
                    self.timeout = 5
                    self.call("Browser.close")
                except (OSError, RuntimeError, TimeoutError):
                    pass
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        finally:
            for fd in (self._read, self._write):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def explorer_screenshot(
    html_path: str,
    png_path: str,
    hash: str = "",
    size: tuple[int, int] = (1280, 800),
    browser: Browser | None = None,
    max_bytes: int = 300_000,
) -> int:
    """Photograph an explorer file for a README: the view of ``hash`` (default: the first sentence, last
    layer, mean of heads, hypothesis rows; "&m=ref": the reference rows, forced, with its links) with a row
    token hovered, so its highlight shows. A PNG over
    ``max_bytes`` is reduced to 256 colours. Returns the file's size in bytes."""
    own = browser is None
    browser = browser or Browser(*size)
    try:
        browser.open(html_path, hash)
        # the middle one of the target tokens in sight
        visible = browser.evaluate(
            "[...document.querySelectorAll('#ylabels .tok')]"
            ".filter(e => e.getBoundingClientRect().bottom <= innerHeight).length"
        )
        browser.hover(*browser.center(f"#ylabels .tok:nth-child({visible // 2 + 1})"))
        png = browser.screenshot()
    finally:
        if own:
            browser.close()
    if len(png) > max_bytes:
        from PIL import Image

        with Image.open(io.BytesIO(png)) as image, io.BytesIO() as out:
            image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
            png = out.getvalue()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    Path(png_path).write_bytes(png)
    return len(png)


def serve_screenshot(
    url: str, png_path: str, text: str, given: str = "", complete: bool = False, size: tuple[int, int] = (1280, 900)
) -> int:
    """Photograph make serve's page at ``url`` after translating ``text`` (scoring the translation ``given``, if
    any, or with ``complete`` continuing it), a row token hovered; 256 colours."""
    from PIL import Image

    with Browser(*size) as browser:
        browser.open_url(url, "window.pageLoaded")
        browser.evaluate(f"document.getElementById('text').value = {json.dumps(text)}")
        browser.evaluate(f"document.getElementById('reference').value = {json.dumps(given)}")
        browser.evaluate(f"document.getElementById('complete').checked = {json.dumps(complete)}")
        browser.click(*browser.center("#go"))
        browser.wait_for("window.serveReady || window.serveError", timeout=120)
        browser.hover(*browser.center("#ylabels .tok:nth-child(3)"))
        png = browser.screenshot()
    with Image.open(io.BytesIO(png)) as image, io.BytesIO() as out:
        image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE).save(out, "PNG", optimize=True)
        Path(png_path).write_bytes(out.getvalue())
    return os.path.getsize(png_path)


if __name__ == "__main__":
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--serve":  # python tests/browser.py --serve URL PNG "text" ["yours"]
        print(f"wrote {sys.argv[3]} ({serve_screenshot(*sys.argv[2:]) // 1024} KB)")
        sys.exit()
    if len(sys.argv) == 6 and sys.argv[1] == "--serve-continue":  # ... --serve-continue URL PNG "text" "beginning"
        print(f"wrote {sys.argv[3]} ({serve_screenshot(*sys.argv[2:], complete=True) // 1024} KB)")
        sys.exit()
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    print(f"wrote {sys.argv[2]} ({explorer_screenshot(*sys.argv[1:]) // 1024} KB)")
