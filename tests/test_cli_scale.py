"""Scaling out: the shipped digits config on 1 device, on a mesh of 8, and as 2 processes.

Only `sharding` and the launch change between these runs, and they end with
the same metrics. Devices are simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`); processes talk
through `jax.distributed` on 127.0.0.1 with gloo collectives.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_support import ROOT, assert_user_error, cli, final_state, free_port, start, wait_for_checkpoint

from nnx_cli.checkpoint import Checkpointer
from nnx_cli.distributed import SAY_WAITING_AFTER_S

CONFIG = ROOT / "configs" / "digits_vae.yaml"
STEPS = 100  # on meshes
MESH_4x2 = ("sharding.mesh.data=4", "sharding.mesh.model=2")
MP_STEPS = 40  # as several processes: gloo collectives make each step slow on two cores
MULTI_PROCESS = (f"train.steps={MP_STEPS}", "train.log_every=10", "checkpoint.every_steps=10", "checkpoint.keep=10")


def train(workdir: str, *overrides: str, cwd: Path, devices: int = 1, config: str | Path = CONFIG) -> Path:
    result = cli("nnx-train", config, *overrides, "--workdir", workdir, cwd=cwd, devices=devices, timeout=240)
    assert result.returncode == 0, result.stderr
    return cwd / workdir


def start_processes(
    workdir: str,
    cwd: Path,
    processes: int = 2,
    devices: int = 2,
    overrides: dict[int, tuple[str, ...]] | None = None,
    config: str | Path = CONFIG,
    settings: tuple[str, ...] = MULTI_PROCESS,
) -> list[subprocess.Popen]:
    """One `nnx-train` of `config` per process, joined through a coordinator on the loopback address
    (`overrides`: more overrides for some processes, by process id)."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        start(
            "nnx-train",
            config,
            *settings,
            *(overrides or {}).get(i, ()),
            "--workdir",
            workdir,
            "--coordinator",
            coordinator,
            "--num-processes",
            str(processes),
            "--process-id",
            str(i),
            cwd=cwd,
            devices=devices,
        )
        for i in range(processes)
    ]


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    outputs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        outputs.append((proc.returncode, stdout, stderr))
    return outputs


def last_eval(workdir: Path) -> dict[str, float]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][-1][
        "metrics"
    ]


def assert_same_state(a: Path, b: Path, **tolerance: float) -> None:
    x, y = final_state(a), final_state(b)
    assert x["step"] == y["step"]
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        np.testing.assert_allclose(u, v, **tolerance)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scale")


@pytest.fixture(scope="module")
def one_device(project: Path) -> Path:
    return train("one-device", f"train.steps={STEPS}", cwd=project)


@pytest.fixture(scope="module")
def eight_devices(project: Path) -> Path:
    return train("eight-devices", f"train.steps={STEPS}", *MESH_4x2, cwd=project, devices=8)


@pytest.fixture(scope="module")
def four_devices(project: Path) -> Path:
    return train("four-devices", *MULTI_PROCESS, cwd=project, devices=4)


@pytest.fixture(scope="module")
def two_processes(project: Path) -> tuple[Path, list[tuple[int, str, str]]]:
    outputs = finish(start_processes("two-processes", cwd=project))
    for code, _, stderr in outputs:
        assert code == 0, stderr
    return project / "two-processes", outputs


# --------------------------------------------------------------------------- a mesh of 8 devices


def test_eight_devices_with_a_model_axis_evaluate_like_one_device(one_device: Path, eight_devices: Path, project: Path):
    result = cli("nnx-eval", eight_devices, "--json", cwd=project, devices=8)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["metrics"] == pytest.approx(last_eval(one_device), rel=1e-4)


def test_parameters_and_optimizer_state_stay_split_over_the_model_axis(eight_devices: Path):
    saved = Checkpointer(eight_devices / "checkpoints", read_only=True).metadata(STEPS)
    specs = {"/".join(map(str, path)): tuple(m.sharding.partition_spec) for path, m in _flatten(saved)}
    assert specs["params/encoder/0/kernel"] == (None, "model")  # (embed, hidden)
    assert specs["params/decoder/1/kernel"] == ("model", None)  # (hidden, embed)
    assert specs["opt_state/0/mu/encoder/0/kernel"] == (None, "model")
    assert specs["opt_state/0/nu/decoder/0/bias"] == ("model",)
    assert all(axis is None for axis in specs["params/mean/kernel"][1:])  # (hidden, latent): latent has no rule


def test_inspect_shows_the_mesh_axes_of_the_run(eight_devices: Path, project: Path):
    result = cli("nnx-inspect", eight_devices, "--json", "--filter", "Param", cwd=project)
    assert result.returncode == 0, result.stderr
    entries = {e["path"]: e for e in json.loads(result.stdout)["entries"]}
    assert entries["encoder/0/kernel"]["sharding"] == ["embed", "hidden"]
    assert entries["encoder/0/kernel"]["mesh_axes"] == [None, "model"]
    assert entries["encoder/0/bias"]["mesh_axes"] == ["model"]
    assert all(e["sharding"] for e in entries.values())


def test_a_mesh_that_does_not_fit_the_devices_says_how_to_override_it(project: Path):
    result = cli("nnx-train", CONFIG, *MESH_4x2, "--workdir", "misfit", cwd=project, devices=2)
    assert_user_error(result, "'sharding.mesh'", "2 available device(s)", "sharding.mesh.data=-1 sharding.mesh.model=1")


def test_a_parameter_that_does_not_split_evenly_names_its_logical_axis(project: Path):
    result = cli(
        "nnx-train",
        CONFIG,
        "sharding.mesh.data=1",
        "sharding.mesh.model=2",
        "model.hidden_sizes=[101]",
        "--workdir",
        "uneven",
        cwd=project,
        devices=2,
    )
    assert_user_error(result, "params/", "[101]", "not divisible by 2", "map 'hidden' to null in sharding.rules")


def test_inspect_previews_a_mesh_of_another_machine_and_warns_of_a_split_training_would_refuse(project: Path):
    """It showed the split as fine (exit 0, no word) and the run on the bigger machine was refused at start."""
    fits = cli("nnx-inspect", CONFIG, "sharding.mesh.data=4", "sharding.mesh.model=2", "--json", cwd=project)
    assert fits.returncode == 0 and "warning" not in fits.stderr, fits.stderr
    uneven = ("sharding.mesh.data=1", "sharding.mesh.model=2", "model.hidden_sizes=[101]")
    result = cli("nnx-inspect", CONFIG, *uneven, "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["total_params"] > 0
    assert "warning: nnx-train would refuse this sharding: params/" in result.stderr
    assert "not divisible by 2" in result.stderr and "map 'hidden' to null in sharding.rules" in result.stderr
    # -1 beside an axis this machine's one device cannot fill: nothing was said, as for a split that is fine
    unknown = cli("nnx-inspect", CONFIG, "sharding.mesh.model=5", "--json", cwd=project)
    assert unknown.returncode == 0, unknown.stderr
    assert "warning: the split was not checked: sharding.mesh {'data': -1, 'model': 5} takes the rest" in unknown.stderr
    # a batch the data axes do not split: refused by nnx-train, shown without a word
    batch = cli("nnx-inspect", CONFIG, "sharding.mesh.data=8", "sharding.mesh.model=1", "train.batch_size=12",
                "--json", cwd=project)  # fmt: skip
    assert batch.returncode == 0, batch.stderr
    assert (
        "warning: nnx-train would refuse this sharding: config key 'train.batch_size' (12) must be divisible by "
        in (batch.stderr)
    )


# --------------------------------------------------------------------------- several processes


def test_two_processes_train_like_one_process_with_four_devices(two_processes, four_devices: Path):
    workdir, _ = two_processes
    assert last_eval(workdir) == pytest.approx(last_eval(four_devices), rel=1e-5)
    assert_same_state(workdir, four_devices, rtol=1e-5, atol=1e-6)


def test_a_multi_process_checkpoint_evaluates_in_one_process(two_processes, project: Path):
    workdir, _ = two_processes
    result = cli("nnx-eval", workdir, "--json", cwd=project)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"step": MP_STEPS, "metrics": pytest.approx(last_eval(workdir), rel=1e-5)}


def test_only_process_zero_reports(two_processes):
    workdir, outputs = two_processes
    (_, _, first), (_, _, second) = outputs
    assert f"step {MP_STEPS}/{MP_STEPS}" in first and "done:" in first
    assert "step " not in second and "done:" not in second and "eval" not in second
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(10, MP_STEPS + 1, 10))
    assert (workdir / "images" / f"{MP_STEPS}.png").is_file()


def test_killed_processes_resume_to_the_uninterrupted_parameters(two_processes, project: Path):
    reference, _ = two_processes
    procs = start_processes("killed", cwd=project)
    wait_for_checkpoint(project / "killed", 10, procs)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    finish(procs)
    resumed_from = Checkpointer(project / "killed" / "checkpoints", read_only=True).latest_step()
    assert 10 <= resumed_from < MP_STEPS
    outputs = finish(start_processes("killed", cwd=project))
    assert [code for code, _, _ in outputs] == [0, 0], outputs[0][2] + outputs[1][2]
    assert f"resumed from {Path('killed', 'checkpoints', str(resumed_from))}" in outputs[0][2]
    assert_same_state(project / "killed", reference, rtol=0, atol=0)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(two_processes, project: Path, signum):
    """SIGTERM too: jax.distributed installs a preemption notifier on it that would only log it."""
    reference, _ = two_processes
    workdir = f"interrupted-{signum.name}"
    procs = start_processes(workdir, cwd=project)
    wait_for_checkpoint(project / workdir, 10, procs)
    procs[1].send_signal(signum)  # process 0 learns of it from the others
    outputs = finish(procs)
    assert [code for code, _, _ in outputs] == [130, 130], outputs[0][2] + outputs[1][2]
    stopped_at = Checkpointer(project / workdir / "checkpoints", read_only=True).latest_step()
    assert 10 <= stopped_at < MP_STEPS
    assert (
        f"interrupted by {signum.name}: checkpoint written at {Path(workdir, 'checkpoints', str(stopped_at))}"
        in (outputs[0][2])
    )
    outputs = finish(start_processes(workdir, cwd=project))
    assert [code for code, _, _ in outputs] == [0, 0], outputs[0][2] + outputs[1][2]
    assert_same_state(project / workdir, reference, rtol=0, atol=0)


def test_language_model_processes_with_one_device_each_sample_what_one_process_with_both_samples(project: Path):
    """The eval's samples were split over the processes by the compiler, and reading them back on the host ended
    the run at its first eval (a traceback, exit 1, the step's checkpoint lost)."""
    words = ["the", "king", "shall", "speak", "of", "love", "and", "war"]
    rng = np.random.default_rng(0)
    (project / "verses.txt").write_text("\n".join(" ".join(rng.choice(words, size=6)) for _ in range(400)) + "\n")
    (project / "lm.yaml").write_text(
        "model: {name: transformer_lm, num_layers: 1, num_heads: 2, embed_dim: 32}\n"
        "data: {source: verses.txt, tokenizer: bytes, seq_len: 32}\n"
        "train: {batch_size: 8, steps: 2, log_every: 2, eval_every: 2, eval_max_batches: 1, sample_tokens: 16}\n"
    )
    outputs = finish(start_processes("lm-processes", cwd=project, devices=1, config="lm.yaml", settings=()))
    assert [code for code, _, _ in outputs] == [0, 0], outputs[0][2] + outputs[1][2]
    one = train("lm-one-process", cwd=project, devices=2, config="lm.yaml")
    samples = (project / "lm-processes" / "samples" / "2.txt").read_text()
    assert samples.count("--- sample") == 2
    assert samples == (one / "samples" / "2.txt").read_text()


def test_processes_started_with_other_configs_are_refused_by_every_process(project: Path):
    """Process 1 with another train.steps compiled another program: both processes waited for ever in a
    collective (a first SIGTERM waited for the steps under way, which never ended)."""
    outputs = finish(start_processes("disagree", cwd=project, overrides={1: ("train.steps=30",)}), timeout=120)
    for code, _, stderr in outputs:
        assert code == 2, stderr
        assert (
            "error: the processes of this run disagree with process 0 on config key 'train.steps' on process 1; "
            in (stderr)
        )
        assert "the run's length (steps) on process 1: start every process with the same config" in stderr


def test_processes_with_different_numbers_of_devices_are_refused_by_every_process(project: Path):
    """Their first collective ended in a reshape traceback inside JAX."""
    coordinator = f"127.0.0.1:{free_port()}"
    flags = ("--workdir", "uneven-devices", "--coordinator", coordinator, "--num-processes", "2")
    procs = [start("nnx-train", CONFIG, *flags, "--process-id", str(i), cwd=project, devices=3 - 2 * i) for i in (0, 1)]
    for code, _, stderr in finish(procs, timeout=120):
        assert code == 2, stderr
        assert (
            "error: the processes of this run hold different numbers of devices (process 0 has 3, process 1 has 1)"
            in stderr
        )
    assert not (project / "uneven-devices").exists()


def test_processes_that_do_not_share_the_work_dir_are_refused_by_every_process(project: Path):
    """Hosts without a shared file system: each process wrote a work dir of its own, and the run waited for ever
    after its first eval. Here each process runs in a directory of its own."""
    coordinator = f"127.0.0.1:{free_port()}"
    flags = ("--workdir", "run", "--coordinator", coordinator, "--num-processes", "2")
    homes = [project / "host-0", project / "host-1"]
    procs = []
    for i, home in enumerate(homes):
        home.mkdir()
        procs.append(start("nnx-train", CONFIG, *MULTI_PROCESS, *flags, "--process-id", str(i), cwd=home, devices=2))
    for code, _, stderr in finish(procs, timeout=120):
        assert code == 2, stderr
        assert "disagree with process 0 on what they find in the work dir on process 1: put --workdir on a file " in (
            stderr
        )
    assert not (homes[0] / "run" / ".nnx-processes").exists()
    assert not (homes[1] / "run" / "checkpoints").exists()


def test_multi_process_flags_must_describe_a_run(project: Path):
    assert_user_error(
        cli("nnx-train", CONFIG, "--num-processes", "2", "--process-id", "0", cwd=project), "--coordinator"
    )
    assert_user_error(
        cli(
            "nnx-train", CONFIG, "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0", cwd=project
        ),
        "HOST:PORT",
    )
    for port in ("0", "70000"):  # 70000 ended in a traceback, 0 waited for ever
        assert_user_error(
            cli(
                "nnx-train",
                *(CONFIG, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"),
                cwd=project,
                timeout=30,
            ),
            f"--coordinator 127.0.0.1:{port}: the port must be in 1-65535",
        )
    assert_user_error(
        cli(
            "nnx-train",
            CONFIG,
            "--coordinator",
            "127.0.0.1:1",
            "--num-processes",
            "2",
            "--process-id",
            "2",
            cwd=project,
        ),
        "--process-id 2",
    )


def _flatten(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def test_a_signal_ends_a_process_waiting_for_peers_that_never_come(project: Path):
    import socket
    import time

    port = free_port()
    proc = start("nnx-train", CONFIG, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                 "0", "--workdir", "alone", cwd=project, own_pid=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while True:  # process 0 serves the coordinator from inside jax.distributed.initialize, where it then waits
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    time.sleep(SAY_WAITING_AFTER_S + 1)  # it said nothing while it waited (five minutes, then a C++ abort)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)  # it waited five minutes for process 1, deaf to SIGTERM and Ctrl-C
    assert proc.returncode == -signal.SIGTERM
    assert f"waiting for the 2 processes of this run to join at --coordinator 127.0.0.1:{port} (up to 300 s)" in stderr


def test_process_zero_on_a_port_in_use_says_so(project: Path):
    """JAX's coordinator logged one gRPC line and the process crashed (exit 139); its peers waited five minutes."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = cli("nnx-train", CONFIG, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                     "--process-id", "0", "--workdir", "busy", cwd=project)  # fmt: skip
    assert_user_error(result, f"--coordinator 127.0.0.1:{port}: port {port} is in use on this machine")
