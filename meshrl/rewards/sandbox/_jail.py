"""Launcher that puts one program into its jail; run by :mod:`meshrl.rewards.sandbox.limits` as
``python -I -S _jail.py '<json settings>'`` (a file, not a module: it must not import meshrl, so that a
run costs one bare interpreter start-up, and it needs no ``preexec_fn``, which is unsafe in the
threaded server).

Contract: argv[1] is JSON with ``workdir``, ``argv`` (the program's command line), ``env``, ``cpu_s``,
``memory_bytes``, ``nproc``, ``fsize_bytes``, ``uid``, ``gid`` (``null`` when not running as root),
``report_fd``.
``report_fd`` is the report pipe: the launcher writes ``pid <n>`` (the program's pid as the caller sees it)
of the namespace's pid 1 (as the caller sees it) once forked; pid 1 writes ``status <wait status> <CPU
seconds>`` when the program has exited; either writes ``error <text>`` when the jail could not be built
(then the program never runs). The program inherits fds 0-2 only.

Order matters: namespaces are created while still privileged (root needs no user namespace for
them), the rlimits are set before dropping to the slot's uid (only root may set hard limits it does
not hold), and Landlock last (it needs ``no_new_privs``, which an unprivileged process may set).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

# Landlock (linux/landlock.h); the syscall numbers are the generic ones, shared by x86_64 and arm64.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_WRITE_FILE = 1 << 1
# Every right that changes the file system: remove dir/file, make char/dir/reg/sock/fifo/block/sym.
FS_MODIFY_TREE = sum(1 << bit for bit in (4, 5, 6, 7, 8, 9, 10, 11, 12))
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def landlock_abi():
    """Landlock ABI version of the running kernel, 0 when Landlock is absent or disabled."""
    ret = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(ret, 0)


def _landlock_writes_only_under(workdir, abi):
    """Deny every file-system change outside ``workdir`` (and writes to /dev/null's siblings) and, from
    ABI 4, every TCP bind/connect; reading stays allowed so that the interpreter and its libraries load."""
    fs = FS_WRITE_FILE | FS_MODIFY_TREE | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0)
    size = ctypes.sizeof(attr) if abi >= 4 else 8
    ruleset = _check(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    for path, rights in ((workdir, fs), ("/dev/null", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneathAttr(rights, fd)
        _check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule),
                            ctypes.c_uint32(0)), f"landlock_add_rule {path}")
        os.close(fd)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def _init(cfg, report):
    """Pid 1 of the new pid namespace: limits, uid and Landlock (inherited by everything below it), then
    fork the program and reap until it exits; its own exit then takes the whole namespace along.

    Why a separate pid 1 rather than the program itself: the kernel ignores signals sent to a
    namespace's init from inside it (``os.kill(os.getpid(), SIGTERM)`` would do nothing), and an init
    must reap orphans, which a user's program does not do."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(pdeathsig)")
    os.chdir(cfg["workdir"])
    cpu = cfg["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    abi = landlock_abi()
    if abi:
        _landlock_writes_only_under(cfg["workdir"], abi)
    program = os.fork()
    if program == 0:
        # Its own session: kill(0, ...) from the program reaches only its own process group.
        os.setsid()
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])  # closes ``report`` (not inheritable)
    os.close(0), os.close(1), os.close(2)  # EOF on the caller's pipes once the program's tree is done
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            os.write(report, f"status {status} {usage.ru_utime + usage.ru_stime}\n".encode())
            return


def main():
    cfg = json.loads(sys.argv[1])
    report = cfg["report_fd"]
    os.set_inheritable(report, False)
    try:
        flags = CLONE_NEWNET | CLONE_NEWPID | (0 if os.geteuid() == 0 else CLONE_NEWUSER)
        _check(libc.unshare(flags), "unshare(net, pid)")
        pid = os.fork()
    except OSError as exc:
        os.write(report, f"error {exc}\n".encode())
        return 1
    if pid == 0:
        try:
            _init(cfg, report)
        except BaseException as exc:  # the program never ran: the caller reports a sandbox error
            os.write(report, f"error could not start the program: {exc}\n".encode())
        os._exit(0)
    os.close(0), os.close(1), os.close(2)
    os.write(report, f"pid {pid}\n".encode())
    os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
