"""`bastion install-service`: the system user, the folders, a config and the unit, for systemd.

Idempotent: each step compares what is there with what it would make and only changes what
differs; a config that exists is never rewritten. `dry_run` prints the same steps and changes
nothing. `prefix` installs into another root (an image being built, a test's folder): the paths
written inside the unit and the config stay those of the running system.

Dangerous on purpose: it runs as root, creates an account (`systemd-sysusers`, which reads the
sysusers.d line this writes) and reloads systemd; it never follows a symbolic link it finds where
one of its folders or files should be (a link there is refused, not chowned through).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

from bastion.demo import demo_config_text
from bastion.safety.errors import Conflict, InvalidRequest, OperationFailed, Unavailable
from bastion.safety.paths import file_replaceable_by, folder_to_make_changeable_by, owners_phrase

__all__ = [
    "CONFIG_PATH",
    "ROOT_DROP_IN",
    "UNIT_NAME",
    "InstallOptions",
    "default_executable",
    "install_service",
    "render_unit",
    "service_config_text",
]

UNIT_NAME: Final = "bastion.service"
ROOT_DROP_IN: Final = "root.conf"
CONFIG_PATH: Final = Path("/etc/bastion/bastion.toml")
STATE_DIR: Final = Path("/var/lib/bastion")
DATA_DIR: Final = Path("/srv/bastion")
UNIT_DIR: Final = Path("/etc/systemd/system")
SYSUSERS_PATH: Final = Path("/etc/sysusers.d/bastion.conf")
# useradd's portable name rule (and systemd's "strict" one): no dots, no leading digit or dash.
_USER_NAME: Final = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
# Folders a unit's ProtectHome=/PrivateTmp= hide from the service: an ExecStart there cannot run.
_HIDDEN: Final = tuple(Path(top) for top in ("/root", "/home", "/run/user", "/tmp", "/var/tmp"))  # noqa: S108 - names, not used
# What a systemd command line would reinterpret (quoting, specifiers, variables) or split.
_UNSAFE_EXEC: Final = re.compile(r"[\s\"'\\%$;]")


@dataclass(frozen=True)
class InstallOptions:
    """What `bastion install-service` was asked to do."""

    executable: Path
    prefix: Path = Path("/")
    user: str = "bastion"
    as_root: bool = False
    dry_run: bool = False


def default_executable() -> Path:
    """The `bastion` script of the environment running this command (a venv's bin/bastion)."""
    return Path(sys.executable).absolute().parent / "bastion"


def render_unit(executable: Path, user: str) -> str:
    """bastion.service with this ExecStart and account."""
    text = _packaged(UNIT_NAME)
    command = f"ExecStart={executable} serve --config {CONFIG_PATH} --http"
    text = re.sub(r"(?m)^ExecStart=.*$", command, text, count=1)
    text = re.sub(r"(?m)^User=bastion$", f"User={user}", text, count=1)
    return re.sub(r"(?m)^Group=bastion$", f"Group={user}", text, count=1)


def service_config_text(*, disk_quota: bool) -> str:
    """`bastion init`'s config, laid out for the service: state in /var/lib/bastion, folders in /srv/bastion."""
    text = demo_config_text()
    text = text.replace(
        "# bastion demo configuration, written by `bastion init`.",
        "# bastion's configuration as a service, written by `bastion install-service`.",
    )
    text = text.replace('state_dir = "state"', f'state_dir = "{STATE_DIR}"')
    text = text.replace('key_path = "state/', f'key_path = "{STATE_DIR}/')
    text = text.replace('path = "workspace"', f'path = "{DATA_DIR}/workspace"')
    text = text.replace('path = "inbox"', f'path = "{DATA_DIR}/inbox"')
    if not disk_quota:
        text = text.replace(
            "disk_quota = true           # /workspace is its own filesystem of limits.disk_bytes (needs root)",
            "disk_quota = false          # unprivileged: true needs root (bastion.service.d/root.conf)",
        )
    return text


def install_service(options: InstallOptions, out: TextIO) -> None:
    """Create or update the account, folders, config and unit, printing one line per step.

    Raises:
        InvalidRequest: a bad user name, prefix or executable path.
        Conflict: a link or a file stands where one of the folders or files should be.
        Unavailable: systemd-sysusers or systemctl is missing or failed.
        OperationFailed: the file system refused a step.
    """
    _check(options)
    try:
        _install(options, out)
    except OSError as exc:
        raise OperationFailed(f"{exc.filename or 'install-service'}: {exc.strerror or exc}") from None


def _install(options: InstallOptions, out: TextIO) -> None:
    run = _Runner(options, out)
    if not options.as_root:
        run.account()
    group = "root" if options.as_root else options.user
    run.folder(CONFIG_PATH.parent, 0o750, "root", group)
    # As root, passable by the sandboxes' ids (what bastion itself sets, and root.conf's StateDirectoryMode).
    run.folder(STATE_DIR, 0o711 if options.as_root else 0o700, group, group)
    for folder in (DATA_DIR, DATA_DIR / "workspace", DATA_DIR / "inbox"):
        run.folder(folder, 0o750, group, group)
    run.config(service_config_text(disk_quota=options.as_root), group)
    run.file(UNIT_DIR / UNIT_NAME, render_unit(options.executable, options.user))
    drop_in = UNIT_DIR / f"{UNIT_NAME}.d" / ROOT_DROP_IN
    if options.as_root:
        run.folder(drop_in.parent, 0o755, "root", "root")
        run.file(drop_in, _packaged(ROOT_DROP_IN))
    else:
        run.remove(drop_in)
    run.reload()
    _next_steps(options, out)


def _check(options: InstallOptions) -> None:
    if not options.prefix.is_absolute():
        raise InvalidRequest(f"--prefix {options.prefix} must be an absolute path")
    _check_prefix(options.prefix)
    if not _USER_NAME.fullmatch(options.user) or options.user == "root":
        raise InvalidRequest(
            f"--user {options.user!r} must be an account name (lower case, digits, _ and -); for root use --as-root"
        )
    exe = str(options.executable)
    if not options.executable.is_absolute() or _UNSAFE_EXEC.search(exe):
        raise InvalidRequest(f"--exec {exe!r} must be an absolute path without spaces, quotes, % or $")
    # Under a prefix the program may live only in the image being built; here it must run.
    if options.prefix == Path("/") and not os.access(options.executable, os.X_OK):
        raise InvalidRequest(f"--exec {exe} is not an executable file: name the bastion the service should run")
    if options.prefix == Path("/"):
        _check_not_writable_by_others(options.executable)


def _check_prefix(prefix: Path) -> None:
    """Every step writes beneath `prefix` by path, as root: it (or, not made yet, the folder it will be
    made in) and the folders above it must be ones only root and this user could change, reached through
    no symbolic link. Else a link another user planted in /tmp sends the unit and root's config into their
    folder, or a folder of theirs on the way lets them rewrite the unit's ExecStart before the image ships."""
    if ".." in prefix.parts:  # judged as text, it would be resolved by the kernel after a link
        raise InvalidRequest(f"--prefix {prefix} goes through '..': give the folder's real path")
    owner = (os.geteuid(), os.getegid())
    try:
        who = folder_to_make_changeable_by(str(prefix), owner)
    except OSError as exc:
        raise InvalidRequest(f"--prefix {prefix} cannot be examined ({exc.strerror or exc}): fix the path") from None
    if who is not None:
        raise InvalidRequest(
            f"--prefix {prefix} could be changed by {who}, and so the unit and config installed there: "
            f"install into a folder {owners_phrase(owner)} alone, reached through no symbolic link"
        )


def _check_not_writable_by_others(executable: Path) -> None:
    """The service runs ExecStart (as root with --as-root): the script, its interpreter and every folder
    and link on the way to them must be root's and closed to others, else a local user rewrites what the
    service runs. Links are judged as links (who may re-point them), not by where they lead now: ExecStart
    names the path, links and all."""
    for program in (executable, *_interpreter(executable)):
        try:
            who = file_replaceable_by(str(program), (0, 0))
        except OSError as exc:
            raise InvalidRequest(f"--exec {executable}: {program} cannot be examined ({exc.strerror or exc})") from None
        if who is not None:
            raise InvalidRequest(
                f"--exec {executable}: {who}; the service would run what they put there: install bastion where "
                "only root writes (e.g. /opt/bastion)"
            )


class _Runner:
    """Carries out (or, dry, describes) each step under the prefix."""

    def __init__(self, options: InstallOptions, out: TextIO) -> None:
        self._options = options
        self._out = out
        self._changed = False

    def _path(self, path: Path) -> Path:
        return self._options.prefix / path.relative_to("/")

    def _say(self, action: str, path: Path | str, detail: str = "") -> None:
        verb = f"would {action}" if self._options.dry_run and action != "ok" else action
        self._out.write(f"{verb} {path}{f' ({detail})' if detail else ''}\n")

    def _do(self, action: str, path: Path | str, detail: str, change: Callable[[], None]) -> None:
        self._say(action, path, detail)
        if not self._options.dry_run:
            change()
            self._changed = True

    def account(self) -> None:
        name = self._options.user
        line = f'u {name} - "bastion MCP server" {STATE_DIR} /usr/sbin/nologin\n'
        self.file(SYSUSERS_PATH, line)
        if _lookup(self._path(Path("/etc/passwd")), name) is not None:
            self._say("ok", f"user {name}")
            return
        self._do("create", f"user {name}", "systemd-sysusers", self._sysusers)

    def _sysusers(self) -> None:
        tool = shutil.which("systemd-sysusers")
        if tool is None:
            raise Unavailable("systemd-sysusers is not installed: this command is for systemd hosts")
        argv = [tool, f"--root={self._options.prefix}", str(self._path(SYSUSERS_PATH))]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise Unavailable(f"systemd-sysusers failed: {done.stderr.strip().splitlines()[-1:]}")

    def _ids(self, user: str, group: str) -> tuple[int, int]:
        uid = 0 if user == "root" else _lookup(self._path(Path("/etc/passwd")), user)
        gid = 0 if group == "root" else _lookup(self._path(Path("/etc/group")), group)
        if uid is None or gid is None:
            raise OperationFailed(f"no account {user}:{group} under {self._options.prefix}: it was not created")
        return uid, gid

    def folder(self, path: Path, mode: int, user: str, group: str) -> None:
        target = self._path(path)
        detail = f"{mode:04o} {user}:{group}"
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            self._do("create", path, detail, lambda: self._make_folder(target, mode, user, group))
            return
        if not stat.S_ISDIR(st.st_mode):
            raise Conflict(f"{target} is not a folder (a link or a file): move it away, then install again")
        if self._options.dry_run and (user != "root" or group != "root"):
            self._say("ok" if stat.S_IMODE(st.st_mode) == mode else "fix", path, detail)
            return
        uid, gid = self._ids(user, group)
        if (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, uid, gid):
            self._say("ok", path, detail)
            return
        self._do("fix", path, detail, lambda: self._own(target, mode, uid, gid))

    def _make_folder(self, target: Path, mode: int, user: str, group: str) -> None:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        target.mkdir(mode=mode)
        self._own(target, mode, *self._ids(user, group))

    @staticmethod
    def _own(target: Path, mode: int, uid: int, gid: int) -> None:
        os.chown(target, uid, gid, follow_symlinks=False)
        os.chmod(target, mode, follow_symlinks=False)

    def file(self, path: Path, text: str, mode: int = 0o644) -> None:
        target = self._path(path)
        if _read_regular(target) == text:
            self._say("ok", path)
            return
        action = "create" if not os.path.lexists(target) else "update"
        self._do(action, path, "", lambda: _write(target, text, mode))

    def config(self, text: str, group: str) -> None:
        target = self._path(CONFIG_PATH)
        if os.path.lexists(target):
            if _read_regular(target) is None:
                raise Conflict(f"{target} is not a regular file: move it away, then install again")
            self._keep_config(target, group)
            return

        def write() -> None:
            _write(target, text, 0o640)
            os.chown(target, 0, self._ids("root", group)[1], follow_symlinks=False)

        self._do("create", CONFIG_PATH, f"0640 root:{group}", write)

    def _keep_config(self, target: Path, group: str) -> None:
        """Keep an existing config's text, but not an owner or mode that lets the service's account
        (or anyone but root) rewrite it: root reads it too (`template build`, `admin`)."""
        st = os.lstat(target)
        if st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            self._say("ok", CONFIG_PATH, "kept as it is")
            return

        def fix() -> None:
            os.chown(target, 0, self._ids("root", group)[1], follow_symlinks=False)
            os.chmod(target, 0o640, follow_symlinks=False)

        self._do("fix", CONFIG_PATH, f"0640 root:{group}, text kept as it is", fix)

    def remove(self, path: Path) -> None:
        target = self._path(path)
        if os.path.lexists(target):
            self._do("remove", path, "", target.unlink)

    def reload(self) -> None:
        if not self._changed and not self._options.dry_run:
            return
        if self._options.prefix != Path("/") or not Path("/run/systemd/system").is_dir():
            self._out.write("systemd does not run here: on the target, run 'systemctl daemon-reload'\n")
            return
        self._do("run", "systemctl daemon-reload", "", _daemon_reload)


def _daemon_reload() -> None:
    done = subprocess.run(["systemctl", "daemon-reload"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise Unavailable(f"systemctl daemon-reload failed: {done.stderr.strip()}")


def _lookup(table: Path, name: str) -> int | None:
    """The id of `name` in an /etc/passwd or /etc/group file, or None."""
    try:
        lines = table.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) > 2 and fields[0] == name and fields[2].isdigit():
            return int(fields[2])
    return None


def _read_regular(path: Path) -> str | None:
    """The text of a regular file (not through a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        return handle.read()


def _write(target: Path, text: str, mode: int) -> None:
    """Replace `target` whole (a link there is replaced, never followed)."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.new")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()  # a leftover, or a link planted there: O_NOFOLLOW below would refuse it
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        os.fchmod(handle.fileno(), mode)
    os.replace(temporary, target)


def _packaged(name: str) -> str:
    return importlib.resources.files("bastion.systemd").joinpath(name).read_text(encoding="utf-8")


def _next_steps(options: InstallOptions, out: TextIO) -> None:
    if options.dry_run:
        return
    as_user = "" if options.as_root else f"runuser -u {options.user} -- "
    exe = options.executable
    interpreters = _interpreter(exe)
    runs = [exe, exe.resolve(), *interpreters, *(path.resolve() for path in interpreters)]
    hidden = next((str(top) for top in _HIDDEN for path in runs if _under(path, top)), None)
    if hidden is not None:
        out.write(f"warning: {exe} is under {hidden}, which the unit hides (ProtectHome=, PrivateTmp=): ")
        out.write("install bastion elsewhere (e.g. /opt/bastion) and run this again with --exec\n")
    out.write(
        "next:\n"
        f"  {as_user}{exe} admin set-password --config {CONFIG_PATH} --generate\n"
        f"  systemctl enable --now {UNIT_NAME}\n"
        f"  systemctl status {UNIT_NAME}; journalctl -u {UNIT_NAME} -f\n"
    )


def _interpreter(script: Path) -> list[Path]:
    """The interpreter of a `#!` script (a venv's bin/bastion), if it is one, as the script names it."""
    try:
        with open(script, "rb") as handle:
            first = handle.readline(4096)
    except OSError:
        return []
    if not first.startswith(b"#!") or not first[2:].split():
        return []
    return [Path(os.fsdecode(first[2:].split()[0]))]


def _under(path: Path, top: Path) -> bool:
    return path == top or top in path.parents
