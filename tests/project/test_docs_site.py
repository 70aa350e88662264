"""The docs site builds strictly: every page is in the nav, and every link between pages and every #anchor resolves.

`make docs` runs the same `mkdocs build --strict`. mkdocs.yml's `validation:` section makes each of those
problems a warning, which `--strict` turns into a failed build; the second test holds that section to it on a
two-page site with one problem of each kind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # Not -v: mkdocs 1.6 checks anchors only when its log level is above DEBUG.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_the_docs_site_builds_strictly(tmp_path):
    proc = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["strict"] is True and config["site_dir"] == "site"
    for page in ("index.html", "getting-started/index.html", "troubleshooting/index.html", "testing/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert "site/" in (REPO / ".gitignore").read_text().splitlines()


def test_a_broken_link_a_broken_anchor_or_a_page_left_out_fails_the_build(tmp_path):
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config.update(docs_dir="docs", nav=[{"Home": "index.md"}, {"Other": "other.md"}])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/index.md").write_text("# Home\n\n[fine](other.md#a-section), [gone](missing.md),"
                                            " [no such anchor](other.md#no-such-section)\n")
    (tmp_path / "docs/other.md").write_text("# Other\n\n## A section\n\ntext\n")
    (tmp_path / "docs/left-out.md").write_text("# Not in the nav\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 3, log[-3000:]
    assert any("'missing.md'" in w and "not found" in w for w in warnings), warnings
    assert any("does not contain an anchor '#no-such-section'" in w for w in warnings), warnings
    assert "- left-out.md" in log and any("not included in the \"nav\"" in w for w in warnings), warnings
