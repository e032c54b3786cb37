"""Presets resolve by name from any directory: they ship inside the package (jpaged/presets)."""
import json
import os
import subprocess
import sys

import pytest

from jpaged.loading import presets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_names_resolve_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = presets.resolve("smollm2-135m-instruct", {})
    assert want[0] is None and want[1]["max_num_seqs"] == 64  # the embedded model, the preset's settings
    for spelling in ("presets/smollm2-135m-instruct", "smollm2-135m-instruct.json"):
        assert presets.resolve(spelling, {}) == want
    assert presets.resolve("smollm2-135m-instruct", {"max_num_seqs": 8})[1]["max_num_seqs"] == 8  # flags win
    assert "smollm2-135m-instruct" in presets.list_presets()
    with pytest.raises(ValueError, match="model='nope': not a directory, a .gguf file, or a preset"):
        presets.resolve("nope", {})


def test_a_preset_file_of_ones_own(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"model": "some/dir", "block_size": 8}))
    assert presets.resolve(str(path), {}) == ("some/dir", {"block_size": 8})
    path.write_text("{oops")
    with pytest.raises(ValueError, match="mine.json: not valid JSON"):
        presets.resolve(str(path), {})


@pytest.mark.slow
def test_non_editable_install_ships_the_presets(tmp_path):
    """``pip install .`` (not editable) into a folder, then resolve the preset from elsewhere. The
    install runs from a copy, so the build leaves nothing in the checkout."""
    import shutil

    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                                  ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, timeout=600, capture_output=True)
    assert (target / "jpaged" / "presets" / "smollm2-135m-instruct.json").is_file()
    code = ("import jpaged, jpaged.loading.presets as p; assert jpaged.__file__.startswith(%r), jpaged.__file__; "
            "print(p.resolve('smollm2-135m-instruct', {})[1]['max_model_len'])" % str(target))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    assert result.returncode == 0 and result.stdout.strip() == "2048", result.stderr[-2000:]
