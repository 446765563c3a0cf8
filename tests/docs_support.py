"""The documentation's code blocks, read from the Markdown with the test markers beside them.

A page's blocks run in order in one directory, as a reader would type them there; an HTML comment (which
the rendered page does not show) says how a block is run at a small size::

    <!-- doc-test
    append: {nnx-train: train.steps=4 train.eval_every=2}     # added to each such command of the block
    replace: {models/smollm2: "{fixtures}/llama"}             # text substituted in the block
    -->
    ```bash
    nnx-train configs/chat_lora.yaml model.pretrained=models/smollm2
    ```

Marker keys (YAML): `skip` (the reason it cannot run here: a download, a GPU, several hosts), `file` (write
the block to this path instead of running it), `append`, `replace`, `setup` (shell run first, unseen by the
reader: the file of their own a page assumes), `env`, `exit` (the expected status, 0 by default), `expect`
(text the output contains), `files` (paths that exist afterwards). A `<!-- doc-test-page ... -->` comment
gives the page's defaults for `append`, `replace`, `env` and `setup`, and `after: PAGE` runs the page in
that page's directory once it has run (sharing its runs). `{fixtures}`, `{root}` and `{port}` in a marker
are the tiny Hugging Face fixtures, the checkout and a free TCP port.

Blocks run: `bash` / `console` (each command; with `$ ` prompts only the prompted lines), `python` (in one
namespace per page, in this process), `yaml` (checked as a config: its keys and types against the schema).
Listings (`text`, `json`, no language) are not run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
BIN = Path(sys.executable).parent

_SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)  # pymdownx.snippets: a file of the checkout, shown
_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"<!--\s*doc-test(-page)?\b(.*?)-->", re.DOTALL)
_KEYS = {"skip", "file", "append", "replace", "setup", "env", "exit", "expect", "files", "forkserver"}
_PAGE_KEYS = {"after", "append", "replace", "setup", "env"}
RUN = ("bash", "console", "sh", "shell")


@dataclasses.dataclass
class Block:
    page: str
    line: int  # 1-based, of the opening fence
    lang: str
    text: str
    marker: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclasses.dataclass
class Page:
    path: str  # relative to docs/ (or README.md)
    settings: dict[str, Any]
    blocks: list[Block]


def _marker(body: str, where: str, allowed: set[str]) -> dict[str, Any]:
    data = yaml.safe_load(body) if body.strip() else {}
    if not isinstance(data, dict) or set(data) - allowed:
        raise ValueError(f"{where}: a doc-test marker is a YAML mapping of {sorted(allowed)}, got {body.strip()!r}")
    return data


def read_page(path: Path) -> Page:
    """The fenced blocks of a Markdown page, each with the marker just before it (only blank lines between);
    a marker followed by anything but a block is a ValueError, so that none is silently ignored."""
    name = str(path.relative_to(DOCS)) if path.is_relative_to(DOCS) else path.name
    text = path.read_text()
    settings: dict[str, Any] = {}
    pending: tuple[int, dict[str, Any]] | None = None  # (line the marker ends on, marker)
    markers = {}
    for match in _MARKER.finditer(text):
        end_line = text.count("\n", 0, match.end()) + 1
        where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
        if match.group(1):
            settings = _marker(match.group(2), where, _PAGE_KEYS)
        else:
            markers[end_line] = _marker(match.group(2), where, _KEYS)
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if i + 1 in markers:
            pending = (i + 1, markers[i + 1])
        fence = _FENCE.match(lines[i])
        if not fence:
            if lines[i].strip() and pending and pending[0] != i + 1:
                raise ValueError(f"{name}:{pending[0]}: a doc-test marker must come just before a fenced block")
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        body = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        source = _SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text().rstrip("\n"), "\n".join(body))
        blocks.append(Block(name, i + 1, lang, source + "\n", pending[1] if pending else {}))
        pending = None
        i = j + 1
    if pending:
        raise ValueError(f"{name}:{pending[0]}: a doc-test marker must come just before a fenced block")
    return Page(name, settings, blocks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(value: Any, port: int) -> Any:
    if isinstance(value, str):
        return value.replace("{fixtures}", str(FIXTURES)).replace("{root}", str(ROOT)).replace("{port}", str(port))
    if isinstance(value, dict):
        return {k: _fill(v, port) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, port) for v in value]
    return value


def settings_of(block: Block, page: Page) -> dict[str, Any]:
    """The block's marker over the page's defaults (`append`, `replace`, `env` merged key by key; the page's
    `setup` before the block's)."""
    out: dict[str, Any] = {key: dict(page.settings.get(key) or {}) for key in ("append", "replace", "env")}
    setup = [page.settings.get("setup"), block.marker.get("setup")]
    out["setup"] = "\n".join(s for s in setup if s)
    for key, value in block.marker.items():
        if key in ("append", "replace", "env"):
            out[key].update(value or {})
        elif key != "setup":
            out[key] = value
    return _fill(out, _free_port())


def _strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` outside quotes, after a space)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped; with `$ ` prompts, only those."""
    lines = text.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    out: list[str] = []
    continued = False
    for line in lines:
        if prompted and not continued:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = _strip_comment(line) if not continued or not line.strip().startswith("#") else ""
        if continued:
            out[-1] = out[-1][:-1].rstrip() + " " + line.strip()
        elif line.strip():
            out.append(line.strip())
        continued = bool(out) and out[-1].endswith("\\")
    return out


def shrink(command: str, append: dict[str, str]) -> str:
    """`command` with the text `append` gives for its program added (before a trailing `&`)."""
    words = command.split()
    extra = append.get(words[0]) if words else None
    if not extra:
        return command
    if command.endswith("&"):
        return f"{command[:-1].rstrip()} {extra} &"
    return f"{command} {extra}"


def environment(hf_home: Path, extra: dict[str, str], bin_dir: Path = BIN) -> dict[str, str]:
    """A reader's shell, offline: the project's console scripts first on the PATH, CPU only, no network."""
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "JAX_PLATFORMS": "cpu",
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "NO_MKDOCS_2_WARNING": "1",
        **{k: str(v) for k, v in extra.items()},
    }


def run_shell(
    block: Block,
    settings: dict[str, Any],
    run_dir: Path,
    hf_home: Path,
    shims: Path | None = None,
    timeout: float = 300,
) -> str:
    """Run a shell block's commands in `run_dir`; return its output, after checking the status and `expect`.

    With `shims` (tests/forkserver.py), the console scripts run through the fork server, unless the
    block's marker says `forkserver: false` (a block that signals its commands, say).
    """
    text = block.text
    for old, new in settings["replace"].items():
        text = text.replace(old, new)
    script = ["set -euo pipefail"]
    if settings.get("setup"):
        script.append(settings["setup"])
    script += [shrink(command, settings["append"]) for command in commands(text)]
    script.append("wait")
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=run_dir,
        env=environment(hf_home, settings["env"], shims if shims and settings.get("forkserver", True) else BIN),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    expected = settings.get("exit", 0)
    assert result.returncode == expected, (
        f"{block.where}: exit {result.returncode} (expected {expected}) running\n" + "\n".join(script) + "\n" + output
    )
    for fragment in settings.get("expect") or []:
        assert fragment in output, f"{block.where}: {fragment!r} not in the output of\n{text}\n{output}"
    return output


def write_file(block: Block, settings: dict[str, Any], run_dir: Path) -> Path:
    text = block.text
    for old, new in settings["replace"].items():
        text = text.replace(old, new)
    path = run_dir / settings["file"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def check_files(block: Block, settings: dict[str, Any], run_dir: Path) -> None:
    for name in settings.get("files") or []:
        assert (run_dir / name).exists(), f"{block.where}: {name} does not exist after the block"


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, in order."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(config["nav"])
    return out


def link(run_dir: Path) -> None:
    """The checkout's `configs/` and `examples/` in `run_dir`, where a reader of the pages stands."""
    for name in ("configs", "examples"):
        if (ROOT / name).exists() and not (run_dir / name).exists():
            (run_dir / name).symlink_to(ROOT / name)
