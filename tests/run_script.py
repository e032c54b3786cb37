"""Runs a script of scripts/ in a subprocess against this checkout's jpaged (not an installed one)."""
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO_ROOT, "scripts")


def run_python(*args: str, timeout: float = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python *args`` (a script's path, or ``-c`` and code) with this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or REPO_ROOT)


def run_script(name: str, *args: str, timeout: float = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
    return run_python(os.path.join(SCRIPTS, name), *args, timeout=timeout, cwd=cwd)
