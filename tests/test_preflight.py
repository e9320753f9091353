"""Every check that can run before the warm start runs before it, whether or not
`hydra.run.dir` or `-m` is given: each mistake ends in one paragraph naming the fix, before any
folder is made. (In-process `preflight`, as the console scripts call it; torch here has no CUDA
and vLLM is absent from this venv, which is what the first two cases need: they are skipped where
that is not so.)"""

from __future__ import annotations

import http.server
import importlib.util
import socket
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mars2.cli.errors import user_errors
from mars2.cli.preflight import preflight, sweep_jobs
from mars2.utils.environment import check_tracking_server
from mars2.utils.runs import register_resolver
from mars2.utils.validation import ConfigError

register_resolver()

BASE = ["experiment=tiny_pair", "data=arith"]
WAYS = ("plain", "hydra.run.dir", "-m")


def _argv(way: str, tmp: Path, *overrides: str) -> list[str]:
    argv = [*BASE, f"paths.log_dir={tmp / 'logs'}", *overrides]
    if way == "hydra.run.dir":
        argv.append(f"hydra.run.dir={tmp / 'run'}")
    if way == "-m":
        argv = ["-m", *argv, "seed=1,2"]
    return argv


def _refused(way: str, tmp: Path, *overrides: str) -> str:
    with pytest.raises(user_errors()) as caught:
        preflight("train", _argv(way, tmp, *overrides))
    message = str(caught.value)
    assert "\n" not in message.strip() and "Traceback" not in message
    assert not (tmp / "run").exists() and not (tmp / "logs").exists()  # no folder made
    return message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("trainer", ["gpu", "ddp"])
def test_a_gpu_trainer_without_a_gpu_names_the_cpu_settings(
    tmp_path: Path, way: str, trainer: str
) -> None:
    message = _refused(way, tmp_path, f"trainer={trainer}")
    assert "trainer.accelerator=cpu trainer.devices=2" in message


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
@pytest.mark.parametrize("way", WAYS)
def test_a_backend_without_its_packages_names_the_install(tmp_path: Path, way: str) -> None:
    message = _refused(way, tmp_path, "agents.tiny_qwen3.generation.backend=vllm")
    assert "agents.tiny_qwen3.generation.backend=vllm" in message
    assert "pip install '.[gpu]'" in message


@pytest.mark.parametrize("way", WAYS)
def test_a_missing_checkpoint_is_refused(tmp_path: Path, way: str) -> None:
    message = _refused(way, tmp_path, f"ckpt_path={tmp_path / 'nonexistent.ckpt'}")
    assert "no such checkpoint" in message and "checkpoints/" in message


@pytest.mark.parametrize("way", WAYS)
def test_a_file_that_is_not_a_checkpoint_is_refused(tmp_path: Path, way: str) -> None:
    fake = tmp_path / "x.ckpt"
    fake.write_text("not a checkpoint")
    assert "is not a checkpoint" in _refused(way, tmp_path, f"ckpt_path={fake}")


@pytest.mark.parametrize("way", WAYS)
def test_a_run_folder_or_its_agents_folder_as_checkpoint_names_the_file(
    tmp_path: Path, way: str
) -> None:
    run = tmp_path / "old"
    (run / "checkpoints").mkdir(parents=True)
    (run / "agents" / "tiny_qwen3").mkdir(parents=True)
    with zipfile.ZipFile(run / "checkpoints" / "last.ckpt", "w") as archive:
        archive.writestr("data.pkl", b"")
    last = str(run / "checkpoints" / "last.ckpt")
    message = _refused(way, tmp_path, f"ckpt_path={run}")
    assert f"ckpt_path={last}" in message and f"resume={run}" in message
    message = _refused(way, tmp_path, f"ckpt_path={run / 'agents'}")
    assert "Hugging Face export" in message and f"ckpt_path={last}" in message


@pytest.mark.parametrize("way", WAYS)
def test_a_data_folder_is_one_paragraph(tmp_path: Path, way: str) -> None:
    folder = tmp_path / "deepcoder"
    folder.mkdir()
    message = _refused(way, tmp_path, "data=deepcoder", f"data.train.path={folder}")
    assert f"data.train.path={folder} is a folder" in message and "jsonl file" in message


def test_a_typo_in_a_sweep_names_the_nearest_setting(tmp_path: Path) -> None:
    with pytest.raises(user_errors(), match="did you mean seed"):
        preflight("train", ["-m", *BASE, "sed=1,2"])


def test_every_job_of_a_sweep_is_checked() -> None:
    jobs = sweep_jobs(["experiment=tiny_pair", "seed=1,2", "trainer=cpu,gpu"])
    assert len(jobs) == 4 and ["experiment=tiny_pair", "seed=2", "trainer=gpu"] in jobs


def test_cfg_hydra_resolve_prints_the_run_folder(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        preflight("train", [*BASE, f"paths.log_dir={tmp_path}", "--cfg", "hydra", "--resolve"])
    assert stop.value.code == 0
    assert f"dir: {tmp_path}/train/runs/tiny_pair/" in capsys.readouterr().out


class _BrokenSandbox:
    def run_batch(self, jobs: list) -> list:
        raise RuntimeError("bwrap: execvp .venv/bin/python: No such file or directory")


def test_a_sandbox_that_cannot_run_a_job_stops_before_any_model_loads() -> None:
    from mars2.training.run import check_sandbox
    from mars2.utils.validation import ConfigError

    with pytest.raises(ConfigError, match="could not run one test job: bwrap: execvp"):
        check_sandbox(_BrokenSandbox())


def test_the_real_sandbox_passes_its_probe() -> None:
    from mars2.sandbox.pool.local import LocalSandbox
    from mars2.training.run import check_sandbox

    with LocalSandbox(num_workers=1, per_test_timeout=2.0) as box:
        check_sandbox(box)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["agents.tiny_lama.loss.variant=dapo"], "no agent 'tiny_lama' in this experiment; did you mean agents.tiny_llama?"),
        (["generation.backend=vllm"], "generation is a per-agent setting: set it for each agent (agents.tiny_qwen3.generation.backend"),
        (["tiny_pair"], "did you mean experiment=tiny_pair?"),
    ],
)  # fmt: skip
def test_unknown_agents_and_bare_words_name_the_fix(argv: list[str], said: str) -> None:
    base = [] if argv == ["tiny_pair"] else ["experiment=tiny_pair"]
    with pytest.raises(user_errors()) as caught:
        preflight("train", [*base, *argv])
    assert said in str(caught.value)


def test_eval_without_a_checkpoint_refuses_unless_untrained_is_asked_for(tmp_path: Path) -> None:
    argv = [*BASE, "data=humaneval", "eval.limit=1", f"paths.log_dir={tmp_path}"]
    with pytest.raises(user_errors(), match=r"eval\.allow_untrained=true") as caught:
        preflight("eval", argv)
    assert "tiny_qwen3" in str(caught.value) and "ckpt_path=<run folder>" in str(caught.value)
    preflight("eval", [*argv, "eval.allow_untrained=true"])  # a baseline on purpose
    preflight("eval", [*argv, "generation.backend=reference"])  # no weights are scored
    assert not list(tmp_path.iterdir())


def _refused_port() -> int:
    with socket.socket() as probe:  # a port nothing listens on once the socket is closed
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("way", WAYS)
def test_an_mlflow_server_that_refuses_connections_is_one_paragraph(
    tmp_path: Path, way: str
) -> None:
    url = f"http://127.0.0.1:{_refused_port()}"
    began = time.monotonic()
    message = _refused(way, tmp_path, f"logger.tracking_uri={url}")
    assert f"logger.tracking_uri={url} does not answer" in message and "mlflow server" in message
    assert time.monotonic() - began < 60  # not MLflow's minutes of retries


def test_an_mlflow_server_that_answers_passes(tmp_path: Path) -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = OmegaConf.create(
            {"logger": {"tracking_uri": f"http://127.0.0.1:{server.server_port}"}}
        )
        check_tracking_server(cfg)  # no error: it answers
        down = OmegaConf.create({"logger": {"tracking_uri": f"http://127.0.0.1:{_refused_port()}"}})
        with pytest.raises(ConfigError, match="does not answer"):
            check_tracking_server(down)
    finally:
        server.shutdown()
