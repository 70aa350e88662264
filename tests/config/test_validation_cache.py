"""The parse-time validation cache: a pass is remembered and skips importing torch, a failure never is, and any
edit of worldpipe's source is a new key. Real processes (each a fresh interpreter, as every Snakefile parse is),
a real cache directory, a real copy of the package with one file edited."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import worldpipe
from worldpipe.config import paths

PACKAGE = Path(worldpipe.__file__).resolve().parent
CHECK = """
import json, sys
from worldpipe.launch.preflight import checked_config
try:
    checked_config(sys.argv[1:], remember_pass=True)
    error = None
except Exception as exc:
    error = str(exc)
print(json.dumps({"torch": "torch" in sys.modules, "error": error, "package": __import__("worldpipe").__file__}))
"""


def check(cache: Path, *overrides: str, pythonpath: Path | None = None) -> dict:
    # The copy of the package reads this checkout's conf/ tree, as a job of this pipeline would.
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), paths.CONF_DIR_ENV: str(paths.CONF_DIR)}
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-c", CHECK, *overrides], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def entries(cache: Path) -> list[str]:
    folder = cache / "worldpipe" / "validated"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_pass_is_remembered_and_the_next_check_imports_no_torch(tmp_path):
    first = check(tmp_path, "experiment=smoke")
    assert first == {**first, "torch": True, "error": None}
    assert len(entries(tmp_path)) == 1
    second = check(tmp_path, "experiment=smoke")
    assert second == {**second, "torch": False, "error": None}
    # Another config is another key: checked (torch) and remembered on its own.
    assert check(tmp_path, "experiment=smoke", "model.hidden=48")["torch"] is True
    assert len(entries(tmp_path)) == 2


def test_a_failure_is_never_remembered(tmp_path, monkeypatch):
    # In this process (whether torch is imported does not matter here): the real check, the real cache folder.
    from worldpipe.launch.preflight import checked_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for _ in range(2):
        with pytest.raises(Exception) as refused:
            checked_config(["experiment=smoke", "+model.bogus=3"], remember_pass=True)
        assert str(refused.value) == "config key 'model.bogus': RSSM takes no parameter 'bogus'"
    assert entries(tmp_path) == []
    checked_config(["experiment=smoke"], remember_pass=True)  # the same folder records a pass
    assert len(entries(tmp_path)) == 1


def test_an_edited_source_file_is_a_new_key(tmp_path):
    cache = tmp_path / "cache"
    assert check(cache, "experiment=smoke")["torch"] is True
    copy = tmp_path / "code"
    shutil.copytree(PACKAGE, copy / "worldpipe", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    model = copy / "worldpipe" / "models" / "rssm.py"
    model.write_text(model.read_text() + "\n# an edit that changes nothing but the bytes\n")
    edited = check(cache, "experiment=smoke", pythonpath=copy)
    assert edited["package"].startswith(str(copy))
    assert edited["torch"] is True and edited["error"] is None
    assert len(entries(cache)) == 2
