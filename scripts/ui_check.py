#!/usr/bin/env python3
"""The chat page in a real browser: `strata serve` on a model, headless Chromium driven over
the DevTools protocol, the page used as a person would (by its accessible names).

    python3 scripts/ui_check.py [--strata target/release/strata] [--model models/strata-tiny] [--budget 72MiB]

Checks: the accessibility tree has a textbox named "Message" and a button named "Send"; a
message sent streams an answer into the conversation; Stop ends a long answer; Regenerate
replaces the last answer; the conversation is still there after a reload; with `--api-key`
the page asks for the key and then works; the dashboard goes live, shows the map named "Expert
residency" and a tooltip over it; no script error, console error or CSP violation.
Needs Chromium (`chromium` on PATH or --chromium) and the `websockets` package.
"""

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import websockets


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, seconds=120):
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read()
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer in {seconds} s")


class Page:
    """One tab over CDP: commands, and the errors the page reports."""

    def __init__(self, ws):
        self.ws, self.next_id, self.pending, self.errors = ws, 0, {}, []
        self.reader = asyncio.create_task(self.read())

    async def read(self):
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg and msg["id"] in self.pending:
                self.pending.pop(msg["id"]).set_result(msg)
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:400])
            elif msg.get("method") == "Runtime.consoleAPICalled" and msg["params"]["type"] == "error":
                self.errors.append("console.error: " + json.dumps(msg["params"]["args"])[:400])
            elif msg.get("method") == "Log.entryAdded":
                e = msg["params"]["entry"]
                if e["level"] == "error" and "401" not in e.get("text", ""):
                    self.errors.append(f"log {e['source']}: {e['text'][:400]}")

    async def cmd(self, method, **params):
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 60)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg["result"]

    async def eval(self, expr):
        r = await self.cmd("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def until(self, expr, what, seconds=60):
        t0 = time.time()
        while time.time() - t0 < seconds:
            if await self.eval(expr):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    async def load(self, url, element="send"):
        await self.cmd("Page.navigate", url=url)
        await self.until(f"document.readyState === 'complete' && !!document.getElementById('{element}')", url)

    async def named(self, role, name):
        """The DOM node id of the element with accessible `role` and `name`."""
        tree = await self.cmd("Accessibility.getFullAXTree")
        for n in tree["nodes"]:
            if n.get("ignored"):
                continue
            if n.get("role", {}).get("value") == role and n.get("name", {}).get("value") == name:
                return n.get("backendDOMNodeId")
        return None

    async def click(self, role, name):
        node = await self.named(role, name)
        assert node, f"no {role} named {name!r}"
        obj = await self.cmd("DOM.resolveNode", backendNodeId=node)
        await self.cmd("Runtime.callFunctionOn", objectId=obj["object"]["objectId"], functionDeclaration="function() { this.click(); }")

    async def type_into(self, role, name, text):
        node = await self.named(role, name)
        assert node, f"no {role} named {name!r}"
        await self.cmd("DOM.focus", backendNodeId=node)
        await self.cmd("Input.insertText", text=text)


ANSWERS = "[...document.querySelectorAll('.msg.assistant .body')].map(e => e.textContent)"
BUSY = "document.getElementById('stop').disabled === false"


async def check(args, base, key):
    port = free_port()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as prof:
        browser = subprocess.Popen([args.chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                                    f"--remote-debugging-port={port}", f"--user-data-dir={prof}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            targets = json.loads(wait_http(f"http://127.0.0.1:{port}/json/list", 60))
            url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with websockets.connect(url, max_size=None) as ws:
                p = Page(ws)
                for domain in ("Page", "Runtime", "Log", "DOM", "Accessibility"):
                    await p.cmd(f"{domain}.enable")
                await p.load(base + "/")
                if key:
                    await p.until("document.getElementById('key-dialog').open", "the API key dialog")
                    await p.type_into("textbox", "API key", key)
                    await p.click("button", "Use key")
                await p.until("document.getElementById('model-name').textContent !== ''", "the model's name")
                assert await p.named("textbox", "Message"), "no textbox named Message"
                assert await p.named("button", "Send"), "no button named Send"
                # Send: an answer streams in.
                await p.eval("document.getElementById('max_tokens').value = '24'")
                await p.type_into("textbox", "Message", "The old house on the hill")
                await p.click("button", "Send")
                await p.until(f"{ANSWERS}.length === 1 && {ANSWERS}[0].length > 0 && !({BUSY})", "an answer")
                first = (await p.eval(ANSWERS))[0]
                # Regenerate: the last answer replaced, not added to.
                await p.click("button", "Regenerate")
                await p.until(f"{ANSWERS}.length === 1 && !({BUSY}) && {ANSWERS}[0].length > 0", "a regenerated answer")
                # Stop: a long answer ends early.
                await p.eval("document.getElementById('max_tokens').value = '4000'")
                await p.eval("document.getElementById('temperature').value = '1'")
                await p.type_into("textbox", "Message", "Tell me a long story")
                await p.click("button", "Send")
                await p.until(f"{ANSWERS}.length === 2 && {ANSWERS}[1].length > 0", "the second answer starting")
                await p.click("button", "Stop")
                await p.until(f"!({BUSY})", "the stop")
                status = await p.eval("document.getElementById('status').textContent")
                assert status == "Stopped.", status
                # Reload: the conversation is kept in the browser.
                await p.load(base + "/")
                await p.until(f"{ANSWERS}.length === 2", "the conversation after a reload")
                # The dashboard: live, the map named "Expert residency", a tooltip on hover,
                # the atlas linked where the model has one.
                await p.load(base + "/dashboard", "map")
                await p.until("document.getElementById('live').textContent === 'live'", "the dashboard's stream")
                # (Chromium reports ARIA's img role as "image".)
                assert await p.named("image", "Expert residency") or await p.named("img", "Expert residency"), \
                    "no image named Expert residency"
                await p.until("document.getElementById('map-summary').textContent.includes('experts in')", "the map")
                box = await p.eval("(() => { const r = document.getElementById('map').getBoundingClientRect(); "
                                   "return [r.left + 3, r.top + 3]; })()")
                await p.cmd("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])
                await p.until("!document.getElementById('tip').hidden && "
                              "document.getElementById('tip').textContent.startsWith('layer ')", "the tooltip")
                tip = await p.eval("document.getElementById('tip').textContent")
                atlas = os.path.isfile(os.path.join(args.model, "atlas", "atlas.json"))
                if atlas:
                    await p.until("!document.getElementById('atlas-link').hidden", "the atlas link")
                    await p.until("document.getElementById('tip').textContent !== ''", "the tooltip")
                assert not p.errors, "\n".join(p.errors)
                if args.screenshots:
                    import base64
                    os.makedirs(args.screenshots, exist_ok=True)
                    shot = await p.cmd("Page.captureScreenshot", format="png")
                    with open(os.path.join(args.screenshots, "dashboard.png"), "wb") as f:
                        f.write(base64.b64decode(shot["data"]))
                    await p.load(base + "/")
                    await p.until(f"{ANSWERS}.length === 2", "the conversation")
                    shot = await p.cmd("Page.captureScreenshot", format="png")
                    with open(os.path.join(args.screenshots, "chat.png"), "wb") as f:
                        f.write(base64.b64decode(shot["data"]))
                print(f"dashboard ok: {tip!r}")
                p.reader.cancel()
                print(f"ok ({'with' if key else 'without'} an API key): first answer {first[:60]!r}")
        finally:
            browser.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--model", default="models/strata-tiny")
    ap.add_argument("--chromium", default="chromium")
    ap.add_argument("--screenshots", help="write the chat page and the dashboard as PNGs into this folder")
    ap.add_argument("--budget", help="serve with experts streamed under this budget (e.g. 72MiB)")
    args = ap.parse_args()
    for key in (None, "sekrit"):
        port = free_port()
        cmd = [args.strata, "serve", "--model", args.model, "--port", str(port), "--context", "2048"]
        if key:
            cmd += ["--api-key", key]
        if args.budget:
            cmd += ["--budget", args.budget]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 300)
            asyncio.run(check(args, f"http://127.0.0.1:{port}", key))
        finally:
            server.terminate()
            server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
