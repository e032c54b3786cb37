"""The README's set-up as a newcomer meets it: the compiler venvs see the packages of whichever
interpreter set them up (a venv, a conda env, the base interpreter), and `.ci/run` runs the
README's two commands exactly, inside a fresh venv."""
import os
import re
import subprocess
import sys

from pallas_kernels.aot import venv

from run_script import REPO_ROOT


def readme_commands() -> list[str]:
    """The README's bash blocks before its first section: the main job, then the tests."""
    readme = open(os.path.join(REPO_ROOT, "README.md")).read()
    top = readme.split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", top, re.S)]


def test_ci_runs_the_readme_commands_in_a_fresh_venv():
    commands = readme_commands()
    assert len(commands) == 2, commands
    ci = open(os.path.join(REPO_ROOT, ".ci", "run")).read()
    for command in commands:
        assert command in ci, f".ci/run does not run the README's command: {command}"
    venv_at = ci.index("-m venv")
    assert venv_at < ci.index(commands[0]) and venv_at < ci.index(commands[1])
    assert re.search(r'rm -rf "\$venv"', ci), ".ci/run must start from a fresh venv"


def test_a_linked_venv_imports_this_environments_packages(tmp_path):
    # The compiler venvs are made by this interpreter; from inside a venv, `--system-site-packages`
    # would give them the base interpreter's packages instead (no jax, no absl: issue #34).
    target = tmp_path / "compiler-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    bare = subprocess.run([str(target / "bin" / "python"), "-c", "import absl"], capture_output=True)
    assert bare.returncode != 0  # a fresh venv sees nothing of ours
    pth = venv.link_main_environment(str(target))
    assert os.path.basename(pth) == "jpaged-main-environment.pth"
    check = "import jax, absl, numpy; print(jax.__file__)"
    linked = subprocess.run([str(target / "bin" / "python"), "-c", check], capture_output=True, text=True,
                            cwd=str(tmp_path))
    assert linked.returncode == 0, linked.stderr[-2000:]
    import jax
    assert os.path.realpath(linked.stdout.strip()) == os.path.realpath(jax.__file__)


def test_site_dirs_hold_this_interpreters_jax():
    import jax
    dirs = venv.main_site_dirs()
    assert any(os.path.realpath(jax.__file__).startswith(d + os.sep) for d in dirs), dirs


def test_setup_failure_is_one_line_naming_the_missing_piece(tmp_path):
    # an interpreter without jax (a bare venv) is refused before anything is installed
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    env = dict(os.environ, PYTHON=str(bare / "bin" / "python"), JPAGED_AOT_DIR=str(tmp_path / "aot"))
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "setup_aot_compilers.sh")],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import jax" in lines[0], result.stderr
    assert not (tmp_path / "aot").exists()
