"""`[metrics]`: the Prometheus endpoint of `bastion serve --http`.

Private: import these names from `bastion.config`.
"""

from __future__ import annotations

from pathlib import Path

from bastion.config.base import Model


class MetricsConfig(Model):
    """`/metrics` on the HTTP listener (stdio servers have no listener: no metrics)."""

    enabled: bool = True
    """Count and serve metrics. Off: no /metrics route, and no counting on the call path."""
    token_file: Path | None = None
    """A file holding the scrape token (Prometheus' `authorization.credentials_file` can read the same
    file). Set: /metrics wants `Authorization: Bearer <token>` from any address. Unset (the default):
    /metrics answers loopback clients only, and never a request relayed by a proxy."""
