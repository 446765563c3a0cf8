"""The configs that ship with nnx: listed, copied out to edit, taken by name; and carried by the wheel and the
sdist, so that an installed nnx (not an editable checkout) trains them from any directory."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from cli_support import ROOT, assert_user_error, cli, env

from nnx_cli.commands import configs
from nnx_cli.errors import UserError


def test_every_config_of_the_checkout_ships_with_the_package():
    assert (ROOT / "configs").resolve() == configs.RECIPES  # configs/ links to the package's recipes
    assert sorted(configs.shipped()) == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert "digits_vae" in configs.shipped()  # the default: offline, seconds


def test_every_shipped_config_says_what_it_is_for_in_its_first_line():
    for name, path in configs.shipped().items():
        line = configs.summary(path)
        assert line.endswith(".") and len(line) <= 100, f"{name}: {line!r}"


def test_ls_lists_every_shipped_config_a_line_each_with_what_it_is_for():
    lines = configs.listing()
    assert [line.split()[0] for line in lines] == list(configs.shipped())
    digits = lines[list(configs.shipped()).index("digits_vae")]
    assert digits.endswith("A VAE on the 8x8 digits shipped with scikit-learn: no network, trains in seconds.")


def test_cp_copies_a_config_out_to_a_file_or_into_a_directory(tmp_path):
    assert configs.copy("chat_lora", tmp_path / "mine" / "chat.yaml") == tmp_path / "mine" / "chat.yaml"
    assert configs.copy("digits_vae.yaml", f"{tmp_path / 'more'}/") == tmp_path / "more" / "digits_vae.yaml"
    original = configs.shipped()
    assert (tmp_path / "mine" / "chat.yaml").read_text() == original["chat_lora"].read_text()
    assert (tmp_path / "more" / "digits_vae.yaml").read_text() == original["digits_vae"].read_text()


def test_cp_to_a_dash_prints_the_config_and_writes_no_file(tmp_path):
    done = cli("nnx-configs", "cp", "tiny_lm", "-", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == configs.shipped()["tiny_lm"].read_text() and list(tmp_path.iterdir()) == []


def test_cp_never_writes_over_a_file(tmp_path):
    mine = tmp_path / "chat.yaml"
    mine.write_text("# my edits\n")
    with pytest.raises(UserError, match=r"chat.yaml' exists already"):
        configs.copy("chat_lora", mine)
    assert mine.read_text() == "# my edits\n"


def test_cp_into_a_place_it_cannot_write_is_a_user_error_naming_it(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=r"cannot write '.*afile/x.yaml': '.*afile' is a file, not a directory; name "):
        configs.copy("chat_lora", tmp_path / "afile" / "x.yaml")  # it said "File exists"
    (tmp_path / "locked").mkdir(mode=0o500)
    if os.access(tmp_path / "locked", os.W_OK):  # root writes anywhere: a path under /proc stands in
        target = Path("/proc/self/x.yaml")
    else:
        target = tmp_path / "locked" / "x.yaml"
    with pytest.raises(UserError, match=r"cannot write '.*x.yaml': .*; name a DEST in a writable directory"):
        configs.copy("chat_lora", target)


def test_an_unknown_name_lists_the_shipped_configs_with_a_did_you_mean():
    with pytest.raises(UserError, match=r"did you mean 'digits_vae'\?\); shipped: chat_lora, digits_vae, "):
        configs.find("digits_vea")
    with pytest.raises(UserError, match=r"did you mean 'digits_vae'"):
        configs.copy("digits_vea", "x.yaml")


def test_a_path_that_exists_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert configs.find("digits_vae") == configs.shipped()["digits_vae"]
    assert configs.find("digits_vae.yaml") == configs.shipped()["digits_vae"]
    Path("digits_vae.yaml").write_text("seed: 3\n")
    assert configs.find("digits_vae.yaml") == Path("digits_vae.yaml")


def test_a_missing_path_names_the_config_that_ships_under_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's `nnx-train configs/digits_vae.yaml`, outside a checkout
    with pytest.raises(UserError, match=r"'configs/digits_vae.yaml' does not exist; 'digits_vae' ships with nnx"):
        configs.find("configs/digits_vae.yaml")


def test_nnx_inspect_takes_a_shipped_config_by_name(tmp_path):
    result = cli("nnx-inspect", "mnist_cnn", "--json", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert '"total_params"' in result.stdout


def test_nnx_train_of_an_unknown_name_is_exit_2_listing_the_shipped_configs(tmp_path):
    result = cli("nnx-train", "tiny_llm", cwd=tmp_path, timeout=120)
    assert_user_error(result, "'tiny_llm' does not exist", "did you mean 'tiny_lm'?", "shipped: chat_lora, ")
    assert not (tmp_path / "runs").exists()


# The wheel, installed
# ------------------------------------------------------------------------------


def run(*args: str | Path, cwd: Path | None = None, environ: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and the sdist of this checkout, built offline (`--no-build-isolation`: the test environment's
    setuptools) from a copy of its sources, so that the checkout gains no build/ or egg-info."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("nnx", "nnx_cli"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", out, src)
    run(sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})", cwd=src)
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed and nothing else: its dependencies come from this environment's
    site-packages (a path in a .pth file, which leaves out this environment's editable install of nnx), so that
    nothing is downloaded."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    packages = Path(run(python, "-c", "import site; print(site.getsitepackages()[0])").stdout.strip())
    (packages / "dependencies.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    [wheel] = dist.glob("*.whl")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", python]
    run(*pip, "install", "--no-deps", "--no-index", "--ignore-installed", wheel)
    return venv


def installed_env(cwd: Path) -> dict[str, str]:
    return {k: v for k, v in env(cwd).items() if k != "PYTHONPATH"}  # nothing but the installed package


def test_the_wheel_and_the_sdist_carry_every_shipped_config(dist):
    names = {f"{name}.yaml" for name in configs.shipped()}
    [wheel], [sdist] = dist.glob("*.whl"), dist.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as files:
        in_wheel = {Path(n).name for n in files.namelist() if n.startswith("nnx_cli/recipes/")}
    with tarfile.open(sdist) as files:
        in_sdist = {Path(n).name for n in files.getnames() if "/nnx_cli/recipes/" in n}
    assert in_wheel == names and in_sdist == names


def test_an_installed_wheel_trains_the_default_config_by_name_from_another_directory(installed, tmp_path):
    python, environ = installed / "bin" / "python", installed_env(tmp_path)
    where = run(python, "-c", "import nnx_cli; print(nnx_cli.__file__)", cwd=tmp_path, environ=environ).stdout
    assert where.startswith(str(installed))  # the wheel's code, not the checkout's
    result = run(installed / "bin" / "nnx-train", "digits_vae", "train.steps=10", cwd=tmp_path, environ=environ)
    assert (tmp_path / "runs" / "digits_vae" / "checkpoints" / "10").is_dir()
    assert "done: 10 steps" in result.stderr


def test_an_installed_wheel_lists_its_configs_and_copies_one_out(installed, tmp_path):
    command, environ = installed / "bin" / "nnx-configs", installed_env(tmp_path)
    listed = run(command, "ls", cwd=tmp_path, environ=environ).stdout
    assert [line.split()[0] for line in listed.splitlines()] == list(configs.shipped())
    run(command, "cp", "tiny_lm", "lm.yaml", cwd=tmp_path, environ=environ)
    assert (tmp_path / "lm.yaml").read_text() == configs.shipped()["tiny_lm"].read_text()
