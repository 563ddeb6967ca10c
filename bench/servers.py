"""What the HTTP benchmarks share: a free loopback port, and a demo config served on it."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import httpx2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_config(
    bastion: Path, root: Path, *, http_extra: str = "", tail: str = "", password: str | None = None
) -> tuple[Path, int]:
    """`bastion init` under `root` with sandboxes off and [http] on a free loopback port; `http_extra` goes
    under [http], `tail` at the end; with `password`, it is set as the administrator's. (config, port)"""
    subprocess.run([str(bastion), "init", str(root)], check=True, capture_output=True)
    port = free_port()
    path = root / "bastion.toml"
    text = path.read_text()
    text = text.replace('path = "workspace"\n', 'path = "workspace"\nuse_cgroups = false\n', 1)
    text = re.sub(r"(?m)^\[sandboxes\]\nenabled = true", "[sandboxes]\nenabled = false", text)
    text = text.replace("http://127.0.0.1:8765", f"http://127.0.0.1:{port}").replace(
        'listen = "127.0.0.1:8765"', f'listen = "127.0.0.1:{port}"'
    )
    path.write_text(text.replace("[http]\n", f"[http]\n{http_extra}", 1) + tail)
    if password is not None:
        subprocess.run(
            [str(bastion), "admin", "set-password", "--config", str(path)],
            input=password + "\n",
            text=True,
            check=True,
            capture_output=True,
        )
    return path, port


def wait_serving(process: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 30) -> None:
    """Until `url` answers (any status); exits with the server's log if it died or never did."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx2.get(url, timeout=1)
            return
        except httpx2.TransportError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit(f"server did not start: {log.read_text()}") from None
            time.sleep(0.05)
