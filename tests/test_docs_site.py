"""The documentation site builds offline with `mkdocs build --strict`, and the README stays a front door."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_with_no_warning(tmp_path: Path):
    """Broken links, missing pages, stale anchors and docstrings griffe cannot read are all warnings."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    # The API pages show the docstrings' examples as code (docs/rst_docstrings.py): Markdown alone read each
    # `>>>` session as three nested block quotes and printed roles such as :class:`Module` as they are.
    for page in (tmp_path / "site" / "reference" / "api").glob("*/index.html"):
        html = page.read_text()
        assert "<blockquote>" not in html and not re.search(r":(class|func|meth):", html), page
    sessions = (tmp_path / "site" / "reference" / "api" / "nnx" / "index.html").read_text()
    assert sessions.count('<span class="gp">&gt;&gt;&gt; </span>') > 50


def test_the_site_uses_no_plugin_that_fetches_from_the_network():
    """Material's social cards and privacy plugin download at build time; Google Fonts load in the reader's browser."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    plugins = {next(iter(p)) if isinstance(p, dict) else p for p in config["plugins"]}
    assert plugins <= {"search", "mkdocstrings"}, plugins
    assert config["theme"]["font"] is False


def test_the_readme_fits_in_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_the_readmes_relative_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert relative, "the README links into the documentation"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to {missing}, which do not exist"
