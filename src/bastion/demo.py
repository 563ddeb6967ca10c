"""`bastion init DIR`: write the demo configuration.

The layout is a public contract (later features add to it, never move it):
    DIR/bastion.toml   the config, commented
    DIR/workspace/     host workspace `default`, conservative allow-list policy
    DIR/inbox/         a folder for the organizer
    DIR/state/         database and audit.jsonl (outside every workspace)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bastion.safety.commands import DEMO_POLICY, ArgumentRule
from bastion.safety.errors import ConfigError


def _toml_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def _rule_toml(rule: ArgumentRule) -> str:
    lines = ["[[workspace.policy.rules]]"]
    for key, value in rule.model_dump(exclude_defaults=True).items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, str):
            lines.append(f"{key} = {json.dumps(value)}")
        else:
            lines.append(f"{key} = {_toml_list(tuple(value))}")
    return "\n".join(lines)


def _template_toml(python_env: Path | None) -> str:
    if python_env is None:
        return """
# A sandbox template with numpy, pandas and matplotlib: `make install` builds its environment
# and `make run` writes this section; elsewhere, point python_env at a venv made on /usr/bin/python3.
# [[template]]
# name = "python-data"
# python_env = "/path/to/.venv-python-data"
"""
    return f"""
# The default sandbox template: execute_code and `python` see numpy, pandas and matplotlib from a
# read-only virtual environment (built by `make install`); install_package adds to the sandbox's own.
[[template]]
name = "python-data"
python_env = {json.dumps(str(python_env))}
"""


def demo_config_text(python_env: Path | None = None) -> str:
    rules = "\n\n".join(_rule_toml(rule) for rule in DEMO_POLICY.rules)
    return f"""\
# bastion demo configuration, written by `bastion init`.
# Relative paths are relative to this file's folder. Unknown keys are refused.

# Database and audit log live here; never inside a workspace or inbox.
state_dir = "state"
# The workspace a tool acts on when the call names none.
default_workspace = "default"
log_level = "WARNING"

[audit]
# Append-only, hash-chained, fsync'd per record. `bastion audit verify state/audit.jsonl` checks it.
fail_closed = true          # if a record cannot be written, the operation does not happen
rotate_bytes = 67108864     # rotate at 64 MiB; the chain continues across files

[redaction]
# Extra regular expressions to scrub from every output and audit record.
patterns = []

# A host workspace: a real folder, bound read-write into a kernel sandbox
# (no network, no home folder, system folders read-only), with a command policy on top.
[[workspace]]
id = "default"
path = "workspace"
timeout_s = 30
max_output_bytes = 65536
# Extra environment for commands (PATH, HOME and LANG are fixed). Values are redacted from output.
env = {{}}

[workspace.limits]
# cgroup limits of this workspace's sandbox, all its commands together.
memory_bytes = 1073741824   # 1 GiB; past it the command is killed: RESOURCE_LIMIT
pids = 256
cpu_cores = 1.0

[workspace.policy]
# Deny wins. A command not in `allow` is refused. `bastion policy explain --config bastion.toml -- CMD` tells why.
allow = {_toml_list(DEMO_POLICY.allow)}
deny = {_toml_list(DEMO_POLICY.deny)}

# Argument rules: tokens match in any order, long options also as --opt=value and abbreviated.
{rules}

# Sandboxes an agent creates with create_sandbox: a fresh /workspace under state/sandboxes/,
# any shell command inside (the kernel is the boundary), no network.
[sandboxes]
enabled = true
max_sandboxes = 16
idle_timeout_s = 1800       # closed after 30 min unused
lifetime_s = 86400          # and after a day in any case
disk_quota = true           # /workspace is its own filesystem of limits.disk_bytes (needs root)
default_template = {json.dumps("python-data" if python_env is not None else "default")}  # for create_sandbox()
# env = {{ NAME = "value" }}  # extra environment for sandbox commands; values are redacted from output

[sandboxes.limits]
# The ceiling and default for each sandbox; create_sandbox(limits=...) may only ask for less.
memory_bytes = 1073741824   # 1 GiB
pids = 256
cpu_cores = 1.0
timeout_s = 60              # per command
max_output_bytes = 65536    # per stream, per command
disk_bytes = 2147483648     # 2 GiB: /workspace is a filesystem of this size (needs root; see disk_quota)

# `bastion serve --http`: Streamable HTTP at <public_url>/mcp, with the built-in OAuth 2.1 server.
# The admin password is set with `bastion admin set-password` and kept (as a hash) in state/, never here.
[http]
public_url = "http://127.0.0.1:8765"   # what clients use; behind a reverse proxy: https://your.host
listen = "127.0.0.1:8765"
# tls_cert = "/etc/bastion/cert.pem"   # built-in TLS; or terminate TLS in a reverse proxy
# tls_key = "/etc/bastion/key.pem"
# extra_origins = ["http://localhost:6274"]   # the MCP Inspector's web UI

# A folder for the file organizer.
[[inbox]]
id = "inbox"
path = "inbox"
{_template_toml(python_env)}"""


def init_demo(directory: str | os.PathLike[str], *, python_env: str | os.PathLike[str] | None = None) -> Path:
    """Create the demo layout; never overwrite an existing config.

    `python_env`: the python-data template's virtual environment, when one was built.
    """
    root = Path(directory).absolute()
    config = root / "bastion.toml"
    if config.exists():
        raise ConfigError(f"{config} already exists: remove it or choose another folder")
    for sub in ("workspace", "inbox"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(mode=0o700, parents=True, exist_ok=True)
    readme = root / "workspace" / "README.md"
    if not readme.exists():
        readme.write_text("# bastion demo workspace\n\nFiles an agent may read and change live here.\n")
    with open(config, "x", encoding="utf-8") as handle:
        handle.write(demo_config_text(Path(python_env).absolute() if python_env is not None else None))
    return config
