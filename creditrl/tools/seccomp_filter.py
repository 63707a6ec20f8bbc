"""The system calls the ``python`` tool's sandbox may make: a default-deny seccomp filter.

Built in the caller with libseccomp (through ``pyseccomp``, a ctypes binding with the API of
libseccomp's own Python bindings) and exported as a BPF program that bubblewrap loads with
``--seccomp FD`` right before it executes the interpreter, after setting no_new_privs. So
nothing has to be importable inside the sandbox, the filter binds the interpreter and every
process it starts, and no code there can remove it (the kernel never drops a seccomp filter).
libseccomp rather than hand-written BPF: it resolves syscall names per architecture, checks
the architecture and the x32 ABI, and compiles argument checks correctly.

- ``ALLOWED``: what the interpreter and its standard library use (files, sockets, threads,
  processes, time, memory), taken from Docker's default profile less what a sandbox has no use
  for. ``clone`` is allowed only without namespace flags; ``socket`` only for the unix, inet,
  inet6 and netlink families (others fail with EAFNOSUPPORT); ``keyctl`` only to join a fresh
  anonymous session keyring (the bootstrap's first act).
- ``REFUSED``: families that fail with EPERM: keyrings, tracing other processes, bpf, perf,
  userfaultfd, io_uring, kexec, mounts, namespaces, kernel modules, swap, reboot, accounting,
  quotas, the kernel log, personality, clocks, watches (inotify, fanotify, epoll) and POSIX
  message queues, and other privileged or obsolete calls. The kernel counts watches and
  message-queue bytes per uid across user namespaces, so a sandbox could use up those of the
  host uid that owns it (every other process of that uid then fails); the other such per-uid
  counts are bounded by the sandbox's resource limits (``creditrl.tools.python_sandbox``).
- Anything else fails with ENOSYS, as for a system call this kernel lacks: glibc then falls
  back to an older call (``clone3`` to ``clone``, ``fchmodat2`` to ``fchmodat``) instead of
  failing, as runc does for calls newer than its profile.
"""

from __future__ import annotations

import errno
import functools
import tempfile
from types import ModuleType

__all__ = ["ALLOWED", "NO_LIBSECCOMP", "REFUSED", "seccomp_program", "syscall_number"]

NO_LIBSECCOMP = (
    "python tool: cannot build the sandbox's system-call filter ({reason}); install libseccomp "
    "(`apt-get install libseccomp2`) and pyseccomp (`pip install pyseccomp`), or set "
    "isolation: none in the tool's config (unsafe: model-written code then runs as you)"
)
KEYCTL_JOIN_SESSION_KEYRING = 1
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
_CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

ALLOWED = (
    # files and descriptors
    *("read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev"),
    *("preadv2", "pwritev2", "lseek", "open", "openat", "openat2", "creat", "close"),
    *("close_range", "dup", "dup2", "dup3", "fcntl", "ioctl", "pipe", "pipe2", "flock"),
    *("fsync", "fdatasync", "sync", "syncfs", "sync_file_range", "fadvise64", "readahead"),
    *("fallocate", "sendfile", "copy_file_range", "splice", "tee", "vmsplice"),
    *("stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access"),
    *("faccessat", "faccessat2", "readlink", "readlinkat", "getdents", "getdents64"),
    *("getcwd", "chdir", "fchdir", "umask", "truncate", "ftruncate", "mkdir", "mkdirat"),
    *("rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat"),
    *("symlink", "symlinkat", "mknod", "mknodat", "chmod", "fchmod", "fchmodat", "fchmodat2"),
    *("chown", "fchown", "fchownat", "lchown", "utime", "utimes", "utimensat", "futimesat"),
    *("getxattr", "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr"),
    *("setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr"),
    # waiting and events
    *("poll", "ppoll", "select", "pselect6", "eventfd", "eventfd2", "signalfd", "signalfd4"),
    *("timerfd_create", "timerfd_settime", "timerfd_gettime", "memfd_create"),
    # sockets (socket itself is checked by family)
    *("socketpair", "bind", "listen", "accept", "accept4", "connect", "getsockname"),
    *("getpeername", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg"),
    *("shutdown", "setsockopt", "getsockopt"),
    # memory
    *("mmap", "munmap", "mprotect", "mremap", "madvise", "brk", "msync", "mincore", "mlock"),
    *("mlock2", "munlock", "mlockall", "munlockall", "membarrier"),
    *("pkey_alloc", "pkey_free", "pkey_mprotect"),
    # processes, threads and signals (clone is checked by flags)
    *("fork", "vfork", "execve", "execveat", "exit", "exit_group", "wait4", "waitid"),
    *("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open"),
    *("pidfd_send_signal", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending"),
    *("rt_sigsuspend", "rt_sigtimedwait", "sigaltstack", "restart_syscall", "pause"),
    *("futex", "futex_waitv", "set_robust_list", "get_robust_list", "rseq"),
    *("set_tid_address", "arch_prctl", "prctl", "setsid", "setpgid", "getpgid", "getsid"),
    *("getpgrp", "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid"),
    *("getresuid", "getresgid", "getgroups", "setuid", "setgid", "setreuid", "setregid"),
    *("setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capget", "capset"),
    *("getrlimit", "setrlimit", "prlimit64", "getrusage", "getpriority", "setpriority"),
    *("sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam"),
    *("sched_setparam", "sched_getscheduler", "sched_setscheduler", "sched_getattr"),
    *("sched_setattr", "sched_get_priority_max", "sched_get_priority_min"),
    *("sched_rr_get_interval", "ioprio_get", "ioprio_set"),
    # time and system information
    *("clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday"),
    *("time", "times", "alarm", "getitimer", "setitimer", "timer_create", "timer_settime"),
    *("timer_gettime", "timer_getoverrun", "timer_delete", "sysinfo", "uname", "getrandom"),
    "getcpu",
    # System V IPC (the sandbox has its own IPC namespace, and these limits are per namespace)
    *("msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl"),
    *("shmget", "shmat", "shmdt", "shmctl"),
)

REFUSED = {
    "keyrings": ("keyctl", "add_key", "request_key"),
    "tracing": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "bpf": ("bpf",),
    "perf": ("perf_event_open",),
    "userfaultfd": ("userfaultfd",),
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "kexec": ("kexec_load", "kexec_file_load"),
    "mount": (
        *("mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig"),
        *("fspick", "move_mount", "open_tree", "mount_setattr"),
    ),
    "namespaces": ("unshare", "setns"),
    "modules": ("init_module", "finit_module", "delete_module"),
    "swap": ("swapon", "swapoff"),
    "reboot": ("reboot",),
    "accounting": ("acct",),
    "quotas": ("quotactl", "quotactl_fd"),
    "kernel log": ("syslog",),
    "personality": ("personality",),
    "clocks": ("settimeofday", "clock_settime", "clock_adjtime", "adjtimex"),
    # counted per host uid (the sandbox's processes are that uid to the kernel): a sandbox
    # holding max_user_instances of them left every other process of the uid with EMFILE.
    # Without epoll, Python's selectors (asyncio) fall back to poll.
    "watches": (
        *("inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch"),
        *("fanotify_init", "fanotify_mark", "epoll_create", "epoll_create1", "epoll_ctl"),
        *("epoll_wait", "epoll_pwait", "epoll_pwait2"),
    ),
    # their bytes count against the host uid's RLIMIT_MSGQUEUE (also set to 0 inside)
    "message queues": (
        *("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify"),
        "mq_getsetattr",
    ),
    "other": (
        *("lookup_dcookie", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm"),
        *("modify_ldt", "sethostname", "setdomainname", "vhangup", "mbind", "set_mempolicy"),
        *("get_mempolicy", "migrate_pages", "move_pages", "uselib", "ustat", "sysfs"),
        *("_sysctl", "nfsservctl", "create_module"),
    ),
}


def _pyseccomp() -> ModuleType:
    """The ``pyseccomp`` module; ValueError (one line) when it or libseccomp is missing."""
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as e:  # RuntimeError: no libseccomp
        raise ValueError(NO_LIBSECCOMP.format(reason=e)) from None
    return pyseccomp


def syscall_number(name: str) -> int:
    """This machine's number of the system call ``name`` (negative where it has none)."""
    seccomp = _pyseccomp()
    return seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)


@functools.cache
def seccomp_program() -> bytes:
    """The filter as the BPF program bubblewrap's ``--seccomp`` reads; ValueError (one line)
    when libseccomp or pyseccomp is missing."""
    seccomp = _pyseccomp()
    eperm, arg, eq = seccomp.ERRNO(errno.EPERM), seccomp.Arg, seccomp.EQ
    rules = seccomp.SyscallFilter(seccomp.ERRNO(errno.ENOSYS))
    rules.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.ERRNO(errno.ENOSYS))

    def add(action: int, name: str, *args: object) -> None:
        if syscall_number(name) >= 0:  # names this architecture lacks are refused anyway
            rules.add_rule(action, name, *args)

    for name in ALLOWED:
        add(seccomp.ALLOW, name)
    for names in REFUSED.values():
        for name in names:
            if name != "keyctl":
                add(eperm, name)
    join = (arg(0, eq, KEYCTL_JOIN_SESSION_KEYRING), arg(1, eq, 0))  # a NULL name: anonymous
    add(seccomp.ALLOW, "keyctl", *join)
    add(eperm, "keyctl", arg(0, seccomp.NE, KEYCTL_JOIN_SESSION_KEYRING))
    add(eperm, "keyctl", arg(1, seccomp.NE, 0))
    namespaces = sum(_CLONE_NAMESPACE_FLAGS.values())
    add(seccomp.ALLOW, "clone", arg(0, seccomp.MASKED_EQ, namespaces, 0))
    for flag in _CLONE_NAMESPACE_FLAGS.values():
        add(eperm, "clone", arg(0, seccomp.MASKED_EQ, flag, flag))
    no_family = seccomp.ERRNO(errno.EAFNOSUPPORT)
    top = max(ALLOWED_SOCKET_FAMILIES)
    for family in range(top + 1):
        allowed = family in ALLOWED_SOCKET_FAMILIES
        add(seccomp.ALLOW if allowed else no_family, "socket", arg(0, eq, family))
    add(no_family, "socket", arg(0, seccomp.GT, top))
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()
