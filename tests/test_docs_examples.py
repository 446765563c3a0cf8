"""Every command, config and Python block of the getting-started page, the concepts and the guides runs.

Each page runs as a reader would follow it, block after block in one directory, at the small size the
`<!-- doc-test ... -->` comment before a block gives (tests/docs_support.py): so the documentation cannot
drift from the code. A page marked `after: OTHER` continues in OTHER's directory, reusing its runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from docs_support import (
    DOCS,
    ROOT,
    RUN,
    Page,
    check_files,
    commands,
    environment,
    link,
    nav_pages,
    read_page,
    run_shell,
    settings_of,
    shrink,
    write_file,
)
from forkserver import ForkServer

from nnx_cli.config import Config, from_dict, merge, to_dict

TESTED = [p for p in nav_pages() if p == "getting-started.md" or p.startswith(("concepts/", "guides/"))]


def _page(name: str) -> Page:
    return read_page(ROOT / name if name == "README.md" else DOCS / name)


def _chains() -> list[list[Page]]:
    """The tested pages grouped into runs: a page, then the pages that continue after it, depth first."""
    pages = {name: _page(name) for name in [*TESTED, "README.md"]}
    followers: dict[str, list[str]] = {name: [] for name in pages}
    for name, page in pages.items():
        after = page.settings.get("after")
        if after is not None:
            assert after in pages, f"{name}: after: {after} is no tested page"
            followers[after].append(name)

    def chain(name: str) -> list[Page]:
        return [pages[name], *(p for follower in followers[name] for p in chain(follower))]

    return [chain(name) for name, page in pages.items() if page.settings.get("after") is None]


CHAINS = _chains()


def _check_config(text: str, where: str) -> None:
    from_dict(merge(to_dict(Config()), yaml.safe_load(text) or {}))


@pytest.fixture(scope="session")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """`(hf_home, shims)`: one Hugging Face home and one fork server (tests/forkserver.py) per worker."""
    hf_home = tmp_path_factory.mktemp("docs-shell") / "hf"
    server = ForkServer(environment(hf_home, {}))
    try:
        yield hf_home, server.bin
    finally:
        server.stop()


@pytest.mark.parametrize("chain", CHAINS, ids=lambda chain: "+".join(page.path for page in chain))
def test_page_runs_as_written(
    chain: list[Page], shell: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    hf_home, shims = shell
    link(tmp_path)
    monkeypatch.chdir(tmp_path)
    for page in chain:
        namespace: dict = {"__name__": f"docs_{page.path}"}
        for block in page.blocks:
            settings = settings_of(block, page)
            if settings.get("skip"):
                continue
            if settings.get("file"):
                write_file(block, settings, tmp_path)
            elif block.lang in RUN:
                run_shell(block, settings, tmp_path, hf_home, shims)
            elif block.lang == "python":
                exec(compile(block.text, block.where, "exec"), namespace)
            elif block.lang == "yaml":
                _check_config(block.text, block.where)
            check_files(block, settings, tmp_path)


def test_every_skipped_block_says_why():
    for chain in CHAINS:
        for page in chain:
            for block in page.blocks:
                skip = block.marker.get("skip")
                assert skip is None or (isinstance(skip, str) and len(skip) > 10), f"{block.where}: skip: {skip!r}"


def test_every_page_with_commands_is_tested():
    """A page with commands is tested (getting started, the concepts and the guides of the nav, README.md), or
    is one mkdocs.yml keeps out of the nav for now (a page another change brings in)."""
    outside = set(yaml.safe_load((ROOT / "mkdocs.yml").read_text()).get("not_in_nav", "").split())
    for path in sorted(DOCS.rglob("*.md")):
        name = str(path.relative_to(DOCS))
        if name in TESTED or f"/{name}" in outside:
            continue
        runnable = [b for b in read_page(path).blocks if b.lang in RUN and not b.marker.get("skip")]
        assert not runnable, f"{name} has commands that no test runs: add it to the nav, or mark the blocks skip"


def test_a_shell_block_becomes_its_commands_without_comments_or_output():
    block = (
        'nnx-train cfg.yaml "logging.loggers=[jsonl, x:Y]" \\\n'
        "    train.steps=3   # a comment\n"
        "# a whole-line comment\n"
        "nnx-eval runs/cfg --prompt 'a # not a comment'\n"
    )
    assert commands(block) == [
        'nnx-train cfg.yaml "logging.loggers=[jsonl, x:Y]" train.steps=3',
        "nnx-eval runs/cfg --prompt 'a # not a comment'",
    ]
    transcript = "$ nnx-generate runs/x --prompt A \\\n    --seed 0\nROMEO: some output # kept out\n"
    assert commands(transcript) == ["nnx-generate runs/x --prompt A --seed 0"]
    assert shrink("nnx-train a.yaml &", {"nnx-train": "train.steps=2"}) == "nnx-train a.yaml train.steps=2 &"


def test_a_marker_that_precedes_no_block_is_refused(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("<!-- doc-test\nskip: a reason long enough\n-->\nSome prose.\n\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="must come just before a fenced block"):
        read_page(page)
