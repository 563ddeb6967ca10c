"""`[sandboxes]` and `[[template]]`: agent-created sandboxes, their limits, read-only binds and templates.

Private: import these names from `bastion.config`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Final, Literal
from urllib.parse import unquote

from pydantic import Field, field_validator, model_validator

from bastion.config.base import ID_PATTERN, Model
from bastion.config.network import NetworkConfig, checked_rules
from bastion.config.terminals import TerminalsConfig
from bastion.safety.commands import CommandPolicyConfig
from bastion.safety.environment import checked_env
from bastion.safety.paths import folder_changeable_by, owners_phrase, tree_changeable_by
from bastion.sandbox import SCRATCH_INODES, SHM_SIZE_BYTES, TMP_SIZE_BYTES
from bastion.sandbox.identity import DEFAULT_HOST_ID_COUNT, DEFAULT_HOST_ID_FIRST, parse_range
from bastion.sandbox.vmimage import DEFAULT_IMAGE_DIR

MAX_MICROVM_FOLDERS: Final = 8  # each a virtio-9p PCI device of the guest
BASTION_OPT: Final = "/opt/bastion"  # inside a sandbox: a template's python_env is bound at <this>/env
_RESERVED_DESTS: Final = frozenset(
    {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/tmp", "/workspace"}  # noqa: S108
)


class SandboxLimitsConfig(Model):
    """The administrator's ceiling for each sandbox, and its default; create_sandbox may only narrow it."""

    memory_bytes: Annotated[int, Field(ge=16 * 1024 * 1024)] = 1024 * 1024 * 1024
    pids: Annotated[int, Field(ge=8, le=1_000_000)] = 256
    cpu_cores: Annotated[float, Field(gt=0, le=1024)] = 1.0
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 65_536
    disk_bytes: Annotated[int, Field(ge=16 * 1024 * 1024, le=1024**4)] = 2 * 1024**3
    """Size of /workspace: writes past it fail with ENOSPC inside (when disk_quota is on)."""


class TemplateLimitsConfig(Model):
    """A template's defaults; each one it sets must be within [sandboxes.limits], the rest are the ceiling's."""

    memory_bytes: Annotated[int, Field(ge=16 * 1024 * 1024)] | None = None
    pids: Annotated[int, Field(ge=8, le=1_000_000)] | None = None
    cpu_cores: Annotated[float, Field(gt=0, le=1024)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] | None = None
    disk_bytes: Annotated[int, Field(ge=16 * 1024 * 1024, le=1024**4)] | None = None


class ReadOnlyBind(Model):
    source: Path
    """A host folder, shown read-only inside the sandbox."""
    dest: str
    """Where it appears inside, e.g. /data. Not a system folder, /workspace or /tmp."""

    @field_validator("dest")
    @classmethod
    def _check_dest(cls, dest: str) -> str:
        normal = os.path.normpath(dest)
        if not normal.startswith("/") or normal != dest.rstrip("/") or dest == "/":
            raise ValueError(f"dest {dest!r} must be an absolute, normalized path such as /data")
        top = "/" + normal.split("/")[1]
        if top in _RESERVED_DESTS:
            raise ValueError(f"dest {dest!r} would shadow {top}: choose a new top-level folder such as /data")
        if normal == "/opt" or normal.startswith(BASTION_OPT):
            raise ValueError(f"dest {dest!r} would shadow {BASTION_OPT}, bastion's own: choose another folder")
        return normal


class TemplateConfig(Model):
    """A kind of sandbox an agent may ask for by name."""

    name: Annotated[str, Field(pattern=ID_PATTERN)]
    read_only: tuple[ReadOnlyBind, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    limits: TemplateLimitsConfig | None = None
    """Defaults for this template; each must be within [sandboxes.limits]. Absent: the ceiling."""
    policy: CommandPolicyConfig | None = None
    """A stricter command policy; absent: any shell command (the kernel is the boundary)."""
    network_allow: tuple[str, ...] = ()
    """Destinations its sandboxes may reach; each within [sandboxes.network].allow. Empty: no network."""
    python_env: Path | None = None
    """A Python virtual environment on the host with preinstalled packages, shown read-only inside at
    /opt/bastion/env: execute_code and `python` use it; install_package adds to a venv of the sandbox's own."""
    python_lock: Path | None = None
    """A pip requirements file pinning every package with --hash, from which `bastion template build` makes
    python_env. Absent: the lock bastion ships under the template's name (python-data), if there is one."""
    isolation: Literal["namespaces", "microvm"] = "namespaces"
    """namespaces: bubblewrap on the host's kernel (starts in milliseconds); microvm: a QEMU guest with a
    kernel of its own ([sandboxes.microvm]), refused at start where a guest cannot boot."""
    vm_memory_mib: Annotated[int, Field(ge=64, le=65_536)] = 256
    """A microvm template's guest memory; the VMM's cgroup allows this plus QEMU's own."""
    vm_vcpus: Annotated[int, Field(ge=1, le=64)] = 1
    """A microvm template's virtual CPUs."""

    @model_validator(mode="after")
    def _check_microvm(self) -> TemplateConfig:
        # A guest gets each read-only folder (and the python_env) as a 9p device of its own: a PCI slot.
        folders = len(self.read_only) + (self.python_env is not None)
        if self.isolation == "microvm" and folders > MAX_MICROVM_FOLDERS:
            raise ValueError(
                f"template {self.name!r}: a microvm template shows at most {MAX_MICROVM_FOLDERS} read-only "
                f"folders (read_only and python_env), not {folders}"
            )
        return self

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return checked_env(env)

    @field_validator("network_allow")
    @classmethod
    def _check_network_allow(cls, texts: tuple[str, ...]) -> tuple[str, ...]:
        return checked_rules(texts)


_NEVER_RUN: Final = frozenset({".lock"})
"""uv's lock file at a venv's top, writable by all (0666) so that anyone's uv may lock the venv; empty, read
by nothing in the venv."""


def python_env_changeable_by(env: Path, owner: tuple[int, int]) -> str | None:
    """Who besides root and `owner` could change what a template's venv runs, or None.

    Its python runs every execute_code cell of the template's sandboxes (and pip, as root, at `template
    build`), and any ``.pth`` file or module in it runs with it: every entry of the venv is judged, and
    the folders on the way to it, and where its links lead out of it (``bin/python`` to the system's).

    Raises:
        OSError: an entry or a folder on the way cannot be examined.
    """
    return folder_changeable_by(str(env), owner) or tree_changeable_by(str(env), owner, skip=_NEVER_RUN)


UNFINISHED_MARK: Final = ".bastion-unfinished"
"""A file in a template's new python_env while `bastion template build` makes it, removed once the lock is
installed: an environment a failed or killed build left half made is refused (found by attack: it was served
without its packages)."""


def unfinished_env_problem(name: str, env: Path) -> str | None:
    """One line refusing template `name`'s venv `env` if its build did not finish (`UNFINISHED_MARK`), or None."""
    if not (env / UNFINISHED_MARK).exists():
        return None
    return (
        f"template {name!r} python_env {env} was left half made by a build that failed or was stopped: "
        f"run 'bastion template build {name} --config CONFIG' again"
    )


def python_env_problem(name: str, env: Path) -> str | None:
    """One line refusing template `name`'s venv `env` if a user besides root and this process's could change
    what it runs (`python_env_changeable_by`), or None."""
    owner = (os.geteuid(), os.getegid())
    try:
        who = python_env_changeable_by(env, owner)
    except OSError as exc:
        return f"template {name!r} python_env {env} cannot be examined ({exc.strerror or exc}): fix it or rebuild it"
    if who is None:
        return None
    ours = owners_phrase(owner)
    return (
        f"template {name!r} python_env {env} could be changed by {who}, and so run code in every sandbox of the "
        f"template: remove it and run 'bastion template build {name}' (in folders {ours} alone), or make it and "
        f"the folders above it {ours} alone (chown -R, chmod -R go-w, no ACL entries for others)"
    )


class MicroVMConfig(Model):
    """`[sandboxes.microvm]`: how microvm templates boot their guests."""

    image_dir: Path = DEFAULT_IMAGE_DIR
    """The kernel and initramfs `make install` builds (python -m bastion.sandbox.vmimage DIR)."""
    allow_emulation: bool = False
    """Where a KVM guest does not boot, run guests under software emulation (TCG: seconds to boot) rather
    than refuse microvm templates."""
    probe_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    """How long the first microvm start waits for a tiny KVM guest to boot before calling KVM unusable."""
    boot_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    """How long a guest may take to boot to its agent's "ready"."""
    warm_pool: Annotated[int, Field(ge=0, le=64)] = 0
    """Booted guests kept waiting for each microvm template, so create_sandbox hands one out rather than
    boot (each holds its memory: `vm_memory_mib` plus QEMU's own)."""


class SandboxesConfig(Model):
    """Agent-created sandboxes: fresh workspaces under `<state_dir>/sandboxes/`."""

    enabled: bool = True
    max_sandboxes: Annotated[int, Field(ge=0, le=10_000)] = 16
    idle_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    lifetime_s: Annotated[float, Field(gt=0)] = 86_400.0
    reap_interval_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    disk_quota: bool = True
    """Give each sandbox's /workspace its own filesystem of `limits.disk_bytes` (needs root).
    False (dangerous: one sandbox can fill the state folder's disk) keeps workspaces as plain folders."""
    orphan_retention_s: Annotated[float, Field(gt=0)] = 7 * 86_400.0
    """How long the workspaces of sandboxes left by a crashed server are kept, as snapshots."""
    snapshot_retention_s: Annotated[float, Field(gt=0)] = 7 * 86_400.0
    """How long an agent's snapshot is kept; older ones are deleted at start and by the reaper."""
    max_snapshots: Annotated[int, Field(ge=0, le=100_000)] = 64
    """Snapshots kept at once, all sandboxes' together (recovered ones count); past it a snapshot is refused."""
    max_snapshots_per_sandbox: Annotated[int, Field(ge=0, le=100_000)] = 16
    """Snapshots kept of one source sandbox (they outlive it: closing it frees none)."""
    max_snapshot_bytes: Annotated[int, Field(ge=0)] | None = None
    """Total size of the snapshot archives kept. Absent: 8 x limits.disk_bytes."""
    max_snapshot_bytes_per_sandbox: Annotated[int, Field(ge=0)] | None = None
    """Total archive size of one source sandbox's snapshots. Absent: 2 x limits.disk_bytes."""
    state_reserve_bytes: Annotated[int, Field(ge=0)] = 256 * 1024 * 1024
    """Free space snapshots and restores leave on the state filesystem, for the audit log (which fails closed)."""
    pip_index_url: Annotated[str, Field(pattern=r"^https://[^\s/]+(/\S*)?$")] = "https://pypi.org/simple"
    """install_package(manager='pip') installs from here; its host must be in [sandboxes.network] registry."""
    npm_registry_url: Annotated[str, Field(pattern=r"^https://[^\s/]+(/\S*)?$")] = "https://registry.npmjs.org/"
    install_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0
    """Wall-clock limit of one install_package call."""
    default_template: Annotated[str, Field(pattern=ID_PATTERN)] = "default"
    """The template create_sandbox uses when the call names none ("default": no template's extras)."""
    warm_pool: Annotated[int, Field(ge=0, le=64)] = 1
    """Sandboxes started ahead of time, so create_sandbox does not wait for one to boot."""
    limits: SandboxLimitsConfig = SandboxLimitsConfig()
    terminals: TerminalsConfig = TerminalsConfig()
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for sandbox commands. Values are redacted from output."""
    network: NetworkConfig = NetworkConfig()
    tmp_bytes: Annotated[int, Field(ge=1024 * 1024, le=64 * 1024**3)] = TMP_SIZE_BYTES
    """Size of /tmp in every sandbox (host workspaces' commands run in one too): a tmpfs, so it is memory,
    charged to the sandbox's memory limit. Writes past it fail with ENOSPC inside."""
    shm_bytes: Annotated[int, Field(ge=1024 * 1024, le=64 * 1024**3)] = SHM_SIZE_BYTES
    """Size of /dev/shm in every sandbox, likewise."""
    scratch_inodes: Annotated[int, Field(ge=1024, le=10_000_000)] = SCRATCH_INODES
    """Files and folders each of /tmp and /dev/shm may hold (a root server; bwrap alone caps size only)."""
    microvm: MicroVMConfig = MicroVMConfig()
    host_id_range: str = f"{DEFAULT_HOST_ID_FIRST}:{DEFAULT_HOST_ID_COUNT}"
    """FIRST:COUNT (as in /etc/subuid): the host uids and gids sandboxes and host workspaces run as when the
    server is root, one of its own each. Checked at start: no account or subordinate range may lie inside."""

    @field_validator("host_id_range")
    @classmethod
    def _check_host_id_range(cls, text: str) -> str:
        parse_range(text)
        return text

    @field_validator("pip_index_url")
    @classmethod
    def _check_index_credentials(cls, url: str) -> str:
        # They reach pip decoded, in a netrc file written from an environment variable (`packages`).
        userinfo = url.removeprefix("https://").split("/", 1)[0].rpartition("@")[0]
        if any(ord(char) < 0x20 or ord(char) == 0x7F for char in unquote(userinfo)):
            raise ValueError("pip_index_url: its user or password percent-encodes a control character: remove it")
        return url

    @model_validator(mode="after")
    def _check_scratch(self) -> SandboxesConfig:
        # tmpfs pages are the sandbox's memory: full scratch folders alone must not reach its limit.
        if 2 * (self.tmp_bytes + self.shm_bytes) > self.limits.memory_bytes:
            raise ValueError(
                f"tmp_bytes + shm_bytes ({self.tmp_bytes + self.shm_bytes}) must be at most half of "
                f"limits.memory_bytes ({self.limits.memory_bytes}): /tmp and /dev/shm are memory"
            )
        return self

    @property
    def snapshot_bytes(self) -> int:
        """`max_snapshot_bytes`, or its default from the disk quota."""
        return self.max_snapshot_bytes if self.max_snapshot_bytes is not None else 8 * self.limits.disk_bytes

    @property
    def snapshot_bytes_per_sandbox(self) -> int:
        """`max_snapshot_bytes_per_sandbox`, or its default from the disk quota."""
        per_sandbox = self.max_snapshot_bytes_per_sandbox
        return per_sandbox if per_sandbox is not None else 2 * self.limits.disk_bytes

    @property
    def snapshots_allowed(self) -> bool:
        """Whether a snapshot could ever be kept: no count or size cap is 0."""
        caps = (
            self.max_snapshots,
            self.max_snapshots_per_sandbox,
            self.snapshot_bytes,
            self.snapshot_bytes_per_sandbox,
        )
        return min(caps) > 0

    @property
    def host_ids(self) -> tuple[int, int]:
        """(first, count) of `host_id_range`."""
        return parse_range(self.host_id_range)

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return checked_env(env)
