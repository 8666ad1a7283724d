#!/usr/bin/env python3
"""The chat page and the dashboard in a real browser: `strata serve` on a model, headless
Chromium driven by Playwright, the pages used as a person would (by their accessible names).

    python3 scripts/ui_check.py [--strata target/release/strata] [--model models/strata-tiny]
                                [--budget 72MiB] [--screenshots DIR] [--chromium PATH]

For each of no API key and `--api-key`: the page asks for the key (with one) and then works;
the textbox "Message" and the button "Send" send a message whose answer streams in and
finishes; Regenerate replaces the last answer; Stop ends a long answer; the conversation is
still there after a reload; the dashboard goes live, shows the image "Expert residency" with a
tooltip over it and, with `--budget` (experts streamed), sees the map change while a request
runs; no script error, console error or CSP violation on either page. With `--vision-model`,
an image attached goes with a message and is answered. CI runs it (.ci/run).
Needs `pip install playwright` and Chromium (the system's, `--chromium`, else Playwright's).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from playwright.sync_api import expect, sync_playwright

ANSWERS = ".msg.assistant .body"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, seconds=300):
    t0 = time.time()
    while time.time() - t0 < seconds:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read()
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer in {seconds} s")


def post_chat(base, key, text, max_tokens):
    """A chat request from outside the page (the dashboard's load)."""
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def check(browser, base, key, args):
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    errors = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    # (A 401 before the key is given is the page's cue to ask for it.)
    page.on("console", lambda m: m.type == "error" and "401" not in m.text and errors.append(f"console: {m.text}"))
    page.goto(base + "/")
    if key:
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Use key").click()
    expect(page.locator("#model-name")).not_to_have_text("", timeout=30_000)
    message, send = page.get_by_role("textbox", name="Message"), page.get_by_role("button", name="Send")
    stop = page.get_by_role("button", name="Stop")
    page.get_by_text("Settings").click()
    page.get_by_label("Max tokens").fill("24")
    # Send: the answer streams in and finishes.
    message.fill("The old house on the hill")
    send.click()
    expect(stop).to_be_enabled()
    expect(stop).to_be_disabled(timeout=120_000)
    expect(page.locator(ANSWERS)).to_have_count(1)
    first = page.locator(ANSWERS).first.inner_text()
    assert first.strip(), "an empty answer"
    # Regenerate: the last answer replaced, not added to.
    page.get_by_role("button", name="Regenerate").click()
    expect(stop).to_be_disabled(timeout=120_000)
    expect(page.locator(ANSWERS)).to_have_count(1)
    # Stop: a long answer ends early.
    page.get_by_label("Max tokens").fill("4000")
    page.get_by_label("Temperature").fill("1")
    message.fill("Tell me a long story")
    send.click()
    expect(page.locator(ANSWERS)).to_have_count(2)
    expect(page.locator(ANSWERS).nth(1)).not_to_have_text("", timeout=60_000)
    stop.click()
    expect(page.get_by_role("status")).to_have_text("Stopped.")
    # Reload: the conversation is kept in the browser.
    page.reload()
    expect(page.locator(ANSWERS)).to_have_count(2, timeout=30_000)
    if args.screenshots:
        page.screenshot(path=os.path.join(args.screenshots, "chat.png"))

    # The dashboard.
    page.goto(base + "/dashboard")
    expect(page.locator("#live")).to_have_text("live", timeout=30_000)
    grid = page.get_by_role("img", name="Expert residency")
    expect(grid).to_be_visible()
    expect(page.locator("#map-summary")).to_contain_text("experts in")
    grid.hover(position={"x": 3, "y": 3})
    expect(page.locator("#tip")).to_contain_text("layer ")
    tip = page.locator("#tip").inner_text()
    if os.path.isfile(os.path.join(args.model, "atlas", "atlas.json")):
        expect(page.get_by_role("link", name="Expert Atlas")).to_be_visible()
    if args.budget:
        # The map while a request runs: experts move between the slab and the disk.
        before = page.evaluate("document.getElementById('map').toDataURL()")
        load = threading.Thread(target=post_chat, args=(base, key, "Tell me about the old house", 300))
        load.start()
        changed = False
        for _ in range(100):
            time.sleep(0.2)
            if page.evaluate("document.getElementById('map').toDataURL()") != before:
                changed = True
                break
        load.join()
        assert changed, "the map did not change while a request ran"
        # Hit and read rates over the runtime's turns (two turn boundaries at least).
        expect(page.locator("#hits")).not_to_have_text("–", timeout=30_000)
        expect(page.locator("#io")).not_to_have_text("–")
    if args.screenshots:
        page.screenshot(path=os.path.join(args.screenshots, "dashboard.png"), full_page=True)
    assert not errors, "\n".join(errors)
    page.close()
    return first, tip


def check_vision(browser, base, image):
    """An image attached on a model with a vision tower goes with the message, and the answer
    comes back."""
    page = browser.new_page()
    page.goto(base + "/")
    expect(page.locator("#attach-label")).to_be_visible(timeout=30_000)
    page.locator("#attach").set_input_files(image)
    expect(page.locator("#attachments img")).to_have_count(1)
    page.get_by_text("Settings").click()
    page.get_by_label("Max tokens").fill("8")
    page.get_by_role("textbox", name="Message").fill("What is in the image?")
    page.get_by_role("button", name="Send").click()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled(timeout=120_000)
    expect(page.locator(".msg.user img")).to_have_count(1)
    errors = page.locator(".msg.error").all_inner_texts()
    assert not errors, errors
    expect(page.locator(".msg.assistant")).to_have_count(1)
    page.close()


def serve(args, model, key=None, budget=None):
    port = free_port()
    cmd = [args.strata, "serve", "--model", model, "--port", str(port), "--context", "2048"]
    if key:
        cmd += ["--api-key", key]
    if budget:
        cmd += ["--budget", budget]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health")
    return server, f"http://127.0.0.1:{port}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--model", default="models/strata-tiny")
    ap.add_argument("--budget", help="serve with experts streamed under this budget (e.g. 72MiB)")
    ap.add_argument("--chromium", help="the Chromium to drive (default: the system's, else Playwright's own)")
    ap.add_argument("--vision-model", help="also attach an image on this model (its chat template must read image parts)")
    ap.add_argument("--vision-image", help="the image to attach (default: the vision model's image.png)")
    ap.add_argument("--screenshots", help="write chat.png and dashboard.png into this folder")
    args = ap.parse_args()
    if args.screenshots:
        os.makedirs(args.screenshots, exist_ok=True)
    exe = args.chromium
    if exe is None:
        for name in ("chromium", "chromium-browser", "google-chrome"):
            # The real binary behind a distribution's wrapper script, where there is one.
            path = shutil.which(name)
            if path:
                exe = "/usr/lib/chromium/chromium" if os.path.exists("/usr/lib/chromium/chromium") else path
                break
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"]) if exe else pw.chromium.launch()
        try:
            for key in (None, "sekrit"):
                server, base = serve(args, args.model, key, args.budget)
                try:
                    first, tip = check(browser, base, key, args)
                    print(f"ok ({'with' if key else 'without'} an API key): answer {first[:50]!r}; map: {tip!r}")
                finally:
                    server.terminate()
                    server.wait(30)
            if args.vision_model:
                server, base = serve(args, args.vision_model)
                try:
                    check_vision(browser, base, args.vision_image or os.path.join(args.vision_model, "image.png"))
                    print("ok: an attached image")
                finally:
                    server.terminate()
                    server.wait(30)
        finally:
            browser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
