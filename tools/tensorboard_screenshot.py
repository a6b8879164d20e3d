"""Screenshots of TensorBoard's Images and Text tabs for a profiled logdir, as a user sees them.

    python tools/tensorboard_screenshot.py --logdir /tmp/mt_profile --out_dir /tmp/shots

Starts `tensorboard --logdir LOGDIR --host 127.0.0.1` on a free port, waits until it serves the
`pipeline/gantt` image and `pipeline/breakdown` text, takes one screenshot per tab with headless
Chromium (Debian: `apt-get install chromium`), and stops the TensorBoard it started by its PID
(Chromium exits by itself after each screenshot). Writes `<out_dir>/tensorboard_<tab>.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# Tab -> (URL fragment, window height that frames the pipeline's card).
TABS = {
    "images": ("#images", 660),
    # The run's other texts (params, model analysis) come first alphabetically and are long:
    # the tag filter puts the pipeline's breakdown at the top.
    "text": ("#text&tagFilter=pipeline", 1000),
}
WAIT_FOR_DATA_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("No Chromium found: apt-get install -y chromium")


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait_for_pipeline_tags(base_url: str, server: subprocess.Popen) -> None:
    """Until TensorBoard lists the pipeline image and text tags (it loads logs lazily)."""
    deadline = time.monotonic() + WAIT_FOR_DATA_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"TensorBoard exited with status {server.returncode}.")
        try:
            images = _get_json(f"{base_url}/data/plugin/images/tags")
            texts = _get_json(f"{base_url}/data/plugin/text/tags")
            if (any("pipeline/gantt" in tags for tags in images.values())
                    and any("pipeline/breakdown" in tags for tags in texts.values())):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"TensorBoard at {base_url} did not show pipeline/gantt and "
                     f"pipeline/breakdown within {WAIT_FOR_DATA_S} s: was the run profiled?")


def screenshot(chromium: str, url: str, path: str, width: int, height: int) -> None:
    profile_dir = tempfile.mkdtemp(prefix="tb_shot_chromium_")
    # Its own session, so that its renderer and GPU helper processes can be stopped with it.
    browser = subprocess.Popen(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--disable-extensions", f"--user-data-dir={profile_dir}",
         f"--window-size={width},{height}", "--virtual-time-budget=20000",
         f"--screenshot={path}", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        browser.wait(timeout=180)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"Chromium (PID {browser.pid}) took over 180 s on {url}; stopped.")
    finally:
        try:  # Helpers the browser started in its session and left behind.
            os.killpg(browser.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        browser.wait()
        shutil.rmtree(profile_dir, ignore_errors=True)
    if not os.path.exists(path):
        raise SystemExit(f"Chromium wrote no screenshot for {url}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", required=True, help="A logdir written with --profile_steps.")
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--width", type=int, default=1000, help="Browser window width.")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    os.makedirs(args.out_dir, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.out_dir, "tensorboard.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", args.logdir,
             "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "5"],
            stdout=log, stderr=subprocess.STDOUT)
    print(f"TensorBoard PID {server.pid} at {base_url} (log: {log_path})")
    try:
        wait_for_pipeline_tags(base_url, server)
        for tab, (fragment, height) in TABS.items():
            path = os.path.join(args.out_dir, f"tensorboard_{tab}.png")
            screenshot(chromium, f"{base_url}/{fragment}", path, args.width, height)
            print(f"{tab}: {path} ({os.path.getsize(path) // 1024} KiB)")
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print(f"Stopped TensorBoard (PID {server.pid}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
