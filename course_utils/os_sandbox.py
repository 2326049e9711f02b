"""The batch grader's operating-system sandbox: each hand-in runs in its own Linux namespaces (stdlib only).

:mod:`course_utils.grade` starts every learner's notebook kernel through
:func:`command`, which wraps the kernel's command line in
``unshare --user --map-root-user --mount --pid --net --fork --kill-child``
and this file run as a script. Before the kernel starts, the script (process 1
of the new pid namespace) builds a new root filesystem and pivots into it:

- the system's folders (``/usr``, ``/etc``, ``/lib``...), Python's own folders
  and ``sys.path`` (the course's ``course_utils`` only, never the repository
  around it), read-only;
- the hand-in's working copy and the grader's result folder, writable: the only
  places a write can land;
- a private ``/tmp`` and ``/dev/shm`` (memory, sized), a fresh ``/proc`` that shows
  the hand-in's own processes only, ``/sys`` read-only, and of ``/dev`` only
  ``null``, ``zero``, ``full``, ``random``, ``urandom``, ``tty`` and the NVIDIA
  devices;
- nothing else: ``solutions/``, the other hand-ins, the gradebook, the home
  folder and the rest of the repository do not exist in there; the network
  namespace has only its own loopback (up, for ``torch.distributed``'s gloo).

The kernel itself then runs in a nested user namespace as an ordinary user
(uid 1000, no capabilities), so the read-only mounts are locked (the kernel
cannot remount them) and it cannot undo any of the above. Limits: processes
(``RLIMIT_NPROC``), file size (``RLIMIT_FSIZE``), CPU time (``RLIMIT_CPU``), no
core files. When the kernel exits or is killed, process 1 exits and the kernel
kills every process left in the namespace (a forked child cannot outlive the
hand-in).

:func:`unavailable` says why this cannot work on a machine (not Linux, no
``unshare``, user namespaces switched off); the grader then says so at start and
in ``summary.md`` and falls back to the in-process write guard of
:mod:`course_utils.guard` alone.
"""

# NOTE: stdlib only: this file also runs as a script, before anything else, in the new namespaces.
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["command", "unavailable", "UNSHARE"]

UNSHARE = ("unshare", "--user", "--map-root-user", "--mount", "--pid", "--net", "--fork", "--kill-child")
SANDBOX_UID = 1000  # the kernel's user inside (an ordinary user: no capabilities after exec)
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_PROBE = {}

# mount(2) flags
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MNT_DETACH = 2
CLONE_NEWUSER = 0x10000000
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


# -- on the grader's side --------------------------------------------------------------
def command(cmd, *, writable, read_only=(), hidden=(), work_dir, limits=None):
    """``cmd`` (a list) wrapped to run in the sandbox; ``work_dir`` receives the sandbox's plan and its new root.

    ``writable``: folders the sandboxed program may write (they keep their paths);
    ``read_only``: more folders it may read (besides the system's, Python's and
    ``sys.path``'s); ``hidden``: paths that must not exist in there even where they
    lie inside a folder it may read (they are covered with an empty one);
    ``limits``: ``{"nproc", "fsize_bytes", "cpu_s", "tmp_bytes"}``.
    """
    plan = {
        "new_root": os.path.join(work_dir, "root"),
        "read_only": sorted(set(_python_dirs()) | {os.path.realpath(p) for p in read_only}),
        "writable": sorted({os.path.realpath(p) for p in writable}),
        "hidden": sorted({os.path.realpath(p) for p in hidden}),
        "limits": dict(limits or {}),
    }
    os.makedirs(plan["new_root"], exist_ok=True)
    path = os.path.join(work_dir, "sandbox.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return list(UNSHARE) + [sys.executable, os.path.abspath(__file__), path, "--"] + list(cmd)


def _python_dirs():
    """Python's folders and ``sys.path``'s, as the sandbox must show them (the course's repository: its package only)."""
    course_root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    prefixes = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), os.path.realpath(sys.exec_prefix)}
    package = os.path.join(course_root, "course_utils")
    dirs = prefixes | {os.path.dirname(os.path.realpath(sys.executable)), package}

    def within(path, folder):
        return path == folder or path.startswith(folder + os.sep)

    for entry in sys.path + os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry in ("", ".") or not os.path.isabs(entry):
            continue  # the current folder (where the instructor ran the grader) is not Python's
        real = os.path.realpath(entry)
        if within(real, course_root) and not (within(real, package) or any(within(real, p) for p in prefixes)):
            continue  # the repository holds solutions/ and tests/: only its package (and a venv in it) is shown
        if os.path.isdir(real) or os.path.isfile(real):
            dirs.add(real)
    return sorted(dirs)


def unavailable():
    """None if hand-ins can run in the sandbox here, else one sentence saying why not (probed once)."""
    if "answer" not in _PROBE:
        _PROBE["answer"] = _probe()
    return _PROBE["answer"]


def _probe():
    if not sys.platform.startswith("linux"):
        return f"the operating system is {sys.platform}, and the sandbox needs Linux namespaces"
    if shutil.which("unshare") is None:
        return "the `unshare` program (util-linux) is not installed"
    with tempfile.TemporaryDirectory(prefix="course-sandbox-probe-") as tmp:
        writable = os.path.join(tmp, "w")
        os.makedirs(writable)
        code = ("import os; open(os.path.join(%r, 'ok'), 'w').write(str(os.getuid()));"
                "print(sorted(os.listdir('/proc'))[:1])" % writable)
        argv = command([sys.executable, "-c", code], writable=[writable], work_dir=tmp)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"starting a sandboxed process failed ({type(exc).__name__}: {exc})"
        marker = os.path.join(writable, "ok")
        if proc.returncode != 0 or not os.path.exists(marker):
            tail = (proc.stderr or proc.stdout or "no message").strip().splitlines()[-1:] or ["no message"]
            return f"this machine refuses the namespaces the sandbox needs ({tail[0][:200]})"
    return None


# -- inside the new namespaces (this file run as a script) --------------------------------
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(libc, source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target}")


def _kept_flags(path):
    """The flags of the mount at ``path`` that a remount inside a user namespace must keep (locked ones)."""
    st = os.statvfs(path).f_flag
    flags = 0
    for st_flag, ms_flag in ((2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME),
                             (2048, MS_NODIRATIME), (4096, MS_RELATIME)):
        if st & st_flag:
            flags |= ms_flag
    return flags


def _make_target(path, is_dir):
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if is_dir:
        os.makedirs(path)
    else:
        open(path, "w").close()


def _bind(libc, source, target, read_only):
    is_dir = os.path.isdir(source)
    _make_target(target, is_dir)
    _mount(libc, source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _kept_flags(target))


def _read_only_below(libc, root):
    """Remount read-only every mount below ``root`` (a recursive bind keeps its sub-mounts' flags)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted(p for p in points if p.startswith(root + "/")):
        try:
            _mount(libc, None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _kept_flags(point))
        except OSError:
            pass  # a mount point that vanished or refuses: best effort below /sys


def _loopback_up():
    import fcntl
    import socket
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifreq = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(s.fileno(), 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sh14x", b"lo", flags | 1))  # SIOCSIFFLAGS |= IFF_UP
    finally:
        s.close()


def build_root(plan):
    """Mount the sandbox's filesystem at ``plan["new_root"]`` and pivot into it (as root of the new namespaces)."""
    libc = _libc()
    root = plan["new_root"]
    limits = plan.get("limits", {})
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    for name in SYSTEM_DIRS:
        source = "/" + name
        if os.path.islink(source):
            os.symlink(os.readlink(source), root + source)
        elif os.path.isdir(source):
            _bind(libc, source, root + source, read_only=True)
    # Memory-backed, private: /tmp, /dev/shm.
    tmp_size = int(limits.get("tmp_bytes", 2**30))
    os.makedirs(root + "/tmp")
    _mount(libc, "tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_size},mode=1777")
    os.makedirs(root + "/dev/shm")
    _mount(libc, "tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_size // 2},mode=1777")
    for name in DEVICES + tuple(sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))):
        if os.path.exists("/dev/" + name):
            _bind(libc, "/dev/" + name, root + "/dev/" + name, read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if os.path.isdir("/sys"):
        _bind(libc, "/sys", root + "/sys", read_only=True)
        _read_only_below(libc, root + "/sys")
    # Python, sys.path, the course's package (read-only); the hand-in's folders (writable).
    mounts = [(p, True) for p in plan["read_only"]] + [(p, False) for p in plan["writable"]]
    for path, read_only in sorted(mounts, key=lambda m: (m[0].count("/"), m[0])):
        if os.path.exists(path):
            _bind(libc, path, root + path, read_only)
    for path in plan.get("hidden", ()):  # inside a folder shown read-only: cover it with an empty one
        if os.path.isdir(root + path):
            _mount(libc, "tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=755")
        elif os.path.lexists(root + path):
            _mount(libc, "/dev/null", root + path, None, MS_BIND)
    os.makedirs(root + "/.old-root")
    # The new root itself (a tmpfs holding the mount points): read-only too.
    _mount(libc, None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    machine = os.uname().machine
    _check(libc.syscall(SYS_PIVOT_ROOT.get(machine, 155), root.encode(), (root + "/.old-root").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old-root", MNT_DETACH), "umount the old root")  # an empty folder stays (read-only)
    _loopback_up()


def _as_ordinary_user():
    """Enter a nested user namespace as uid/gid 1000: after exec, no capabilities, and the mounts are locked."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(f"{SANDBOX_UID} 0 1\n")


def _set_limits(limits):
    import resource

    def cap(which, value):
        value = int(value)
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value if hard == resource.RLIM_INFINITY else hard))

    cap(resource.RLIMIT_CORE, 0)
    if limits.get("nproc"):
        cap(resource.RLIMIT_NPROC, limits["nproc"])
    if limits.get("fsize_bytes"):
        cap(resource.RLIMIT_FSIZE, limits["fsize_bytes"])
    if limits.get("cpu_s"):
        cap(resource.RLIMIT_CPU, limits["cpu_s"])


def main(argv):
    plan_path, cmd = argv[0], argv[2:]
    with open(plan_path) as f:
        plan = json.load(f)
    try:
        build_root(plan)
    except OSError as exc:
        print(f"course sandbox: {exc}", file=sys.stderr)
        return 125
    import signal

    nproc = plan.get("limits", {}).get("nproc")
    pid = os.fork()
    if pid == 0:  # the sandboxed program, as an ordinary user
        try:
            _as_ordinary_user()
            _set_limits(dict(plan.get("limits", {}), nproc=nproc))
            os.environ.setdefault("USER", "learner")
            os.environ.setdefault("LOGNAME", "learner")
            # A host pid means nothing in here (Jupyter's kernel would watch it and quit at once).
            os.environ.pop("JPY_PARENT_PID", None)
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            print(f"course sandbox: could not start {cmd[0]}: {exc}", file=sys.stderr)
        os._exit(126)
    # Process 1: reap every orphan until the program exits; then the namespace (and all left in it) goes.
    # An interrupt for the program's process group (Jupyter's interrupt) reaches the program itself.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if done == pid:
            return os.waitstatus_to_exitcode(status) if status else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
