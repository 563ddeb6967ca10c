"""`bastion init DIR`: write the demo configuration.

The layout is a public contract (later features add to it, never move it):
    DIR/bastion.toml   the config, commented
    DIR/workspace/     host workspace `default`, conservative allow-list policy
    DIR/inbox/         a folder for the organizer
    DIR/state/         database and audit.jsonl (outside every workspace)
    DIR/gateway/dispatch.toml  an example target-side config for the `biscuit` gateway (install it on the host)
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Final

from bastion.config import DEFAULT_CATEGORIES, DEFAULT_SKIP_RULES
from bastion.safety.commands import DEMO_POLICY, ArgumentRule
from bastion.safety.errors import ConfigError
from bastion.safety.paths import folder_replaceable_by, writers_besides

DATA_ENV_DIR: Final = "envs/python-data"  # under DIR: where `bastion init --python-data` builds it


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


_GATEWAY_TOML = """
# Human approval for gateway actions marked `approval = true`.
[approvals]
wait_s = 60          # a call waits this long for a decision (with progress), then returns NEEDS_APPROVAL + id
ttl_s = 3600         # a request not approved and used within an hour expires and never runs
# webhook_url = "https://chat.example.com/hooks/bastion"   # told of each new request (JSON POST)
# elicitation = true   # also ask the user through their MCP client (it can then approve the agent's deploys)

# A production host: bastion sends fixed action strings over SSH with a dedicated key, and the host's
# authorized_keys forces every session into dispatch.py, which checks them again against its own
# config (an example is in gateway/dispatch.toml). Harmless until a target exists: with no pinned
# host_key, every call is refused. Install steps: README.md, "Production gateway".
[[gateway]]
name = "biscuit"                       # tools: biscuit_status, biscuit_logs, biscuit_deploy, ...
host = "127.0.0.1"
port = 22
user = "bastion-gw"
key_path = "state/gateway/biscuit_ed25519"   # `bastion gateway keygen --config bastion.toml biscuit`
# host_key = "ssh-ed25519 AAAA..."     # the target's host key (ssh-keyscan -t ed25519 HOST); required
from_addresses = ["127.0.0.1"]         # bastion's address as the target sees it (authorized_keys from=)
remote_python = "/usr/bin/python3"
dispatch_path = "/opt/bastion-gateway/dispatch.py"
dispatch_config = "/etc/bastion-gateway/dispatch.toml"
connect_timeout_s = 10
call_timeout_s = 120
max_output_bytes = 65536

[[gateway.action]]
name = "status"
description = "Show whether the service is running."
approval = false
args = [{ name = "project", pattern = "[a-z][a-z0-9-]{0,31}" }]

[[gateway.action]]
name = "logs"
description = "Show the service's last log lines."
approval = false
args = [{ name = "project", pattern = "[a-z][a-z0-9-]{0,31}" }, { name = "lines", pattern = "[0-9]{1,4}" }]

[[gateway.action]]
name = "deploy"
description = "Deploy a released version."
approval = true                        # the default: nothing reaches the host until a human approves
args = [
  { name = "project", pattern = "[a-z][a-z0-9-]{0,31}" },
  { name = "version", pattern = "v[0-9]+[.][0-9]+[.][0-9]+", description = "a release tag such as v1.2.3" },
]

[[gateway.action]]
name = "restart"
description = "Restart the service."
args = [{ name = "project", pattern = "[a-z][a-z0-9-]{0,31}" }]

[[gateway.action]]
name = "rollback"
description = "Go back to the previous release."
args = [{ name = "project", pattern = "[a-z][a-z0-9-]{0,31}" }]
"""

DISPATCH_EXAMPLE = """\
# dispatch.toml: the TARGET host's own allowlist for bastion's gateway key (example from `bastion init`).
# Install as /etc/bastion-gateway/dispatch.toml, owned by root, not writable by the gateway user.
# dispatch.py runs only these actions, with these argv, whatever the client sends.
root = "/srv"                                   # "path" arguments resolve beneath this (no .., no symlinks)
log = "/var/log/bastion-gateway/dispatch.jsonl" # one fsync'd JSON line per request, allowed or refused
projects = ["biscuit"]                          # the values a "project" argument may take
timeout_s = 300                                 # the action's process group is killed after this
max_output_bytes = 1048576                      # per stream

# A token that is exactly "{name}" is replaced by that argument; nothing else is substituted, no shell runs.
[actions.status]
argv = ["/usr/bin/systemctl", "status", "--no-pager", "--", "{project}"]
args = [{ name = "project", kind = "project" }]

[actions.logs]
argv = ["/usr/bin/journalctl", "--no-pager", "-n", "{lines}", "-u", "{project}"]
args = [{ name = "project", kind = "project" }, { name = "lines", pattern = "[0-9]{1,4}" }]

[actions.deploy]
argv = ["/usr/local/bin/deploy-app", "{project}", "{version}"]
args = [{ name = "project", kind = "project" }, { name = "version", pattern = "v[0-9]+[.][0-9]+[.][0-9]+" }]

[actions.restart]
argv = ["/usr/bin/systemctl", "restart", "--", "{project}"]
args = [{ name = "project", kind = "project" }]

[actions.rollback]
argv = ["/usr/local/bin/deploy-app", "--rollback", "{project}"]
args = [{ name = "project", kind = "project" }]
"""


def _template_toml(python_env: Path | None) -> str:
    if python_env is None:
        return """
# A sandbox template with numpy, pandas and matplotlib (`bastion init --python-data` writes this section).
# To add it here: uncomment these lines, run `bastion template build python-data --config bastion.toml`
# (it builds the venv from the hashed lock bastion ships), then set default_template = "python-data".
# [[template]]
# name = "python-data"
# python_env = "envs/python-data"
"""
    return f"""
# The default sandbox template: execute_code and `python` see numpy, pandas and matplotlib from a
# read-only virtual environment (`bastion template build python-data` rebuilds it from its hashed
# lock); install_package adds to the sandbox's own.
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
# The folder's .git is read-only to the agent: git runs the hooks and config programs written there as
# whoever next types `git status` in the folder. false is dangerous (docs/configuration.md).
protect_git = true

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
tmp_bytes = 67108864        # /tmp of each sandbox (host workspaces' too): 64 MiB of memory; past it, ENOSPC
shm_bytes = 67108864        # /dev/shm likewise; together at most half of limits.memory_bytes
scratch_inodes = 16384      # files each of them may hold (a root server)
max_snapshots = 64          # snapshots kept in all (delete_snapshot frees room); 16 per sandbox
snapshot_retention_s = 604800  # an agent's snapshots expire after 7 days
state_reserve_bytes = 268435456  # 256 MiB of the state folder's disk kept for the audit log
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

{_GATEWAY_TOML}
{_inbox_toml()}
{_template_toml(python_env)}"""


def _inbox_toml() -> str:
    """The demo inbox with the organizer's default categories and skip rules written out."""
    categories = "\n".join(f"{json.dumps(name)} = {_toml_list(exts)}" for name, exts in DEFAULT_CATEGORIES.items())
    rules = []
    for rule in DEFAULT_SKIP_RULES:
        lines = ["[[inbox.skip]]", f"id = {json.dumps(rule.id)}", f"layer = {json.dumps(rule.layer)}"]
        if rule.kind is not None:
            lines.append(f"kind = {json.dumps(rule.kind)}")
        if rule.names:
            lines.append(f"names = {_toml_list(rule.names)}")
        lines.append(f"reason = {json.dumps(rule.reason)}")
        rules.append("\n".join(lines))
    skip = "\n\n".join(rules)
    return f"""\
# A folder for the file organizer: list_files, plan_organize, apply_plan, move_file, undo and redo.
# Nothing is ever deleted or overwritten. Its journal and undo history live in state/organizer/.
[[inbox]]
id = "inbox"
path = "inbox"
max_plan_moves = 500        # a plan proposes at most this many moves

# Category folder -> file extensions (lower case, no leading dot; "tar.gz" is tried before "gz").
# Files whose extension is in no category stay where they are.
[inbox.categories]
{categories}

# Skip rules. Each needs a layer (no default):
#   "protection": every organizer tool refuses such an entry (move_file too);
#   "restraint":  only plan_organize leaves it, reported as NEEDS_EXPLICIT_REQUEST, and a person
#                 may still move it on purpose with move_file.
# A rule matches by `kind` (a built-in check) or by `names` (patterns, case-insensitive; for
# protection rules, matched against every part of a move's paths). This list replaces the
# default; it must keep a protection rule of each kind symlink, special_file, unsafe_name,
# outside_folder and occupied_destination.
{skip}
"""


def is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() and (path / "bin").is_dir()


def init_demo(
    directory: str | os.PathLike[str],
    *,
    python_env: str | os.PathLike[str] | None = None,
    build_python_data: bool = False,
) -> Path:
    """Create the demo layout; never overwrite an existing config, never fill a folder someone else could change.

    `python_env`: the python-data template's virtual environment, when one was built; it becomes
    the default template (create_sandbox() then has numpy, pandas and matplotlib).
    `build_python_data`: build that environment first, into DIR/envs/python-data, from bastion's lock.

    Raises:
        ConfigError: the config exists, `python_env` is not a virtual environment, or DIR (or a folder
            above it) is not the caller's alone (see `own_folder`).
        Unavailable, OperationFailed: the python-data environment could not be built (no config is written).
    """
    root = Path(directory).absolute()
    own_folder(root)
    config = root / "bastion.toml"
    if config.exists():
        raise ConfigError(f"{config} already exists: remove it or choose another folder")
    if build_python_data:
        python_env = _build_python_data(root / DATA_ENV_DIR)
    if python_env is not None and not is_venv(Path(python_env)):
        raise ConfigError(f"--python-env {python_env} is not a virtual environment: build one or omit it")
    if python_env is not None:
        # Its real path: a config naming a python_env through a symbolic link is refused at load.
        python_env = Path(python_env).resolve()
    for sub in ("workspace", "inbox"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir(mode=0o700, parents=True, exist_ok=True)
    readme = root / "workspace" / "README.md"
    if not readme.exists():
        readme.write_text("# bastion demo workspace\n\nFiles an agent may read and change live here.\n")
    (root / "gateway").mkdir(exist_ok=True)
    example = root / "gateway" / "dispatch.toml"
    if not example.exists():
        example.write_text(DISPATCH_EXAMPLE, encoding="utf-8")
    # 0600 whatever the umask: the workspaces' and sandboxes' env secrets are meant to go in it.
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "w", encoding="utf-8") as handle:
        handle.write(demo_config_text(Path(python_env).absolute() if python_env is not None else None))
    return config


def own_folder(root: Path) -> None:
    """Make `root` (0755), or accept it existing only if it is the caller's and no one else could change it.

    Why: `bastion init /tmp/docdemo` as root into a folder a neighbour made first wrote root's config
    there; the neighbour, owning the folder, swapped it for theirs, and root's `serve` ran it. The
    folder is judged where it will be made, made, then judged as made (a folder made meanwhile by
    someone else in a sticky folder is theirs, and refused).

    Raises:
        ConfigError: someone else owns `root`, may write it, or could replace it or a folder above it.
    """
    owner = (os.geteuid(), os.getegid())
    if not os.path.lexists(root):
        _refuse_open_folder(root, owner)
        try:
            root.mkdir(mode=0o755, parents=True)
        except FileExistsError:
            raise ConfigError(f"{root} was made by someone else meanwhile: choose another folder") from None
        except OSError as exc:
            raise ConfigError(f"{root} cannot be made: {exc.strerror or exc}") from None
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{root} is not a folder: choose a folder")
    if info.st_uid != owner[0]:
        raise ConfigError(f"{root} is owned by uid {info.st_uid}, not you: choose a folder of your own")
    _refuse_open_folder(root, owner)


def _refuse_open_folder(root: Path, owner: tuple[int, int]) -> None:
    """Refuse `root` (or, not made yet, where it will be made) if anyone else may write or replace it."""
    try:
        # Sticky or not: a folder someone else may write could hold their `workspace` before init makes it.
        writers = writers_besides(str(root), owner) if os.path.lexists(root) else None
        who = folder_replaceable_by(str(root), owner)
    except OSError as exc:
        raise ConfigError(f"{root} cannot be examined: {exc.strerror or exc}") from None
    if writers is not None:
        raise ConfigError(f"{root} may be written by {writers}: chmod go-w it, or choose another folder")
    if who is not None:
        raise ConfigError(f"{root} could be replaced by {who}: choose a folder in folders only you and root can write")


def _build_python_data(target: Path) -> Path:
    from bastion.config import SandboxesConfig, TemplateConfig
    from bastion.templates import build_template_env

    template = TemplateConfig(name="python-data", python_env=target)
    return build_template_env(template, index_url=SandboxesConfig().pip_index_url).path
