"""A run's work dir, called directly: checks, the lock, finding a run, run.json, the image grid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nnx_cli.commands import train
from nnx_cli.config import load_config
from nnx_cli.errors import UserError
from nnx_cli.registry import import_paths
from nnx_cli.report import json_metrics, write_image_grid
from nnx_cli.workdir import check_workdir, lock_workdir, open_run, read_run_info

TINY = ["model.hidden_sizes=[16]", "model.latent_size=2", "train.batch_size=32", "train.steps=2"]


def test_a_file_in_place_of_the_work_dir_is_a_user_error(tmp_path: Path):
    (tmp_path / "run").write_text("")
    with pytest.raises(UserError, match="is a file; pass --workdir with a directory"):
        check_workdir(tmp_path / "run")


def test_a_work_dir_whose_path_is_not_utf8_is_a_user_error_before_anything_is_made(tmp_path: Path):
    """Orbax takes UTF-8 paths only: such a run trained, then could not write its first checkpoint."""
    import os

    workdir = tmp_path / os.fsdecode(b"run\xff")
    with pytest.raises(UserError, match="is not a UTF-8 path; pass --workdir with one"):
        check_workdir(workdir)
    assert not os.path.lexists(workdir)


def test_a_work_dir_inside_a_runs_checkpoints_is_refused_before_anything_is_written(tmp_path: Path):
    run = tmp_path / "runs" / "lm"
    (run / "checkpoints" / "1000").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError, match=r"is checkpoint step 1000 of run '.*runs/lm': a run there would write into"):
        check_workdir(run / "checkpoints" / "1000")
    with pytest.raises(UserError, match=r"is inside checkpoint step 1000 of run"):
        check_workdir(run / "checkpoints" / "1000" / "new")
    with pytest.raises(UserError, match=r"is the checkpoints of run .*; pass --workdir '.*runs/lm' to resume"):
        check_workdir(run / "checkpoints")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert check_workdir(tmp_path / "checkpoints") == [tmp_path / "checkpoints"]  # a work dir of that name is fine


@pytest.mark.parametrize("name,kind", [("checkpoints", "a directory"), ("samples", "a directory"),
                                       ("run.json", "a file")])  # fmt: skip
def test_a_work_dir_whose_layout_is_broken_says_what_to_move(tmp_path: Path, name: str, kind: str):
    """A directory named run.json was an IsADirectoryError traceback once the run had begun."""
    (tmp_path / name).mkdir() if kind == "a file" else (tmp_path / name).write_text("")
    with pytest.raises(UserError, match=f"{name}' should be {kind}; move it away"):
        check_workdir(tmp_path)


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints"])
def test_a_link_in_the_work_dir_that_a_run_cannot_write_through_is_refused_naming_it(tmp_path: Path, name: str):
    """A run writing through a link to a path that cannot be made ended in a traceback (FileNotFoundError); a link
    to a file not made yet, in a directory that exists, is written through (the run makes the file)."""
    (tmp_path / name).symlink_to(tmp_path / "gone" / name)
    problem = "which does not exist" if name == "checkpoints" else "whose directory '.*/gone' does not exist"
    with pytest.raises(UserError, match=rf"/{name}' is a symbolic link to '.*/gone/{name}', {problem}; create it"):
        check_workdir(tmp_path)
    (tmp_path / "gone").mkdir()
    if name == "checkpoints":
        with pytest.raises(UserError, match="which does not exist"):
            check_workdir(tmp_path)
        (tmp_path / "gone" / name).mkdir()
    check_workdir(tmp_path)  # a link the run can write through is the user's choice


def test_no_resume_refuses_an_init_from_only_where_it_sets_the_earlier_run_aside(tmp_path: Path):
    """An adapter directory kept in the work dir is not set aside: it was refused with the run's own checkpoints."""
    workdir = tmp_path / "run"
    for name in ("checkpoints/4", "peft_adapter"):
        (workdir / name).mkdir(parents=True)
    for inside in (workdir, workdir / "checkpoints" / "4"):
        with pytest.raises(UserError, match=r"is inside the work dir that --no-resume starts over in"):
            train._check_init_from_outside(str(inside), workdir)
    train._check_init_from_outside(str(workdir / "peft_adapter"), workdir)


def test_a_second_lock_on_a_work_dir_fails_naming_the_holder(tmp_path: Path):
    import os

    held = lock_workdir(tmp_path)
    try:
        with pytest.raises(UserError, match=f"in use by another nnx-train \\(pid {os.getpid()}\\)"):
            lock_workdir(tmp_path)
    finally:
        held.close()
    lock_workdir(tmp_path).close()  # free again once the holder closes it


def test_open_run_leaves_the_choice_of_step_to_restore_unless_one_is_named(tmp_path: Path):
    from nnx_cli import restore

    cfg = load_config(None, [*TINY, "checkpoint.every_steps=1", "checkpoint.keep=5"])
    assert train.run(cfg, tmp_path / "run") == 0
    run = open_run(tmp_path / "run")
    assert run.step is None
    assert restore.from_run(run, lambda checkpointer, step: step, print) == (2, 2)  # the newest usable one
    assert open_run(tmp_path / "run" / "checkpoints" / "1").step == 1
    assert open_run(tmp_path / "run", step=1).step == 1
    with pytest.raises(UserError, match="--step 7: no such checkpoint.*available steps: 1, 2$"):
        open_run(tmp_path / "run", step=7)
    (tmp_path / "run" / "checkpoints" / "12").mkdir()  # empty: it was listed as a step to pass
    with pytest.raises(UserError, match="--step 7: no such checkpoint.*available steps: 1, 2$"):
        open_run(tmp_path / "run", step=7)
    with pytest.raises(UserError, match="contradicts the step dir"):
        open_run(tmp_path / "run" / "checkpoints" / "1", step=2)


def test_a_reader_passes_over_steps_a_run_still_training_prunes_and_reads_the_newer_one(tmp_path: Path):
    """nnx-eval on a work dir still training: the steps it listed went away as the run kept its newest ones (keep
    N), and the reader called them damaged ("not a directory", "cannot be read") and gave up."""
    import shutil

    from nnx_cli import restore

    cfg = load_config(None, [*TINY, "checkpoint.every_steps=1", "checkpoint.keep=5"])
    assert train.run(cfg, tmp_path / "run") == 0
    checkpoints, said = tmp_path / "run" / "checkpoints", []

    def read(step: int) -> int:  # the trainer writes step 3 and prunes 1 and 2 while the reader reads step 2
        if step == 2:
            shutil.copytree(checkpoints / "2", checkpoints / "3")
            shutil.rmtree(checkpoints / "1")
            shutil.rmtree(checkpoints / "2")
            raise restore.Unreadable(f"checkpoint {(checkpoints / '2').absolute()} cannot be read (FileNotFoundError)")
        return step

    found = restore.choose(checkpoints, read, say=said.append)
    assert (found.step, found.value, found.rejected, said) == (3, 3, [], [])


def test_a_reader_whose_step_is_pruned_while_it_verifies_or_reads_it_reads_an_older_one_or_says_so(
    tmp_path: Path, monkeypatch
):
    """A step pruned while its files were hashed was a FileNotFoundError traceback (exit 1); one pruned while its
    metadata was read half-gone said the checkpoint does not match the model (exit 2)."""
    import shutil

    from nnx_cli import integrity, restore

    cfg = load_config(None, [*TINY, "checkpoint.every_steps=1", "checkpoint.keep=5"])
    assert train.run(cfg, tmp_path / "run") == 0
    checkpoints, verify = tmp_path / "run" / "checkpoints", integrity.verify

    def pruned_while_hashed(step_dir: Path):
        if step_dir.name == "2":
            shutil.rmtree(step_dir)
            raise FileNotFoundError(2, "No such file or directory", str(step_dir / "_CHECKPOINT_METADATA"))
        return verify(step_dir)

    monkeypatch.setattr(integrity, "verify", pruned_while_hashed)
    assert restore.choose(checkpoints, lambda step: step, say=print).step == 1
    monkeypatch.setattr(integrity, "verify", verify)

    def pruned_while_read(step: int) -> int:
        shutil.rmtree(checkpoints / str(step))
        raise UserError(f"checkpoint {checkpoints / str(step)} does not match the model and optimizer of the config")

    with pytest.raises(UserError, match=r"checkpoint .*1 cannot be used: it was removed while read \(a run still "
                                        r"training pruned it\); pick another --step$"):  # fmt: skip
        restore.choose(checkpoints, pruned_while_read, step=1)


def test_best_naming_a_step_that_is_gone_says_so_rather_than_blaming_a_step_not_passed(tmp_path: Path):
    cfg = load_config(None, [*TINY, "checkpoint.every_steps=1", "checkpoint.keep=5"])
    assert train.run(cfg, tmp_path / "run") == 0
    (tmp_path / "run" / "checkpoints" / "best.json").write_text('{"step": 7, "metric": "loss", "mode": "min", '
                                                                 '"value": 1.0}')  # fmt: skip
    with pytest.raises(UserError, match=r"--best: .*best.json' records step 7, which is no longer there .*; pass "
                                        r"--step, available steps: 1, 2$"):  # fmt: skip
        open_run(tmp_path / "run", best=True)


def test_a_run_without_its_config_names_the_file_for_every_command(tmp_path: Path):
    (tmp_path / "run" / "checkpoints" / "2").mkdir(parents=True)
    with pytest.raises(UserError, match=r"config.yaml' is missing: the commands that read a run rebuild its model"):
        open_run(tmp_path / "run")


def test_a_dir_without_checkpoints_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match="no checkpoint found"):
        open_run(tmp_path)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(
        UserError, match=r"notes.txt' is a file; pass a work dir of nnx-train \(it holds checkpoints/\)"
    ):
        open_run(tmp_path / "notes.txt")
    (tmp_path / "checkpoints" / "3.corrupt-1" / "state").mkdir(parents=True)  # it said "train first"
    here = re.escape(str(tmp_path))
    with pytest.raises(UserError, match=r"'.*3.corrupt-1' is step 3 moved aside when it failed its checksums; .*pass "
                                        rf"the work dir '{here}' for its intact steps"):  # fmt: skip
        open_run(tmp_path / "checkpoints" / "3.corrupt-1")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match=r"'.*adapter' is a PEFT adapter, not a run of nnx-train; a run starts from it "
                                        r"with checkpoint.init_from: "):  # fmt: skip
        open_run(tmp_path / "adapter")


def test_a_work_dir_whose_earlier_run_was_set_aside_says_how_to_put_it_back(tmp_path: Path):
    (tmp_path / "run" / ".replaced" / "checkpoints" / "4").mkdir(parents=True)
    with pytest.raises(UserError, match=r"left the earlier run in .*\.replaced'; nnx-train on this work dir without "
                       "--no-resume puts it back"):  # fmt: skip
        open_run(tmp_path / "run")


def test_a_config_file_given_for_a_work_dir_says_where_its_run_went(tmp_path: Path):
    (tmp_path / "my_images.yaml").write_text("model: {name: vae}\n")
    with pytest.raises(UserError, match=r"is a config file; pass the work dir its run wrote .* runs/my_images"):
        open_run(tmp_path / "my_images.yaml")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("model: {name: vae}\n")
    with pytest.raises(UserError, match=r"config.yaml' is a config file; pass its work dir, '.*run'$"):
        open_run(tmp_path / "run" / "config.yaml")


def test_run_json_records_where_plug_ins_were_imported_from(tmp_path: Path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "wide_vae.py").write_text("from nnx_cli.models import VAE\n\nclass Wide(VAE):\n    pass\n")
    monkeypatch.chdir(project)
    cfg = load_config(None, [*TINY, "model.name=wide_vae:Wide"])
    assert train.run(cfg, project / "run") == 0
    assert read_run_info(project / "run")["import_paths"]["wide_vae"] == str(project)
    assert import_paths()["wide_vae"] == str(project)


def test_a_runs_plug_in_is_imported_from_where_the_run_recorded_not_from_a_namesake_here(tmp_path: Path, monkeypatch):
    """nnx-eval of a run from a directory holding another `plugins.py` evaluated the checkpoint with that file's
    code (other metrics, exit 0, no word), though run.json named the run's own directory."""
    import sys

    from nnx_cli import registry

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(registry, "_pinned", {})
    monkeypatch.delitem(sys.modules, "nnx_test_namesake", raising=False)
    project, here = tmp_path / "project", tmp_path / "here"
    for directory, value in ((project, "the run's"), (here, "a namesake")):
        directory.mkdir()
        (directory / "nnx_test_namesake.py").write_text(f"VALUE = {value!r}\n")
    monkeypatch.chdir(here)
    registry.add_import_paths({"nnx_test_namesake": str(project)})
    assert registry.load_reference("nnx_test_namesake:VALUE", "model.name") == "the run's"
    monkeypatch.delitem(sys.modules, "nnx_test_namesake")


def test_a_runs_relative_tokenizer_and_gguf_base_are_found_from_any_directory_as_its_source_is(tmp_path, monkeypatch):
    """`data.tokenizer=tok.json` or `model.pretrained=base.gguf` trained in the project: nnx-generate and nnx-eval
    from elsewhere said the file does not exist, where a relative data.source was found."""
    import json as json_module

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "run" / "checkpoints" / "4" / "state").mkdir(parents=True)
    (project / "run" / "checkpoints" / "4" / "commit_success.txt").write_text("")
    elsewhere.mkdir()
    for name in ("tok.json", "book.txt", "bytes", "base.gguf"):  # `bytes` stays the built-in tokenizer's name
        (project / name).write_text("")
    (project / "run" / "run.json").write_text(json_module.dumps({"cwd": str(project)}))
    config = "model: {name: transformer_lm, pretrained: base.gguf}\ndata: {source: book.txt, tokenizer: tok.json}\n"
    (project / "run" / "config.yaml").write_text(config)
    monkeypatch.chdir(elsewhere)
    run = open_run(project / "run")
    assert (run.cfg.data.source, run.cfg.data.tokenizer) == (str(project / "book.txt"), str(project / "tok.json"))
    assert run.cfg.model.pretrained == str(project / "base.gguf")  # a directory is kept absolute; a .gguf was not
    assert open_run(project / "run", ["data.tokenizer=bytes"]).cfg.data.tokenizer == "bytes"
    (project / "run" / "config.yaml").write_text(config.replace("tok.json", "bytes"))
    assert open_run(project / "run").cfg.data.tokenizer == "bytes"


def test_json_metrics_turn_non_finite_values_into_null():
    assert (
        json.dumps(json_metrics({"a": 1.5, "b": float("nan"), "c": float("inf")})) == '{"a": 1.5, "b": null, "c": null}'
    )


def test_image_grid_tiles_images_with_a_border_and_upscales(tmp_path: Path):
    images = np.zeros((10, 3, 2, 1), np.float32)
    images[0] = 1.0
    write_image_grid(images, tmp_path / "grid.png", columns=8, scale=2)
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == ((2 * (3 + 1) + 1) * 2, (8 * (2 + 1) + 1) * 2)  # 2 rows of 8, one-pixel borders, x2
    assert grid[2:8, 2:6].min() == 255 and grid[2:8, 8:12].max() == 0  # first image white, second black


def test_a_run_set_aside_comes_back_as_it_was_when_the_new_one_committed_no_checkpoint(tmp_path: Path):
    from nnx_cli.workdir import set_aside, settle_aside

    (tmp_path / "checkpoints" / "40").mkdir(parents=True)
    (tmp_path / "checkpoints" / "40" / "commit_success.txt").write_text("")
    (tmp_path / "metrics.jsonl").write_text("old\n")
    (tmp_path / "config.20.yaml").write_text("model: {}\n")  # a config the earlier run changed at step 20
    aside = set_aside(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".replaced"]
    # the new run: a first eval's grid and samples, a step it never committed, then it stops
    for name in ("images", "samples", "checkpoints/10"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("new\n")
    settle_aside(aside)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.20.yaml", "metrics.jsonl"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["40"]
    assert (tmp_path / "metrics.jsonl").read_text() == "old\n"
    # once the new run has committed one, the earlier run goes
    aside = set_aside(tmp_path)
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)
    (tmp_path / "checkpoints" / "10" / "commit_success.txt").write_text("")
    settle_aside(aside)
    assert not aside.exists() and [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["10"]
    assert not (tmp_path / "config.20.yaml").exists()  # the earlier run's, gone with it


def test_a_second_no_resume_after_one_killed_before_its_first_checkpoint_sets_the_earlier_run_aside_again(
    tmp_path: Path,
):
    """The second `--no-resume` deleted the `.replaced` the killed one left: the earlier run, checkpoints and all,
    was gone without a word, though the docs promise the next nnx-train puts it back."""
    from nnx_cli.workdir import set_aside, settle_aside

    (tmp_path / "checkpoints" / "40").mkdir(parents=True)
    (tmp_path / "checkpoints" / "40" / "commit_success.txt").write_text("")
    (tmp_path / "metrics.jsonl").write_text("old\n")
    set_aside(tmp_path)
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)  # the new run, killed outright before committing step 10
    (tmp_path / "metrics.jsonl").write_text("new\n")
    aside = set_aside(tmp_path)  # the same --no-resume command again
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["40"]
    assert (aside / "metrics.jsonl").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".replaced"]
    settle_aside(aside)  # and this one stops before its first checkpoint too: the earlier run is back
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["40"]
    # a killed --no-resume run that had committed a checkpoint had replaced the earlier run: that one goes
    set_aside(tmp_path)
    (tmp_path / "checkpoints" / "10").mkdir(parents=True)
    (tmp_path / "checkpoints" / "10" / "commit_success.txt").write_text("")
    aside = set_aside(tmp_path)
    assert [p.name for p in (aside / "checkpoints").iterdir()] == ["10"]


def _earlier_run(workdir: Path) -> None:
    (workdir / "checkpoints" / "92").mkdir(parents=True)
    (workdir / "checkpoints" / "92" / "commit_success.txt").write_text("")
    (workdir / "metrics.jsonl").write_text("old\n")
    (workdir / "images").mkdir()
    (workdir / "config.yaml").write_text("model: {}\n")


def test_a_step_the_new_run_was_killed_while_committing_does_not_replace_the_earlier_run(tmp_path: Path):
    """Orbax writes commit_success.txt into a step's temporary directory before renaming it into place: a run
    killed between the two counted as committed, and the next nnx-train deleted the earlier run."""
    from nnx_cli.workdir import set_aside, settle_aside

    _earlier_run(tmp_path)
    aside = set_aside(tmp_path)
    unfinished = tmp_path / "checkpoints" / "200.orbax-checkpoint-tmp"
    unfinished.mkdir(parents=True)
    (unfinished / "commit_success.txt").write_text("")
    (tmp_path / "checkpoints" / "150.corrupt-1").mkdir()  # a damaged step set aside is no commit either
    (tmp_path / "checkpoints" / "150.corrupt-1" / "commit_success.txt").write_text("")
    assert settle_aside(aside)  # the next nnx-train: the earlier run is back
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["92"]
    assert (tmp_path / "metrics.jsonl").read_text() == "old\n"


def test_a_set_aside_stopped_among_its_renames_loses_nothing(tmp_path: Path, monkeypatch):
    """A signal while --no-resume moved the earlier run aside left `.replaced` with part of it; putting that back
    deleted the parts never moved (metrics, images, config)."""
    from nnx_cli import workdir as workdir_module

    _earlier_run(tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    rename, renamed = Path.rename, []

    def stopped(self: Path, target):
        if len(renamed) == 2:
            raise KeyboardInterrupt  # the process ends here
        renamed.append(self)
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped)
    with pytest.raises(KeyboardInterrupt):
        workdir_module.set_aside(tmp_path)
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(UserError, match="nnx-train on this work dir without --no-resume puts it back"):
        open_run(tmp_path)  # the readers say where the earlier run is
    workdir_module.settle_aside(tmp_path / workdir_module.ASIDE)  # the next nnx-train, resuming
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    aside = workdir_module.set_aside(tmp_path)  # or starting over again: all of the earlier run is set aside
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "config.yaml", "images", "metrics.jsonl"]


def test_a_resumed_run_that_no_longer_keeps_the_best_step_says_it_will_go(tmp_path: Path, capsys):
    """An override of checkpoint.keep_best not given again on resume: the best step went with the next prune, and
    `nnx-eval --best` then named a step no longer there, with not a word from the run."""
    best = "checkpoint.keep_best={metric: nelbo, mode: max}"
    keep = [*TINY, "train.eval_every=1", "checkpoint.every_steps=2", "checkpoint.keep=1"]
    assert train.run(load_config(None, [*keep, "train.steps=4", best]), tmp_path / "run") == 0
    step = json.loads((tmp_path / "run" / "checkpoints" / "best.json").read_text())["step"]
    capsys.readouterr()
    assert train.run(load_config(None, [*keep, "train.steps=6", best]), tmp_path / "run") == 0
    assert "keep_best" not in capsys.readouterr().err  # kept as before: nothing to say
    assert train.run(load_config(None, [*keep, "train.steps=8"]), tmp_path / "run") == 0
    said = capsys.readouterr().err
    assert f"notice: checkpoint.keep_best is off: step {step}, the best nelbo so far (best.json), goes once" in said
    assert "set checkpoint.keep_best={metric: nelbo, mode: max}" in said


@pytest.mark.parametrize("text,said", [("", "is empty"), ("model: {name: vae\n", "is not valid YAML")])
def test_a_runs_damaged_config_says_how_to_write_it_again(tmp_path: Path, text: str, said: str):
    """An empty config.yaml was read as the defaults: 'does not match the model ... drop the overrides', though no
    override was given; a damaged one said only that it is not YAML."""
    (tmp_path / "run" / "checkpoints" / "4" / "state").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "4" / "commit_success.txt").write_text("")
    (tmp_path / "run" / "config.yaml").write_text(text)
    with pytest.raises(UserError, match=f"config.yaml'? {said}.*: restore it, or run nnx-train with the run's config "
                                        "file and --workdir '.*run', which resumes and writes it again$"):  # fmt: skip
        open_run(tmp_path / "run")


def test_a_put_back_cut_short_is_finished_by_the_next_run_not_taken_for_a_commit(tmp_path: Path, monkeypatch):
    """A put-back stopped after the earlier run's checkpoints were back (a signal, a write still under way in a
    directory it replaces): the next nnx-train took those for the new run's commit and deleted the rest of the
    earlier run (its metrics, images, config)."""
    from nnx_cli.workdir import set_aside, settle_aside

    _earlier_run(tmp_path)
    before = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    aside = set_aside(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("new\n")  # the new run's, stopped before its first checkpoint
    (tmp_path / "images").mkdir()
    rename, renamed = Path.rename, []

    def stopped(self: Path, target):
        if renamed:
            raise KeyboardInterrupt  # the process ends here, the checkpoints back and the rest not
        renamed.append(self)
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped)
    with pytest.raises(KeyboardInterrupt):
        settle_aside(aside)
    monkeypatch.setattr(Path, "rename", rename)
    assert (tmp_path / "checkpoints" / "92").is_dir()
    assert settle_aside(aside)  # the next nnx-train finishes it
    assert {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # decided at a signal's exit and left for later: nothing moves until the next call
    aside = set_aside(tmp_path)
    assert settle_aside(aside, delete=False, put_back=True, later=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".replaced"]
    assert settle_aside(aside)
    assert {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
