"""bastion with its audit log cut down, for bench_stdio's attribution columns: never a way to serve.

It answers "how much of bastion's time over the naive server is its audit log?" in the same run:
- `unsynced`: every record is cleaned, chained and written, but never fdatasync'd;
- `none`: no record at all (`AuditLog.append_async` returns an id and writes nothing).
Everything else (policy, jail, redaction, the call contract, the transport) is the real server's.
A call alone writes its record inline in both bastion and `unsynced` while bastion's syncs take under
`INLINE_SYNC_MAX_S` (1 ms; 0.24 to 0.31 ms where these figures were measured); past it, bastion hands
its records to a thread and `unsynced` does not, so the difference would include that hop too.
Run: python bench/audit_variant.py unsynced|none serve --config CONFIG --stdio
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from mcp import StdioServerParameters

from bastion.safety import audit

MODES: Final = ("unsynced", "none")


def stdio_server(mode: str, config: Path) -> StdioServerParameters:
    """How the SDK's stdio client spawns variant `mode` of `bastion serve --stdio` on `config`."""
    argv = [str(Path(__file__).resolve()), mode, "serve", "--config", str(config), "--stdio"]
    return StdioServerParameters(command=sys.executable, args=argv)


def _unsynced(self: audit.AuditLog, fd: int) -> None:
    self.syncs += 1  # as if synced: no flusher keeps retrying, no later record waits for a sync
    self._owed = False


async def _no_record(self: audit.AuditLog, record: Mapping[str, object], **_: object) -> str:
    return "0" * 32


def main() -> int:
    mode, argv = sys.argv[1], sys.argv[2:]
    if mode == "unsynced":
        audit.AuditLog._sync = _unsynced  # type: ignore[method-assign]
    elif mode == "none":
        audit.AuditLog.append_async = _no_record  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    from bastion.cli import main as bastion_main

    return bastion_main(argv)


if __name__ == "__main__":
    sys.exit(main())
