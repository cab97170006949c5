"""What a sandbox worker does to itself before it loads untrusted code, and what every service
does to itself at start.

A sandbox worker runs code a policy or a user wrote. It often shares the services' uid (one pod,
one user), and under Kubernetes' RuntimeDefault seccomp profile it gets no namespaces, so the
layers that must hold everywhere are the ones a process can put on itself without privilege:

- `make_undumpable` (every service, at start): PR_SET_DUMPABLE 0 makes the process's
  /proc/<pid>/environ, mem, fd and cwd root-owned, so a process of the same uid cannot read the
  Redis URL or the weight key out of a running service, nor ptrace it.
- `confine` (the worker): no-new-privileges, a parent-death signal, then
  - Landlock (kernel 5.13+, here by hand over the three syscalls: the `landlock` package on the
    index is an alpha that covers filesystem rules only, not the network (ABI 4) or the signal
    and abstract-socket scopes (ABI 6) used here): write only the private directory (and
    /dev/null), read only the interpreter's installation and the packages on the import path
    (not a run's output directory, not a user's venv to plant a .pth in, not /proc), no TCP
    bind or connect, no signal to a process outside the sandbox;
  - a seccomp filter built with libseccomp (`pyseccomp`, a ctypes binding to the system's
    libseccomp, which knows each architecture's syscall numbers): no socket but AF_UNIX, no new
    process (clone without CLONE_THREAD, fork, vfork, clone3), no exec, no signal to another
    process, no ptrace, process_vm_*, pidfd_getfd or io_uring, no namespace or keyring calls.
  Threads keep working: the filter allows clone with CLONE_THREAD.
- Resource limits stay in `sandbox.worker`; RLIMIT_NPROC is set only when the worker runs as a
  uid of its own (`worker_uid`): with a shared uid it would count the services' threads too.

`confine` returns what it applied (`Confinement`); the pool refuses to run untrusted code when a
worker got neither Landlock nor seccomp, unless the operator opts in (`UNCONFINED_ENV`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import signal
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

UNCONFINED_ENV: Final = "DAPO_SANDBOX_ALLOW_UNCONFINED"
"""Set to 1 to run tools and reward functions where the kernel offers neither Landlock nor
seccomp: their code can then read every file this uid can (a run's Redis configuration, its
output), write into the user's environment, signal the services and open network connections."""
UNPRIVILEGED_UID: Final = 65534
"""The uid (and gid) a worker takes when the services run as root: `nobody`."""
LAYERS: Final = ("landlock", "seccomp")
"""The kernel layers `confine` applies; a sandbox may be given fewer (`Sandbox(layers=...)`: the
tests run each attack against each layer alone)."""
MAX_PROCESSES: Final = 64
"""RLIMIT_NPROC of a worker under its own uid: threads, not forks (the filter refuses those)."""

PR_SET_PDEATHSIG: Final = 1
PR_GET_DUMPABLE: Final = 3
PR_SET_DUMPABLE: Final = 4
PR_SET_NO_NEW_PRIVS: Final = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def make_undumpable() -> bool:
    """PR_SET_DUMPABLE 0 on this process (see the module docstring); False off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    _prctl(PR_SET_DUMPABLE, 0)
    return True


def is_dumpable() -> bool:
    return bool(_libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it ends; if the parent is already gone
    (between fork and here), exit now."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def term_with_parent() -> None:
    """A `preexec_fn` for the processes `dapo run` starts: SIGTERM (a graceful stop) when the
    launcher dies, even by SIGKILL, so no service or embedded redis-server outlives it. Only a
    prctl between fork and exec: nothing that takes a lock."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# --- Landlock ---------------------------------------------------------------------------------
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # one table, every arch
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 1 << 1, 1 << 2, 1 << 3
_FS_MAKE_CHAR, _FS_MAKE_BLOCK = 1 << 6, 1 << 11
_FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 1 << 1
_READ: Final = _FS_READ_FILE | _FS_READ_DIR  # not EXECUTE: no program runs (extensions map)
_FILE_ONLY: Final = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (old kernel, LSM not enabled)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc.syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    return max(0, int(version))


def _fs_access(abi: int) -> int:
    access = _FS_ABI1
    if abi >= 2:
        access |= _FS_REFER
    if abi >= 3:
        access |= _FS_TRUNCATE
    if abi >= 5:
        access |= _FS_IOCTL_DEV
    return access


def _landlock(read: Iterable[str], write: Iterable[str], abi: int) -> None:
    handled = _fs_access(abi)
    attr = _RulesetAttr(
        handled_access_fs=handled,
        handled_access_net=(_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
        scoped=(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    ruleset = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    if ruleset < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        # Everything in the private directory but device nodes (a worker of root could make one
        # for the disk and read it).
        writable = handled & ~(_FS_MAKE_CHAR | _FS_MAKE_BLOCK)
        for paths, access in ((read, _READ), (write, writable)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # a path this host lacks: nothing to allow
                try:
                    allowed = access & handled
                    if not os.path.isdir(path):
                        allowed &= _FILE_ONLY
                    rule = _PathBeneathAttr(allowed_access=allowed, parent_fd=fd)
                    if _libc.syscall(
                        _SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0
                    ):
                        err = ctypes.get_errno()
                        raise OSError(err, f"landlock_add_rule({path}): {os.strerror(err)}")
                finally:
                    os.close(fd)
        if _libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(ruleset)


def readable_paths(import_path: Iterable[str]) -> list[str]:
    """What the interpreter needs to read: its installation (the venv and the base Python, whole)
    and, of every other import-path directory, only its packages and modules, so a project root
    on the path does not open its run directories (`runs/`, a Redis configuration) or `.git`."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out = [*sorted(prefixes), "/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/localtime"]
    out += ["/dev/urandom", "/sys/devices/system/cpu", "/proc/self"]  # its own /proc only
    for entry in import_path:
        real = os.path.realpath(entry) if entry else ""
        if not real or not os.path.isdir(real):
            if real.endswith(".zip") and os.path.isfile(real):
                out.append(real)
            continue
        if any(real == p or real.startswith(p + os.sep) for p in prefixes):
            out.append(real)
            continue
        with os.scandir(real) as entries:
            for item in entries:
                package = item.is_dir() and (Path(item.path) / "__init__.py").exists()
                if package or (item.is_file() and item.name.endswith((".py", ".so"))):
                    out.append(item.path)
    return out


# --- seccomp ----------------------------------------------------------------------------------
CLONE_THREAD: Final = 0x00010000
AF_UNIX: Final = 1
_DENIED: Final = (
    "fork",
    "vfork",
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kcmp",
    "tkill",
    # What only a privileged worker could do (a worker of root keeps root's capabilities):
    "open_by_handle_at",
    "name_to_handle_at",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "iopl",
    "ioperm",
    "swapon",
    "swapoff",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "acct",
    "quotactl",
    "syslog",
)


def _seccomp(*, allow_processes: bool) -> None:
    import pyseccomp as sc

    me = os.getpid()
    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.CTL_TSYNC, 1)  # every thread of the worker, not only this one
    for name in _DENIED:
        if allow_processes and name in ("fork", "vfork", "execve", "execveat"):
            continue
        try:
            f.add_rule(deny, name)
        except (OSError, ValueError):  # a syscall this architecture does not have
            continue
    f.add_rule(deny, "socket", sc.Arg(0, sc.NE, AF_UNIX))
    # A signal only to itself (libseccomp takes one comparison per argument and rule, so not to
    # its own group either: nothing in a worker signals that).
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add_rule(deny, name, sc.Arg(0, sc.NE, me))
    if not allow_processes:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
        # clone3 passes its flags in memory, which a filter cannot read: ENOSYS makes the C
        # library fall back to clone, which the rule above checks.
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.load()


# --- the whole ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Confinement:
    """What a worker got (`confine`), reported to the pool in its ready frame."""

    landlock_abi: int = 0
    seccomp: bool = False
    no_new_privs: bool = False
    uid: int = -1
    network_namespace: bool = False
    errors: tuple[str, ...] = ()

    @property
    def contained(self) -> bool:
        """At least one of the two layers that hold with a shared uid."""
        return self.landlock_abi > 0 or self.seccomp

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: object) -> Confinement:
        if not isinstance(row, dict):
            return cls()
        return cls(
            landlock_abi=int(row.get("landlock_abi", 0)),
            seccomp=row.get("seccomp") is True,
            no_new_privs=row.get("no_new_privs") is True,
            uid=int(row.get("uid", -1)),
            network_namespace=row.get("network_namespace") is True,
            errors=tuple(str(e)[:200] for e in row.get("errors", ()))[:8],
        )

    def describe(self) -> str:
        layers = [f"Landlock ABI {self.landlock_abi}"] if self.landlock_abi else []
        layers += ["seccomp"] if self.seccomp else []
        layers += ["a network namespace"] if self.network_namespace else []
        layers += [f"uid {self.uid}"] if self.uid != os.getuid() else ["the services' uid"]
        return ", ".join(layers)


def confine(
    *,
    private_dir: str,
    import_path: Iterable[str],
    allow_processes: bool,
    network_namespace: bool,
    own_uid: bool,
    layers: Iterable[str] = LAYERS,
) -> Confinement:
    """Apply every layer of `layers` the kernel offers to this process (see the module
    docstring); never raises: what failed is in `Confinement.errors`, and the pool decides
    whether to go on."""
    layers = set(layers)
    errors = []
    nnp = False
    try:
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        nnp = True
    except OSError as exc:
        errors.append(str(exc))
    if own_uid:  # the count is this uid's: with the services' uid it would count their threads
        import resource

        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    # seccomp first: finding libseccomp runs `ldconfig`, which Landlock would not let run.
    seccomp = False
    try:
        if "seccomp" in layers:
            _seccomp(allow_processes=allow_processes)
            seccomp = True
    except (ImportError, OSError, RuntimeError) as exc:  # no libseccomp, or the kernel refused
        errors.append(f"seccomp: {type(exc).__name__}: {exc}")
    abi = landlock_abi() if "landlock" in layers else 0
    if abi:
        try:
            _landlock(readable_paths(import_path), [private_dir, "/dev/null"], abi)
        except OSError as exc:
            errors.append(str(exc))
            abi = 0
    return Confinement(abi, seccomp, nnp, os.getuid(), network_namespace, tuple(errors))
