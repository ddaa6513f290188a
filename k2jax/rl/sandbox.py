"""Run untrusted Python (the code environment's answers) in a separate, limited process.

    result = run("print(input()[::-1])", stdin="abc", timeout_s=2, memory_mb=256)
    result.ok, result.stdout, result.reason          # True, "cba\\n", "ok"

What is enforced, in the child before it executes the code:
  * its own session / process group, killed as a whole at the wall-clock timeout;
  * limits: address space (memory_mb), CPU seconds, file size, open files, processes;
  * no network: a new network namespace (only a down loopback), when the kernel allows it
    (as root always; otherwise through an unprivileged user namespace if enabled) -
    `result.network_isolated` says whether it was;
  * an unprivileged identity: as root the child switches to a dedicated uid/gid (SANDBOX_UID)
    with no supplementary groups, so the process limit binds (it does not for root) and
    nothing root-owned is writable; a non-root caller keeps its uid and the process limit
    counts from its current number of processes;
  * a fresh temporary working directory (owned by the sandbox uid), removed afterwards, and
    an isolated interpreter (`python -I -S`: no site-packages, no user paths, no env hooks).
Afterwards every process of the sandbox uid is killed and files it left in the world-writable
/tmp, /var/tmp and /dev/shm are removed, so the machine is left as it was. Not enforced:
reads of world-readable files, and CPU time spent by other processes. For hostile code at
scale use a container or VM; this is for verifiable-reward training.
Nothing raises: every failure is a result with ok False and a reason.
"""

import dataclasses
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


@dataclasses.dataclass
class SandboxResult:
  ok: bool                 # exited 0 within every limit
  stdout: str
  stderr: str
  reason: str              # ok | timeout | memory | exit code N | signal N | error: ...
  returncode: int | None
  wall_s: float
  network_isolated: bool


# The child's setup runs in a fresh interpreter that then execs the untrusted program: running
# Python between fork and exec (subprocess's preexec_fn) can deadlock a multithreaded parent,
# and the trainer that calls us runs JAX's threads.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
c = json.loads(sys.argv[1])
if not c["as_root"]:
    # before unshare: a new user namespace records the process limit in force when it is
    # created, and counts its processes against it (set later, the limit would not bind)
    procs, uid = c["max_procs"], os.getuid()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                procs += os.stat("/proc/" + pid).st_uid == uid
            except OSError:
                pass
    resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
libc = ctypes.CDLL(None, use_errno=True)
flags = c["newnet"] if c["as_root"] else c["newnet"] | c["newuser"]
isolated = libc.unshare(ctypes.c_int(flags)) == 0
os.write(c["fd"], b"1" if isolated else b"0")
os.close(c["fd"])
mb = 1 << 20
for lim, v in ((resource.RLIMIT_AS, c["memory_mb"] * mb), (resource.RLIMIT_CPU, c["cpu_s"]),
               (resource.RLIMIT_FSIZE, c["file_mb"] * mb), (resource.RLIMIT_NOFILE, 64),
               (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (v, v))
if c["as_root"]:
    os.setgroups([])
    os.setgid(c["gid"])
    os.setuid(c["uid"])
    resource.setrlimit(resource.RLIMIT_NPROC, (c["max_procs"], c["max_procs"]))
os.execv(c["python"], [c["python"], "-I", "-S", "main.py"])
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
  uid cannot reach it (e.g. under a 0700 home), then the system's python3."""
  candidates = [sys.executable, shutil.which("python3") or "", "/usr/bin/python3",
                "/usr/local/bin/python3"]
  for c in candidates:
    if c and (_world_executable(c) if as_root else os.access(c, os.X_OK)):
      return c
  raise RuntimeError("no Python interpreter is executable by the sandbox user")


def _cleanup(uid: int, started: float):
  """Kill what the sandbox uid still runs; remove what it left in world-writable dirs."""
  if uid != SANDBOX_UID:
    return
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
          os.kill(int(pid), signal.SIGKILL)
      except OSError:
        pass
  for d in WORLD_WRITABLE:
    try:
      entries = os.scandir(d)
    except OSError:
      continue
    for e in entries:
      try:
        st = e.stat(follow_symlinks=False)
        if st.st_uid == uid:
          (shutil.rmtree if e.is_dir(follow_symlinks=False) else os.remove)(e.path)
      except OSError:
        pass


def run(code: str, *, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
        max_procs: int = 16, file_mb: int = 16, python: str | None = None) -> SandboxResult:
  """Run `code` as a Python program under the limits above (see the module docstring)."""
  as_root = os.geteuid() == 0
  started = time.time()
  workdir = tempfile.mkdtemp(prefix="k2jax-sandbox-")
  read_fd, write_fd = os.pipe()
  proc = None
  try:
    with open(os.path.join(workdir, "main.py"), "w") as f:
      f.write(code)
    if as_root:
      os.chown(workdir, SANDBOX_UID, SANDBOX_GID)
      os.chown(os.path.join(workdir, "main.py"), SANDBOX_UID, SANDBOX_GID)
    setup = dict(newnet=CLONE_NEWNET, newuser=CLONE_NEWUSER, as_root=as_root, fd=write_fd,
                 memory_mb=memory_mb, cpu_s=int(timeout_s) + 1, file_mb=file_mb,
                 max_procs=max_procs, uid=SANDBOX_UID, gid=SANDBOX_GID,
                 python=python or interpreter(as_root))
    proc = subprocess.Popen([interpreter(as_root), "-I", "-S", "-c", _LAUNCHER, json.dumps(setup)],
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
      if proc.returncode == -signal.SIGXCPU:
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
                         wall_s=time.time() - started, network_isolated=isolated)
  except Exception as e:  # never let the trainer die for a sandboxed answer
    return SandboxResult(False, "", "", f"error: {type(e).__name__}: {e}", None,
                         time.time() - started, False)
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
    _cleanup(SANDBOX_UID if as_root else os.getuid(), started)
    shutil.rmtree(workdir, ignore_errors=True)
