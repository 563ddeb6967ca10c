"""`[[gateway]]` and `[approvals]`: production hosts reached over SSH, their actions, and human approval.

Private: import these names from `bastion.config`.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Annotated, Final
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from bastion.config.base import Model

_GATEWAY_NAME: Final = r"^[a-z][a-z0-9_]{0,31}$"
_REMOTE_PATH: Final = re.compile(r"^/[A-Za-z0-9._/+-]{1,255}$")
_FROM_ADDRESS: Final = re.compile(r"^!?[A-Za-z0-9.:/*?-]{1,253}$")
_HOST_KEY: Final = re.compile(
    r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|rsa-sha2-(256|512)|ssh-rsa) [A-Za-z0-9+/]+=*$"
)


def _blob_has_type(kind: str, blob: str) -> bool:
    # An OpenSSH public key blob starts with its own type name (RFC 4253 section 6.6).
    try:
        data = base64.b64decode(blob, validate=True)
    except ValueError:
        return False
    size = int.from_bytes(data[:4], "big")
    name = data[4 : 4 + size].decode("ascii", errors="replace")
    return name == kind or (kind.startswith("rsa-sha2-") and name == "ssh-rsa")


class GatewayArgConfig(Model):
    """One argument of a gateway action: a tool parameter, checked before anything is sent."""

    name: Annotated[str, Field(pattern=_GATEWAY_NAME)]
    pattern: str
    """A regex the whole value must match (Python `re`). The target's dispatch.toml checks it again."""
    description: str = ""

    @field_validator("pattern")
    @classmethod
    def _check_pattern(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"argument pattern {pattern!r} is not a valid regex: {exc}") from None
        return pattern


class GatewayActionConfig(Model):
    """An action the gateway may send; the tool is `<gateway>_<action>`."""

    name: Annotated[str, Field(pattern=_GATEWAY_NAME)]
    description: str = ""
    args: tuple[GatewayArgConfig, ...] = ()
    approval: bool = True
    """Wait for a human before sending. True by default: an action runs unapproved only when config says so."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name == "actions":
            raise ValueError("action name 'actions' is taken by the <gateway>_actions tool: rename it")
        return name


class GatewayConfig(Model):
    """A production host reached over SSH, where a forced command (dispatch.py) runs fixed actions."""

    name: Annotated[str, Field(pattern=_GATEWAY_NAME)]
    host: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:-]+$")]
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")]
    key_path: Path
    """The dedicated private key (`bastion gateway keygen` writes it). Never inside a workspace or inbox."""
    host_key: str | None = None
    """The target's pinned host key, e.g. "ssh-ed25519 AAAA...". Unset: every call is refused (FORBIDDEN)."""
    from_addresses: Annotated[tuple[str, ...], Field(min_length=1)]
    """Client addresses the authorized_keys line accepts (`from=`): bastion's address as the target sees it."""
    remote_python: str = "/usr/bin/python3"
    dispatch_path: str = "/opt/bastion-gateway/dispatch.py"
    dispatch_config: str = "/etc/bastion-gateway/dispatch.toml"
    connect_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    call_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 65_536
    action: tuple[GatewayActionConfig, ...] = ()

    @field_validator("remote_python", "dispatch_path", "dispatch_config")
    @classmethod
    def _check_remote_path(cls, value: str) -> str:
        if not _REMOTE_PATH.fullmatch(value) or "/../" in value + "/" or "/./" in value + "/":
            raise ValueError(f"{value!r} must be an absolute path of letters, digits and ._/+-")
        return value

    @field_validator("from_addresses")
    @classmethod
    def _check_from(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            if not _FROM_ADDRESS.fullmatch(value):
                raise ValueError(f"from address {value!r} must be an address, a CIDR block or a host pattern")
        return values

    @field_validator("host_key")
    @classmethod
    def _check_host_key(cls, value: str | None) -> str | None:
        if value is None:
            return None
        key = " ".join(value.split()[:2])
        if not _HOST_KEY.fullmatch(key) or not _blob_has_type(*key.split(" ")):
            raise ValueError("host_key must be 'TYPE BASE64' as in ssh-keyscan output, e.g. 'ssh-ed25519 AAAA...'")
        return key

    def action_by_name(self, name: str) -> GatewayActionConfig | None:
        return next((a for a in self.action if a.name == name), None)


class ApprovalsConfig(Model):
    """Human approval of gateway actions marked `approval = true`."""

    wait_s: Annotated[float, Field(ge=0, le=3600)] = 60.0
    """How long a call waits for a decision (sending progress) before returning NEEDS_APPROVAL with an id."""
    ttl_s: Annotated[float, Field(gt=0, le=7 * 86_400)] = 3600.0
    """A request not approved and used within this time expires and never runs."""
    webhook_url: str | None = None
    """If set, each new request is POSTed there as JSON (e.g. a chat webhook)."""
    elicitation: bool = False
    """Also ask through MCP elicitation when the client supports it. Off by default: it lets the
    agent's own client approve a deploy, which is the administrator's choice to make."""

    @field_validator("webhook_url")
    @classmethod
    def _check_webhook(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"webhook_url {value!r} must be an http(s) URL")
        return value
