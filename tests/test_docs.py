"""The file tree in docs/architecture.md ("## Layout") is the code's: every package folder has its
entry, every module is named in its folder's entry (or a subfolder of it is), and every ``name.py``
an entry names exists in that folder."""
import os
import re

from run_script import REPO_ROOT

PACKAGES = ("jpaged", "pallas_kernels")


def layout_entries() -> dict[str, str]:
    """Folder path (``jpaged/``, ``jpaged/core/``, ``pallas_kernels/``, ...) -> its entry's text."""
    text = open(os.path.join(REPO_ROOT, "docs", "architecture.md")).read()
    block = text.split("## Layout\n\n```\n", 1)[1].split("\n```", 1)[0]
    entries, top, current = {}, None, None
    for line in block.splitlines():
        head = re.match(r"^( ?( {2})?)(\S+/)\s", line + " ")
        if head and not line.startswith(" " * 4):
            name = head.group(3)
            if line.startswith("  "):
                current = top + name
            else:
                top = current = name
            entries[current] = line[len(head.group(0)) - 1:]
        else:
            entries[current] += " " + line.strip()
    return entries


def python_files(folder: str, recursive: bool) -> list[str]:
    """Paths relative to ``folder`` of its .py modules (``__init__.py`` left out)."""
    root = os.path.join(REPO_ROOT, folder)
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [os.path.relpath(os.path.join(here, f), root) for f in files
                  if f.endswith(".py") and f != "__init__.py"]
        if not recursive:
            break
    return sorted(found)


def test_every_package_folder_has_an_entry():
    entries = layout_entries()
    for package in PACKAGES:
        assert f"{package}/" in entries
    for name in sorted(os.listdir(os.path.join(REPO_ROOT, "jpaged"))):
        if os.path.isdir(os.path.join(REPO_ROOT, "jpaged", name)) and name != "__pycache__":
            assert f"jpaged/{name}/" in entries, f"docs/architecture.md's Layout has no entry for jpaged/{name}/"


def test_every_module_is_named_in_its_folders_entry():
    entries = layout_entries()
    for folder, text in entries.items():
        if not folder.startswith(PACKAGES) or not os.path.isdir(os.path.join(REPO_ROOT, folder)):
            continue
        # a top-level package's entry covers its own modules; a subpackage's (and pallas_kernels', whose
        # folders are inside its entry) everything below it
        recursive = folder != "jpaged/"
        for path in python_files(folder, recursive):
            parts = path.split(os.sep)
            named = parts[-1] in text or any(f"{d}/" in text for d in parts[:-1])
            assert named, f"{folder}{path} is not in docs/architecture.md's Layout entry for {folder}"


def test_every_module_an_entry_names_exists():
    entries = layout_entries()
    for folder, text in entries.items():
        if not folder.startswith(PACKAGES):
            continue
        recursive = folder != "jpaged/"
        names = {os.path.basename(p) for p in python_files(folder, recursive)}
        for name in re.findall(r"\b(\w+\.py)\b", text):
            assert name in names, f"docs/architecture.md's Layout names {name} under {folder}: no such module"
