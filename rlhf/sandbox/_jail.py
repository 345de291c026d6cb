"""The jail: runs one command isolated.  Executed by the sandbox server as ``python -I -S _jail.py SPEC_JSON``
(standard library only, imports nothing from rlhf; it runs as root and drops to an unprivileged uid).

Process tree (all Linux namespaces made with ``unshare(2)``, no external binary)::

    server -> this script (outer, root; new mount/pid/net/ipc/uts namespaces)
                -> fork: pid 1 of the new pid namespace (root): mounts, then reaps
                       -> fork: the command (uid/gid of the run, rlimits, scrubbed env, cwd = the run's folder)

* network: a new, empty network namespace (only a loopback that is down): every connection fails;
* files: every mount is remounted read-only in a private mount namespace; only the run's folder (a bind mount
  of itself, read-write) and a small private tmpfs on /dev/shm are writable; directories that others cannot
  enter on the way to an exposed path (the Python interpreter under /root/.pyenv) are covered by a read-only
  tmpfs holding just that path, so the rest of them stays hidden;
* processes: a new pid namespace (the command sees only its own processes; /proc is the namespace's); when pid
  1 exits (the command finished) or the outer process is killed (timeout: PR_SET_PDEATHSIG), the kernel kills
  every process left in the namespace, whatever session or process group it made for itself;
* limits: RLIMIT_AS / DATA / STACK (memory), CPU, NPROC (per uid: the server gives each concurrent run its own
  uid), FSIZE, NOFILE, CORE=0, applied after the fork and before dropping to the run's uid.

The status of the command goes to the file descriptor ``status_fd`` as one line: ``exit N``, ``signal N`` or
``error MESSAGE`` (the jail could not be set up: the server answers SandboxError).
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x4000000, 0x8000000, 0x20000000, \
    0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_OPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
_libc = ctypes.CDLL(None, use_errno=True)


class JailError(RuntimeError):
    pass


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(src, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount({src!r}, {target!r}, {fstype!r}, {flags:#x})")


def _mountinfo():
    """[(mount point, per-mount option flags)] of this mount namespace, parents before children."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= _OPT_FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def _remount_ro(point, flags):
    _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def _read_only_everything():
    """Remount every mount of the namespace read-only (what stays writable is bind-mounted afterwards)."""
    for point, flags in _mountinfo():
        try:
            _remount_ro(point, flags)
        except JailError as e:
            if point == "/" or not os.path.exists(point):
                raise
            # a mount hidden under another one (overmounted) cannot be reached by path; it is not visible either
            if not os.path.ismount(point):
                continue
            raise JailError(f"cannot make {point} read-only: {e}") from None


def _expose(path):
    """Make ``path`` reachable by an unprivileged uid: each ancestor that others cannot enter is covered by a
    read-only tmpfs holding only the next component, bind-mounted (read-only) from the original."""
    cur = "/"
    for name in [p for p in path.split("/") if p]:
        child = os.path.join(cur, name)
        if not os.stat(cur).st_mode & 0o001:
            fd = os.open(child, os.O_PATH)
            is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
            _mount("tmpfs", cur, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            if is_dir:
                os.mkdir(child)
            else:
                open(child, "w").close()
            _mount(f"/proc/self/fd/{fd}", child, None, MS_BIND | MS_REC)
            os.close(fd)
            _remount_ro(child, 0)
            _remount_ro(cur, MS_NOSUID | MS_NODEV)
        cur = child


def _set_limits(limits):
    for name, value in limits.items():
        if value is None:
            continue
        res = getattr(resource, "RLIMIT_" + name.upper())
        soft, hard = (value, value) if not isinstance(value, list) else value
        resource.setrlimit(res, (soft, hard))


def _setup(spec):
    """Mounts of the namespace (run as pid 1, root)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _read_only_everything()
    for path in spec.get("expose", []):
        _expose(path)
    workdir = spec["cwd"]
    _mount(workdir, workdir, None, MS_BIND)
    _mount(None, workdir, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=64m")
    try:
        _libc.sethostname(b"sandbox", 7)
    except OSError:
        pass


def _run_command(spec, status_fd):
    """In the forked child: limits, drop privileges, exec.  Never returns."""
    try:
        os.close(status_fd)
        _set_limits(spec["limits"])
        if spec.get("uid") is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        os.chdir(spec["cwd"])
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - reported on stderr like a shell's "command not found"
        try:
            os.write(2, f"sandbox: cannot run {spec['argv'][0]}: {e}\n".encode())
        finally:
            os._exit(127)


def _pid1(spec, status_fd, outer_pid):
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # without a pid namespace: orphans still come to us
    if os.getppid() not in (outer_pid, 0):  # 0: the parent is outside our pid namespace
        os._exit(1)
    try:
        _setup(spec) if spec.get("namespaces", True) else None
    except Exception as e:  # noqa: BLE001
        os.write(status_fd, f"error jail setup failed: {e}\n".encode())
        os._exit(1)
    child = os.fork()
    if child == 0:
        _run_command(spec, status_fd)
    # the reaper: orphans of the command are re-parented to us
    for fd in (0, 1, 2):
        os.close(fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == child:
            break
    for _ in range(100 if not spec.get("namespaces", True) else 0):  # no pid namespace to end with us:
        left = _children()                                            # kill what the command left, reap
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    line = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    os.write(status_fd, (line + "\n").encode())
    os._exit(0)  # the kernel now kills whatever the command left behind in the namespace


def _children():
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def main():
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)
    if spec.get("namespaces", True):
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        if _libc.unshare(flags) != 0:
            err = ctypes.get_errno()
            os.write(status_fd, f"error unshare(mount, pid, net, ipc, uts) failed: {os.strerror(err)}\n".encode())
            return 1
    outer = os.getpid()
    pid = os.fork()
    if pid == 0:
        _pid1(spec, status_fd, outer)
    os.close(status_fd)
    for fd in (0, 1, 2):
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":
    sys.exit(main())
