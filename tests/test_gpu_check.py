"""scripts/gpu_check.sh, scripts/gpu_wheels.sh and the calibration's CPU side, run for real.

What needs a GPU (the peak memory of a step, training on CUDA) is left to the lent device. Here
run: the argument handling, the install of the carried wheels (wheels built in the test, so no
registry is needed), the prediction side of the calibration against the estimator, one measured
step of the tiny shape on the CPU, and the verdicts on run folders made here. One test mocks the
CUDA allocator's counters (`ScriptedCounters`: there is no GPU here) to run the bookkeeping of a
GPU measurement around a real CPU step; the verdicts' GPU inputs (a calibration.json with peaks)
are written by hand.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mars2.models.memory import GPU_GIB, AgentPlan, ClusterPlan, ModelShape, estimate
from mars2.training import calibration

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
PINNED = [
    line.split("#")[0].strip()
    for line in (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    if line.split("#")[0].strip()
]


def _load_verdicts() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verdicts = _load_verdicts()


def _stem(spec: str) -> tuple[str, str]:
    name, version = spec.split("==")
    return re.sub(r"[-.]", "_", name.lower()), version


def make_wheel(directory: Path, stem: str, version: str) -> Path:
    """A valid pure-Python wheel holding one module, `fake_<stem>_<version>` (nothing it could
    shadow): what pip installs from it shows that this very file was installed."""
    module = f"fake_{stem}_{version.replace('.', '_')}"
    info = f"{stem}-{version}.dist-info"
    files = {
        f"{module}.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {stem}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = directory / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    """Every pinned wheel, plus another version of the first (which must not be installed)."""
    directory = tmp_path / "whl"
    directory.mkdir()
    for spec in PINNED:
        make_wheel(directory, *_stem(spec))
    make_wheel(directory, _stem(PINNED[0])[0], "0.0.1")
    return directory


def run_check(tmp_path: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    # generous limits: this machine is shared and slow; the defaults are sized for the device
    limits = {f"LIMIT_{step}": "900" for step in ("SETUP", "TRAIN", "EVAL", "CALIBRATE", "TERMS")}
    env = {**os.environ, **limits, "OUT": str(tmp_path / "out")}
    env.pop("PYTHONPATH", None)
    command = ["bash", str(SCRIPT), "--python", sys.executable, "--work", str(tmp_path / "work"),
               "--site", str(tmp_path / "site"), *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


# -- arguments and the carried wheels ---------------------------------------------------------


def test_unknown_steps_and_arguments_are_refused(tmp_path: Path) -> None:
    bad_step = run_check(tmp_path, "--steps", "setup,warp")
    assert bad_step.returncode == 2
    assert "unknown step 'warp'" in bad_step.stderr
    bad_flag = run_check(tmp_path, "--frobnicate")
    assert bad_flag.returncode == 2
    assert "unknown argument '--frobnicate'" in bad_flag.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran
    helped = run_check(tmp_path, "--help")
    assert helped.returncode == 0
    assert "timeout_s=570" in helped.stdout and "--steps LIST" in helped.stdout


def test_setup_without_wheels_fails_naming_them_and_the_fix(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_check(tmp_path, "--wheels", str(empty), "--cpu", "--steps", "eval")
    assert result.returncode == 1
    line = next(x for x in result.stdout.splitlines() if x.startswith("FAIL setup:"))
    for spec in PINNED:
        assert spec in line
    assert "scripts/gpu_wheels.sh" in line and 'carry=["' in line
    assert "nothing else can run" in result.stdout
    assert not (tmp_path / "out" / "train.log").exists()  # no later step started
    assert line in (tmp_path / "out" / "gpu_check.log").read_text()


def test_setup_installs_exactly_the_pinned_wheels(tmp_path: Path, wheels: Path) -> None:
    result = run_check(
        tmp_path, "--steps", "setup", "--wheels", str(wheels), "--cpu", "--no-install"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.splitlines()[0]
    assert line.startswith("PASS setup: hydra ") and "no GPU (--cpu)" in line
    assert "mars2 from src/ on PYTHONPATH" in line
    # what the local sandbox can have with this interpreter, as the sandbox itself plans it
    from mars2.sandbox.container.policy import plan

    missing = plan("best_effort").missing
    if missing:
        assert line.endswith("sandbox.isolation=best_effort, it lacks " + "; ".join(missing))
    else:
        assert line.endswith("; sandbox fully isolated")
    site = tmp_path / "site"
    for spec in PINNED:
        stem, version = _stem(spec)
        assert (site / f"fake_{stem}_{version.replace('.', '_')}.py").is_file(), spec
    assert not list(site.glob("fake_*_0_0_1.py"))  # the other version stayed out


def test_setup_wants_a_gpu_unless_told_cpu(tmp_path: Path, wheels: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    result = run_check(tmp_path, "--steps", "setup", "--wheels", str(wheels), "--no-install")
    assert result.returncode == 1
    assert result.stdout.startswith("FAIL setup: no CUDA GPU visible")


def test_setup_reports_a_broken_wheel(tmp_path: Path, wheels: Path) -> None:
    stem, version = _stem(PINNED[1])
    (wheels / f"{stem}-{version}-py3-none-any.whl").write_bytes(b"not a zip")
    result = run_check(
        tmp_path, "--steps", "setup", "--wheels", str(wheels), "--cpu", "--no-install"
    )
    assert result.returncode == 1
    assert result.stdout.startswith("FAIL setup: pip could not install the wheels")


def test_gpu_wheels_keeps_pinned_wheels_and_drops_other_versions(
    tmp_path: Path, wheels: Path
) -> None:
    """Every pinned wheel is already there, so no registry is asked."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(wheels)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("have ")] == [
        f"have {spec}" for spec in PINNED
    ]
    assert "removing" in result.stdout
    assert sorted(p.name for p in wheels.iterdir()) == sorted(
        f"{_stem(s)[0]}-{_stem(s)[1]}-py3-none-any.whl" for s in PINNED
    )


@pytest.mark.slow
def test_dry_run_prints_each_step_and_the_predictions(tmp_path: Path, wheels: Path) -> None:
    result = run_check(tmp_path, "--dry-run", "--wheels", str(wheels))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for step in ("setup", "train", "eval", "calibrate", "terms"):
        assert sum(x.startswith(f"DRY {step}: ") for x in lines) == 1, step
    cases = [x.strip() for x in lines if x.strip().startswith("CASE ")]
    expected = calibration.cases()
    assert len(cases) == len(expected) == 8
    for line, case in zip(cases, expected):
        predicted = calibration.predict(
            case, calibration.write_model_dir(case.shape, tmp_path), "h200"
        )
        assert line.startswith(f"CASE {case.label}: predicted {predicted['train_peak']:.4g} GiB")
    assert "0 of 5 step(s) failed" in result.stdout


# -- the calibration's prediction side ---------------------------------------------------------


@pytest.mark.parametrize("case", calibration.cases(), ids=lambda c: c.label)
def test_prediction_is_the_estimate_of_the_stated_settings(tmp_path: Path, case: Any) -> None:
    """The composed config must mean what the case says: the estimator, fed by hand with the
    shape, LoRA r=64 or full fine-tuning (with the KL reference the agent's beta asks for), bf16,
    gradient checkpointing, one sample of prompt + completion tokens, bf16-mixed and no engine,
    gives the same terms."""
    predicted = calibration.predict(case, calibration.write_model_dir(case.shape, tmp_path), "h200")
    shape = ModelShape.from_mapping(calibration.SHAPES[case.shape])
    plan = AgentPlan(
        name=calibration.AGENT, shape=shape, dtype="bfloat16",
        lora_r=64 if case.mode == "lora" else None, reference=case.mode == "full",
        gradient_checkpointing=True, micro_batch_size=1,
        seq_len=case.prompt_tokens + case.completion_tokens, mixed_precision=True,
    )  # fmt: skip
    by_hand = estimate([plan], ClusterPlan(gpu_gib=GPU_GIB["h200"]))
    assert [(t["name"], t["phase"]) for t in predicted["terms"]] == [
        (t.name, t.phase) for t in by_hand.terms
    ]
    assert [t["gib"] for t in predicted["terms"]] == pytest.approx([t.gib for t in by_hand.terms])
    assert predicted["train_peak"] == pytest.approx(by_hand.train_peak)
    assert not any("vLLM" in t["name"] for t in predicted["terms"])
    assert predicted["resident"] + predicted["step"] + predicted["overhead"] == pytest.approx(
        predicted["train_peak"]
    )


def test_cases_refuse_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        calibration.Case("qwen3-99b", "lora", 4096)
    with pytest.raises(ValueError, match="unknown mode"):
        calibration.Case("tiny", "qlora", 4096)
    with pytest.raises(ValueError, match=">= 1"):
        calibration.Case("tiny", "full", 0)
    assert calibration.main(["--shape", "tiny", "--completion-tokens", "0", "--predict-only"]) == 2


# -- one measured step on the CPU --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_one_cpu_step_holds_the_tensors_the_estimate_counts(
    tmp_path: Path, tiny_models_dir: Path, mode: str
) -> None:
    """Weights, gradients, AdamW states and the reference, counted from the tensors of a real
    step, against the estimate's resident terms (LoRA adapters fp32, bf16 states, a reference
    copy only for full fine-tuning): within 1%."""
    case = calibration.Case("tiny", mode, 64, prompt_tokens=32, lora_r=8)
    model_dir = calibration.write_model_dir("tiny", tmp_path, tiny_models_dir / "tiny_qwen3")
    assert not list(model_dir.glob("*.safetensors"))  # random weights: no file to load
    record = calibration.run_case(case, model_dir, "h200", "cpu")
    assert record["status"] == "measured", record["status"]
    measured = record["measured"]
    assert measured["grad_norm"] > 0
    assert "peak_allocated" not in measured  # the peak needs CUDA
    tensors = measured["tensors"]
    assert (tensors["reference"] > 0) == (mode == "full")
    assert (tensors["frozen"] > 0) == (mode == "lora")
    assert record["ratios"]["tensors/resident"] == pytest.approx(1.0, abs=0.01)
    assert record["predicted"]["resident"] == pytest.approx(tensors["total"], rel=0.01)


@pytest.mark.slow
def test_calibration_cli_on_cpu_writes_the_report(tmp_path: Path, tiny_models_dir: Path) -> None:
    out = tmp_path / "calibration.json"
    code = calibration.main([
        "--shape", "tiny", "--device", "cpu", "--completion-tokens", "64", "--prompt-tokens",
        "32", "--lora-r", "8", "--mode", "lora", "--work", str(tmp_path), "--out", str(out),
        "--tokenizer", str(tiny_models_dir / "tiny_qwen3"),
    ])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    assert [c["case"] for c in report["cases"]] == ["tiny lora r=8 64"]
    ok, detail = verdicts.calibration(out, cpu=True)
    assert ok and "1 of 1 cases within 15% (tensors/resident)" in detail
    assert "GPU only, not measured here: activations, logits" in detail  # says what is left
    assert not verdicts.calibration(out)[0]  # a GPU verdict needs GPU peaks


class ScriptedCounters:
    """Stands in for the CUDA allocator's statistics (mocked: there is no GPU here), so that the
    bookkeeping of a GPU measurement runs around a real CPU step: scripted GiB values in the
    order `measure` reads them."""

    def __init__(self) -> None:
        self.allocations = iter([0.25, 1.25, 3.25, 3.5])  # base, weights, resident, after
        self.peaks = iter([5.25, 6.25])  # first step, measured step
        self.resets = 0

    def allocated(self) -> float:
        return next(self.allocations)

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_allocated(self) -> float:
        return next(self.peaks)

    def peak_reserved(self) -> float:
        return 7.0

    def outside_torch(self) -> float:
        return 0.5


@pytest.mark.slow
def test_gpu_bookkeeping_around_a_real_step(tmp_path: Path, tiny_models_dir: Path) -> None:
    case = calibration.Case("tiny", "lora", 64, prompt_tokens=32, lora_r=8)
    model_dir = calibration.write_model_dir("tiny", tmp_path, tiny_models_dir / "tiny_qwen3")
    cfg = calibration.case_config(case, model_dir, "h200")
    counters = ScriptedCounters()
    measured = calibration.measure(case, cfg, "cpu", counters)  # type: ignore[arg-type]
    assert counters.resets == 2  # before the warm-up step and before the measured one
    assert measured["weights"] == 1.0 and measured["resident"] == 3.0
    assert measured["first_step_peak_allocated"] == 5.0 and measured["after_step"] == 3.25
    assert measured["peak_allocated"] == 6.0 and measured["device_peak"] == 7.5
    predicted = calibration.predict(case, model_dir, "h200")
    ratios = calibration.compare(predicted, measured)
    assert ratios["allocated/agent_terms"] == pytest.approx(
        6.0 / (predicted["train_peak"] - predicted["overhead"])
    )
    assert ratios["device/estimate"] == pytest.approx(7.5 / predicted["train_peak"])
    record = {"case": case.label, "predicted": predicted, "measured": measured,
              "status": "measured", "ratios": ratios}  # fmt: skip
    line = calibration.describe(record)
    assert "peak allocated 6 vs agent terms" in line
    assert "device peak 7.5 (reserved 7 + outside torch 0.5)" in line


def test_budget_stops_starting_cases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.json"
    code = calibration.main(
        ["--predict-only", "--budget-s", "-1", "--work", str(tmp_path), "--out", str(out)]
    )
    assert code == 0
    statuses = [c["status"] for c in json.loads(out.read_text())["cases"]]
    assert statuses == ["not run: out of time budget"] * 8
    assert capsys.readouterr().out.count("out of time budget") == 8


# -- the verdicts ------------------------------------------------------------------------------


def make_run(
    folder: Path, steps: dict[int, dict[str, float]], weights: dict[str, torch.Tensor], gpu: bool
) -> Path:
    (folder / "csv" / "version_0").mkdir(parents=True)
    keys = sorted({k for row in steps.values() for k in row})
    with (folder / "csv" / "version_0" / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", *keys])
        writer.writeheader()
        for step, row in steps.items():
            writer.writerow({"step": step, **row})
    (folder / "agents" / "a").mkdir(parents=True)
    save_file(weights, str(folder / "agents" / "a" / "model.safetensors"))
    used = "True" if gpu else "False"
    (folder / "train.log").write_text(f"GPU available: {used} (cuda), used: {used}\n")
    return folder


def test_train_verdict_wants_reward_and_an_exact_resume(tmp_path: Path) -> None:
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    rows = {
        0: {"reward": 0.25, "a/loss": 0.5, "rollout_seconds": 3.0},
        1: {"reward": 0.0, "a/loss": 0.25, "rollout_seconds": 2.0},
        2: {"reward": 0.125, "a/loss": 0.125, "rollout_seconds": 2.5},
    }
    first = make_run(tmp_path / "first", rows, weights, gpu=True)
    resumed_rows = {s: {**rows[s], "rollout_seconds": 9.0} for s in (1, 2)}  # timings differ
    same = make_run(tmp_path / "same", resumed_rows, weights, gpu=True)
    ok, detail = verdicts.train(first, same)
    assert ok, detail
    assert "steps [1, 2] compared" in detail

    drifted = {**resumed_rows, 2: {**resumed_rows[2], "a/loss": 0.126}}
    other = {"w": weights["w"] + torch.tensor([0, 0, 0, 0, 0, 1e-6])}
    bad = make_run(tmp_path / "bad", drifted, other, gpu=True)
    ok, detail = verdicts.train(first, bad)
    assert not ok
    assert "step 2 a/loss: 0.125 != 0.126" in detail and "1 of 1 weight tensors differ" in detail

    on_cpu = make_run(tmp_path / "cpu", resumed_rows, weights, gpu=False)
    ok, detail = verdicts.train(first, on_cpu)
    assert not ok and "cpu did not train on the gpu" in detail
    assert verdicts.train(make_run(tmp_path / "c1", rows, weights, False), on_cpu, "cpu")[0]

    zero = {s: {**r, "reward": 0.0} for s, r in rows.items()}
    ok, detail = verdicts.train(make_run(tmp_path / "zero", zero, weights, True), same)
    assert not ok and "no reward > 0 in zero" in detail


def test_eval_verdict_wants_the_checkpoint_loaded_and_a_solve(tmp_path: Path) -> None:
    results = [
        {"name": "a", "metrics": {"pass@1": 0.0}},
        {"name": "team+tree", "metrics": {"pass@1(mcts)": 0.375}},
    ]
    (tmp_path / "results.json").write_text(json.dumps(results))
    (tmp_path / "eval.log").write_text("... loaded trained agents from /x/last.ckpt\n")
    ok, detail = verdicts.evaluation(tmp_path)
    assert ok and "team+tree 0.375" in detail
    (tmp_path / "eval.log").write_text("nothing loaded\n")
    ok, detail = verdicts.evaluation(tmp_path)
    assert not ok and "does not say it loaded ckpt_path" in detail


def test_calibration_verdict_holds_the_estimate_to_15_percent(tmp_path: Path) -> None:
    def case(name: str, status: str, ratio: float | None, fits: bool = True) -> dict[str, Any]:
        ratios = {} if ratio is None else {"device/estimate": ratio}
        return {"case": name, "status": status, "ratios": ratios, "predicted": {"fits": fits}}

    def verdict(*cases: dict[str, Any]) -> tuple[bool, str]:
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"environment": {"gpu": "NVIDIA H200"}, "cases": list(cases)}))
        return verdicts.calibration(path)

    assert verdict(case("a", "measured", 0.9), case("b", "out of memory: x", None, fits=False))[0]
    ok, detail = verdict(case("a", "measured", 0.9), case("b", "measured", 1.2))
    assert not ok and "b 1.20" in detail and "1 of 2 cases within 15%" in detail
    ok, detail = verdict(case("a", "measured", 1.0), case("b", "out of memory: x", None))
    assert not ok and "not measured: b" in detail  # the estimate said it fits
    assert not verdict(case("a", "error: boom", None))[0]


# -- terms: issue #43's assumptions measured next to the plan ------------------------------------


def test_terms_step_measures_each_term_on_the_cpu(tmp_path: Path, tiny_models_dir: Path) -> None:
    """scripts/gpu_terms.py for real, on the CPU (small head; the allocator peaks are CUDA only)."""
    out = tmp_path / "terms.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    command = [sys.executable, str(REPO / "scripts" / "gpu_terms.py"), "--out", str(out),
               "--tiny", str(tiny_models_dir), "--device", "cpu", "--small"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    records = {r["term"]: r for r in json.loads(out.read_text())["terms"]}
    assert set(records) == {"sharding", "sync", "k3_kl", "logprobs", "allocator", "engines"}
    for term in ("sharding", "sync", "k3_kl", "logprobs", "allocator"):
        assert records[term]["ok"] is True, records[term]
    assert records["sharding"]["measured"] == records["sharding"]["planned"]  # world 1
    assert records["engines"]["ok"] is None  # no vLLM on the lent machine: planned only
    assert "expandable_segments:True" in records["allocator"]["note"]
    ok, line = verdicts.terms(out)
    assert ok and "k3_kl measured" in line and "(not measured)" in line


def test_terms_verdict_fails_on_a_term_off_the_plan(tmp_path: Path) -> None:
    def record(term: str, ok: bool | None) -> dict[str, Any]:
        return {"term": term, "planned": 1.0, "measured": 2.0, "unit": "MiB", "ok": ok,
                "note": f"{term} note"}  # fmt: skip

    path = tmp_path / "terms.json"
    path.write_text(json.dumps({"gpu": "H200", "terms": [record("sync", True),
                                                          record("engines", None)]}))  # fmt: skip
    ok, line = verdicts.terms(path)
    assert ok and line.startswith("on H200: sync measured 2.0 vs planned 1.0 MiB (ok)")
    path.write_text(json.dumps({"gpu": "H200", "terms": [record("sharding", False)]}))
    ok, line = verdicts.terms(path)
    assert not ok and "off: sharding: sharding note" in line
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "terms",
                             str(path)], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 1 and result.stdout.startswith("FAIL terms: on H200")
