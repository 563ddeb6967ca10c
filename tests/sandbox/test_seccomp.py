"""The sandbox's seccomp filter, loaded by real bubblewrap into a sandbox shaped like production's.

Each attack test runs the attempt twice where that is meaningful: under the filter
(refused) and without it (allowed), so a pass shows the filter, not the rest of the
sandbox, did the refusing. Where the kernel refuses anyway for lack of a
capability (kexec_load, init_module, open_by_handle_at) the live test only shows
the refusal; `test_every_denial_is_in_the_program_for_each_abi` shows the rule.
"""

from __future__ import annotations

import ctypes
import errno
import json
import marshal
import os
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from bastion.sandbox import seccomp
from bastion.sandbox._spawn import SandboxSpec, build_bwrap_argv, sandbox_python

pytestmark = pytest.mark.bwrap

IS_X86_64 = os.uname().machine == "x86_64"
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
SIGCHLD = 17

# libseccomp names the syscall numbers of this machine for the probes.
_LIB = ctypes.CDLL("libseccomp.so.2")
_LIB.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
_LIB.seccomp_syscall_resolve_name_arch.argtypes = (ctypes.c_uint32, ctypes.c_char_p)
NR = {
    name: _LIB.seccomp_syscall_resolve_name(name.encode())
    for name in (
        "mount",
        "unshare",
        "clone",
        "clone3",
        "setns",
        "keyctl",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "ptrace",
        "kexec_load",
        "init_module",
        "io_uring_setup",
        "open_by_handle_at",
    )
}

# Runs inside the sandbox as `python3 -I -S -c PRELUDE+probe NR-json`; prints one word.
PRELUDE = """
import ctypes, errno, json, os, signal, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = json.loads(sys.argv[1])

def call(name, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(NR[name], *args)
    return "OK" if rc >= 0 else errno.errorcode[ctypes.get_errno()]

def clone(flags):
    pid = libc.syscall(NR["clone"], ctypes.c_long(flags), 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid < 0:
        return errno.errorcode[ctypes.get_errno()]
    return "OK" if os.waitpid(pid, 0)[1] == 0 else "CHILD-FAILED"
"""


def sandbox_argv(command: Sequence[str], seccomp_fd: int | None) -> list[str]:
    """The production sandbox's shape (see `_spawn.build_bwrap_argv`), minus the workspace."""
    bwrap = shutil.which("bwrap")
    assert bwrap is not None, "bubblewrap is not installed"
    argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0", "--die-with-parent"]
    argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
    argv += ["--ro-bind", "/usr", "/usr"]
    argv += ["--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"]
    argv += ["--symlink", "usr/sbin", "/sbin", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return [*argv, "--", *command]


def run_sandboxed(command: Sequence[str], *, filtered: bool = True) -> subprocess.CompletedProcess[str]:
    fd = seccomp.write_filter_fd() if filtered else None
    try:
        return subprocess.run(
            sandbox_argv(command, fd),
            pass_fds=() if fd is None else (fd,),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    finally:
        if fd is not None:
            os.close(fd)


def probe(code: str, *, filtered: bool = True) -> str:
    """Run `code` (after PRELUDE) in the sandbox; return the one word it printed."""
    done = run_sandboxed(["/usr/bin/python3", "-I", "-S", "-c", PRELUDE + code, json.dumps(NR)], filtered=filtered)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# -- attacks: refused under the filter ------------------------------------------------------------

ATTACKS = {
    "mount_tmpfs": 'print(call("mount", b"none", b"/tmp", b"tmpfs", 0, None))',
    "unshare_new_user_namespace": f'print(call("unshare", {CLONE_NEWUSER}))',
    "clone_new_user_namespace": f"print(clone({CLONE_NEWUSER | SIGCHLD}))",
    "setns_into_namespace": (
        'fd = os.open("/proc/self/ns/uts", os.O_RDONLY)\nprint(call("setns", fd, 0x04000000))'  # CLONE_NEWUTS
    ),
    # nstype 0 means "whatever fd is": only the exact CLONE_NEWPID passes the filter.
    "setns_pid_namespace_as_any_type": ('fd = os.open("/proc/self/ns/pid", os.O_RDONLY)\nprint(call("setns", fd, 0))'),
    "keyctl_session_keyring": 'print(call("keyctl", 0, -3, 0))',  # KEYCTL_GET_KEYRING_ID, session
    "bpf_map_create": 'print(call("bpf", 0, None, 0))',
    "perf_event_open": 'print(call("perf_event_open", None, 0, -1, -1, 0))',
    "userfaultfd_user_mode": f'print(call("userfaultfd", {os.O_CLOEXEC | 1}))',  # UFFD_USER_MODE_ONLY
    "ptrace_attach_other_process": (
        "child = os.fork()\n"
        "if child == 0:\n"
        "    signal.pause()\n"
        "    os._exit(0)\n"
        'print(call("ptrace", 16, child, 0, 0))\n'  # PTRACE_ATTACH
        "os.kill(child, signal.SIGKILL)\n"
        "os.waitpid(child, 0)"
    ),
    "kexec_load": 'print(call("kexec_load", 0, 0, None, 0))',
    "init_module": 'print(call("init_module", None, 0, b""))',
    "io_uring_setup": 'print(call("io_uring_setup", 1, ctypes.create_string_buffer(256)))',
    "open_by_handle_at": 'print(call("open_by_handle_at", -100, ctypes.create_string_buffer(64), 0))',
}

# What the same attempt gives without the filter, where that differs from the filter's answer.
UNFILTERED = {
    "mount_tmpfs": "OK",
    "unshare_new_user_namespace": "OK",
    "clone_new_user_namespace": "OK",
    "setns_into_namespace": "OK",
    "setns_pid_namespace_as_any_type": "OK",
    "userfaultfd_user_mode": "OK",
    "ptrace_attach_other_process": "OK",
    "io_uring_setup": "OK",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_is_refused_with_eperm(attack: str) -> None:
    """Invariant: each denied operation fails with EPERM inside the sandbox.

    Does not prove the operation is otherwise harmless, only that it is refused.
    """
    assert probe(ATTACKS[attack]) == "EPERM"


@pytest.mark.parametrize("attack", sorted(UNFILTERED))
def test_attack_succeeds_without_the_filter(attack: str) -> None:
    """Control: without --seccomp the same attempt works, so the refusal above is the filter's."""
    assert probe(ATTACKS[attack], filtered=False) == UNFILTERED[attack]


def test_clone3_fails_with_enosys_so_libc_falls_back() -> None:
    """Invariant: clone3 reports ENOSYS (not EPERM): glibc then retries with clone, which the filter can read."""
    code = 'print(call("clone3", None, 0))'
    assert probe(code) == "ENOSYS"
    assert probe(code, filtered=False) == "EINVAL"


def test_unshare_tool_cannot_make_a_user_namespace() -> None:
    """Invariant: util-linux `unshare -U` fails inside the sandbox (it works without the filter)."""
    refused = run_sandboxed(["/usr/bin/unshare", "-U", "/bin/true"])
    assert refused.returncode != 0
    assert "Operation not permitted" in refused.stderr
    assert run_sandboxed(["/usr/bin/unshare", "-U", "/bin/true"], filtered=False).returncode == 0


# int 0x80 from 64-bit code enters the kernel's 32-bit ABI: push rbx; mov eax, nr;
# mov ebx, a0; mov ecx, a1; int 0x80; pop rbx; ret.
INT80_PROBE = """
import mmap
def int80(nr, a0=0, a1=0):
    code = b"\\x53\\xb8" + nr.to_bytes(4, "little") + b"\\xbb" + a0.to_bytes(4, "little")
    code += b"\\xb9" + a1.to_bytes(4, "little") + b"\\xcd\\x80\\x5b\\xc3"
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    rc = ctypes.CFUNCTYPE(ctypes.c_int)(address)()
    return "OK" if rc >= 0 else errno.errorcode[-rc]
assert int80(20) == "OK"  # getpid: the 32-bit ABI works at all
print(int80(310, 0x10000000))  # i386 unshare(CLONE_NEWUSER)
"""


@pytest.mark.skipif(not IS_X86_64, reason="the 32-bit x86 ABI exists only on x86_64")
def test_unshare_through_the_32bit_abi_is_refused() -> None:
    """Invariant: a 32-bit syscall (int 0x80) meets the same rule as the native one."""
    assert probe(INT80_PROBE) == "EPERM"
    assert probe(INT80_PROBE, filtered=False) == "OK"


# -- what the agent and ordinary programs need keeps working ---------------------------------------

NEEDED = {
    "clone_new_pid_namespace": f"print(clone({CLONE_NEWPID | SIGCHLD}))",
    "unshare_new_pid_namespace": f'print(call("unshare", {CLONE_NEWPID}))',
    # The agent's sequence before each command: children's PID namespace back to its own, then a new one.
    "setns_back_then_unshare_pid_namespace_twice": (
        'own = os.open("/proc/self/ns/pid", os.O_RDONLY)\n'
        f'steps = [call(name, *args) for _ in range(2) for name, args in (("setns", (own, {CLONE_NEWPID})), '
        f'("unshare", ({CLONE_NEWPID},)))]\n'
        "print('OK' if steps == ['OK'] * 4 else steps)"
    ),
    "fork": "pid = os.fork()\nif pid == 0:\n    os._exit(0)\nprint('OK' if os.waitpid(pid, 0)[1] == 0 else 'FAILED')",
    "execve_true": (
        "pid = os.fork()\n"
        "if pid == 0:\n"
        '    os.execv("/bin/true", ["true"])\n'
        "print('OK' if os.waitpid(pid, 0)[1] == 0 else 'FAILED')"
    ),
    "posix_spawn_via_clone3_fallback": (
        "pid = os.posix_spawn('/bin/true', ['true'], {})\nprint('OK' if os.waitpid(pid, 0)[1] == 0 else 'FAILED')"
    ),
    "thread_via_clone3_fallback": (
        "import threading\n"
        "seen = []\n"
        "t = threading.Thread(target=seen.append, args=(1,))\n"
        "t.start()\n"
        "t.join()\n"
        "print('OK' if seen == [1] else 'FAILED')"
    ),
    "sendmsg_scm_rights": (
        "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "r, w = os.pipe()\n"
        'socket.send_fds(a, [b"x"], [w])\n'
        "data, fds, _, _ = socket.recv_fds(b, 16, 1)\n"
        "print('OK' if data == b'x' and len(fds) == 1 else 'FAILED')"
    ),
    "drop_capabilities_and_no_new_privs": (
        "assert libc.prctl(38, 1, 0, 0, 0) == 0\n"  # PR_SET_NO_NEW_PRIVS
        "assert libc.prctl(24, 21, 0, 0, 0) == 0\n"  # PR_CAPBSET_DROP CAP_SYS_ADMIN
        "header = (ctypes.c_uint32 * 2)(0x20080522, 0)\n"
        "data = (ctypes.c_uint32 * 6)()\n"
        "print('OK' if libc.capset(header, data) == 0 else errno.errorcode[ctypes.get_errno()])"
    ),
}


@pytest.mark.parametrize("operation", sorted(NEEDED))
def test_operation_the_sandbox_needs_still_works(operation: str) -> None:
    """Invariant: the filter leaves the agent's own syscalls and everyday process creation working."""
    assert probe(NEEDED[operation]) == "OK"


@pytest.fixture
def agent_sandbox(tmp_path: Path) -> Iterator[socket.socket]:
    """The real agent, started from the production argv (which carries `--seccomp FD`)."""
    host_end, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    filter_fd = seccomp.write_filter_fd()
    argv = build_bwrap_argv(SandboxSpec(workspace=str(tmp_path)), agent_end.fileno(), sandbox_python(), filter_fd)
    assert argv[argv.index("--seccomp") + 1] == str(filter_fd)
    proc = subprocess.Popen(argv, pass_fds=(agent_end.fileno(), filter_fd), stderr=subprocess.PIPE)
    agent_end.close()
    os.close(filter_fd)
    host_end.settimeout(10)
    try:
        yield host_end
    finally:
        host_end.close()
        proc.kill()
        proc.communicate(timeout=10)


def test_agent_runs_a_command_under_the_filter(agent_sandbox: socket.socket) -> None:
    """Invariant: the resident agent starts and runs a command as PID 1 of its own PID
    namespace, all under the filter, with no capability left to the command."""
    assert json.loads(agent_sandbox.recv(65536))["event"] == "ready"
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    script = (
        "grep -E '^(Seccomp|CapEff|CapBnd|NoNewPrivs):' /proc/self/status; echo pid $$; unshare -U true || echo refused"
    )
    request = {
        "op": "run",
        "id": 7,
        "exe": "/bin/sh",
        "argv": ["sh", "-c", script],
        "cwd": "/workspace",
        "env": {"PATH": "/usr/bin:/bin"},
    }
    socket.send_fds(agent_sandbox, [marshal.dumps(request)], [out_w, err_w])
    for fd in (out_w, err_w):
        os.close(fd)
    with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
        lines = out.read().decode().split()
        assert b"Operation not permitted" in err.read()
    assert lines == [
        "CapEff:", "0000000000000000", "CapBnd:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2",
        "pid", "1", "refused",
    ]  # fmt: skip
    assert json.loads(agent_sandbox.recv(65536)) == {"event": "exit", "id": 7, "status": 0}


# -- the compiled program, read instruction by instruction -----------------------------------------

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000
ALLOW = 0x7FFF0000


def errno_action(code: int) -> int:
    return 0x00050000 | code


def run_bpf(program: bytes, nr: int, arch: int, args: Sequence[int] = ()) -> int:
    """Evaluate a classic BPF seccomp program on one struct seccomp_data (seccomp(2)).

    Covers the instructions libseccomp emits; an unknown opcode fails the test.
    """
    words = list(args) + [0] * (6 - len(args))
    data = struct.pack("=iIQ6Q", nr, arch, 0, *words)
    insns: list[tuple[int, int, int, int]] = [
        struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)
    ]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld [k]
            (acc,) = struct.unpack_from("=I", data, k)
        elif code == 0x54:  # and #k
            acc &= k
        elif code == 0x05:  # ja
            pc += k
        elif code in (0x15, 0x25, 0x35, 0x45):  # jeq, jgt, jge, jset #k
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"opcode {code:#x} at {pc - 1} is not handled by this reader")


@pytest.fixture(scope="module")
def program() -> bytes:
    return seccomp.build_filter()


def resolve(arch: int, name: str) -> int:
    nr: int = _LIB.seccomp_syscall_resolve_name_arch(arch, name.encode())
    return nr


@pytest.mark.skipif(not IS_X86_64, reason="checks the x86_64 and i386 programs")
def test_every_denial_is_in_the_program_for_each_abi(program: bytes) -> None:
    """Invariant: every row of the deny table that a 64- or 32-bit x86 ABI has is enforced on that ABI.

    Reads the exported program rather than the kernel, so it also covers syscalls
    the kernel would refuse anyway for lack of a capability.
    """
    checked = 0
    for denial in seccomp.DENIED:
        args = [denial.arg0_has] if denial.arg0_has else []
        for arch in (AUDIT_ARCH_X86_64, AUDIT_ARCH_I386):
            nr = resolve(arch, denial.syscall)
            if nr < 0:
                continue
            assert run_bpf(program, nr, arch, args) == errno_action(denial.errno), (denial.syscall, hex(arch))
            checked += 1
    assert checked > 2 * len(seccomp.DENIED) - 6


@pytest.mark.skipif(not IS_X86_64, reason="checks the x86_64 and i386 programs")
def test_clone_without_new_user_namespace_is_allowed_on_each_abi(program: bytes) -> None:
    """Invariant: the masked comparison refuses CLONE_NEWUSER only, whatever else is set."""
    for arch in (AUDIT_ARCH_X86_64, AUDIT_ARCH_I386):
        clone = resolve(arch, "clone")
        assert run_bpf(program, clone, arch, [CLONE_NEWPID | SIGCHLD]) == ALLOW
        assert run_bpf(program, clone, arch, [CLONE_NEWPID | CLONE_NEWUSER | SIGCHLD]) == errno_action(errno.EPERM)
        assert run_bpf(program, resolve(arch, "read"), arch) == ALLOW


@pytest.mark.skipif(not IS_X86_64, reason="x32 exists only on x86_64")
def test_x32_abi_and_foreign_arches_get_enosys(program: bytes) -> None:
    """Invariant: x32 syscall numbers and any unlisted architecture are refused, never allowed.

    The kernel here may lack x32 altogether; this reads the program, not the kernel.
    """
    unshare_x32 = X32_SYSCALL_BIT | resolve(AUDIT_ARCH_X86_64, "unshare")
    assert run_bpf(program, unshare_x32, AUDIT_ARCH_X86_64, [CLONE_NEWUSER]) == errno_action(errno.ENOSYS)
    assert run_bpf(program, X32_SYSCALL_BIT | 0, AUDIT_ARCH_X86_64) == errno_action(errno.ENOSYS)
    assert run_bpf(program, 0, AUDIT_ARCH_AARCH64) == errno_action(errno.ENOSYS)


def test_filter_fd_is_sealed_and_rewound() -> None:
    """Invariant: the fd holds exactly the program from its start and cannot be rewritten."""
    fd = seccomp.write_filter_fd()
    try:
        assert not os.get_inheritable(fd)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.read(fd, 1 << 20) == seccomp.build_filter()
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 8, 0)
    finally:
        os.close(fd)
