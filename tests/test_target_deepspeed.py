"""The DeepSpeed target (dstest/targets/deepspeed.py and its _deepspeed_*.py modules).

DeepSpeed is an optional extra that CI does not install: the first tests need no DeepSpeed at all, the
next ones skip without it (``pytest.importorskip``) and stay cheap with it (no engine, no process group),
and the ones that build engines in the process world are ``soak`` (the first ``deepspeed.initialize`` of a
machine JIT-builds DeepSpeed's shm_comm op: 7 s on an idle 16-core machine, 85 s on a loaded 2-core one).
The full conformance run against DeepSpeed is ``DS_ACCELERATOR=cpu dstest --target deepspeed --world process``
(findings in docs/deepspeed.md).
"""

from __future__ import annotations

import pickle
import sys
import threading
import types
from typing import Any

import pytest
import torch

import dstest
from dstest.conformance import SpecNet, build, config
from dstest.errors import Deviation, DstestError
from dstest.targets import TARGET_NAMES, Target, get_target
from dstest.targets._deepspeed_errors import crash_is_deviation
from dstest.targets._deepspeed_setup import Mpu, make_parameters_contiguous, translate
from dstest.targets.deepspeed import (
    STRICT_ENV,
    DeepSpeedAdapterError,
    DeepSpeedDeviation,
    DeepSpeedUnavailable,
)

pytestmark = pytest.mark.cpu


# -- without DeepSpeed ------------------------------------------------------------------------------------


def test_registered_and_imported_lazily() -> None:
    assert "deepspeed" in TARGET_NAMES
    # importing the adapter module does not import DeepSpeed (dstest works without it)
    code = "import sys, dstest.targets.deepspeed; assert 'deepspeed' not in sys.modules"
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an absent package looks like to import
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(DeepSpeedUnavailable, match=r"pip install dstest\[deepspeed\]") as err:
        get_target("deepspeed")
    assert isinstance(err.value, ImportError) and isinstance(err.value, DstestError)


def test_deviation_survives_the_trip_from_a_worker() -> None:
    dev = DeepSpeedDeviation("A6", "a layer", "RuntimeError: negative dimension -3", "raised inside DeepSpeed")
    back = pickle.loads(pickle.dumps(dev))
    assert isinstance(back, Deviation) and isinstance(back, AssertionError)
    assert (back.contract, back.expected, back.got, back.explanation) == (
        dev.contract,
        dev.expected,
        dev.got,
        dev.explanation,
    )
    assert str(back) == str(dev)


def _raise_in(filename: str, exc: BaseException) -> None:
    """Raise ``exc`` from a frame whose file is ``filename`` (a stand-in for DeepSpeed's code)."""
    namespace: dict[str, Any] = {}
    exec(compile("def crash(exc):\n    raise exc\n", filename, "exec"), namespace)
    namespace["crash"](exc)


DS_FILE = "/site-packages/deepspeed/sequence/cross_entropy.py"


def test_crash_inside_deepspeed_is_a_deviation() -> None:
    with pytest.raises(DeepSpeedDeviation) as err:
        with crash_is_deviation("A6", "the loss"):
            _raise_in(DS_FILE, RuntimeError("Trying to create tensor with negative dimension -3"))
    dev = err.value
    assert dev.contract == "A6" and dev.got == "RuntimeError: Trying to create tensor with negative dimension -3"
    assert "deepspeed/sequence/cross_entropy.py:2 in crash" in dev.explanation
    assert isinstance(dev.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "filename,exc",
    [
        (DS_FILE, ValueError("documented rejection")),  # contract-level errors pass through unchanged
        (DS_FILE, AssertionError("an assert of DeepSpeed")),
        ("/work/dstest/targets/deepspeed.py", RuntimeError("the adapter's own bug")),  # not DeepSpeed's frame
    ],
)
def test_other_errors_pass_through(filename: str, exc: Exception) -> None:
    with pytest.raises(type(exc)) as err:
        with crash_is_deviation("A6", "the loss"):
            _raise_in(filename, exc)
    assert err.value is exc


def test_translation_of_the_specs_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)
    cfg = config(1, "sum", sparse_gradients=True)
    out = translate(cfg)
    assert out["gradient_clipping"] == 0.0, "the specs' missing clipping means off (DeepSpeed's default is 1.0)"
    assert "sparse_gradients" not in out, "DeepSpeed 0.19.8 rejects the removed key"
    assert "sparse_gradients" in cfg and "gradient_clipping" not in cfg, "the caller's dict is not changed"
    assert translate(config(1, gradient_clipping=0.5))["gradient_clipping"] == 0.5
    monkeypatch.setenv(STRICT_ENV, "1")
    assert translate(cfg) == cfg


def test_non_contiguous_parameters_made_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STRICT_ENV, raising=False)
    model = build(SpecNet)
    w1 = dict(model.named_parameters())["w1"]
    before = w1.detach().clone()
    assert not w1.is_contiguous()
    make_parameters_contiguous(model)
    assert w1.is_contiguous() and torch.equal(w1.detach(), before), "same Parameter, same values"
    monkeypatch.setenv(STRICT_ENV, "1")
    strict = build(SpecNet)
    make_parameters_contiguous(strict)
    assert not dict(strict.named_parameters())["w1"].is_contiguous()


def test_mpu_for_absent_groups() -> None:
    mpu = Mpu(dp_group=torch.distributed.group.WORLD, mp_group=None)
    assert mpu.get_model_parallel_group() is None
    assert mpu.get_model_parallel_world_size() == 1 and mpu.get_model_parallel_rank() == 0
    assert mpu.get_pipeline_model_parallel_world_size() == 1


# -- with DeepSpeed, cheap: no engine, no process group ---------------------------------------------------


@pytest.fixture
def deepspeed(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(STRICT_ENV, raising=False)
    module: types.ModuleType = pytest.importorskip("deepspeed")
    if torch.distributed.is_initialized():  # the adapter would start DeepSpeed's comm backend (a JIT build)
        pytest.skip("a process group is initialised in this process; these tests need none")
    return module


def test_protocol_and_features(deepspeed: types.ModuleType) -> None:
    target = get_target("deepspeed")
    assert isinstance(target, Target)
    assert target.name == "deepspeed" and target.third_party is True
    for feature in ("stage0", "stage1", "stage2", "stage3", "compute_grad_norm", "collective_counts", "state_bytes",
                    "checkpoint", "config_check", "is_parallel", "tensor_parallel_linear", "mp_group"):  # fmt: skip
        assert target.supports(feature), feature
    # what the adapter cannot observe is not claimed (the specs skip it)
    assert not target.supports("comm_buffer_bytes") and not target.supports("grad_multiplier")
    from deepspeed.accelerator import get_accelerator

    assert target.supports("fp16") is bool(get_accelerator().is_fp16_supported())


def test_check_config_is_deepspeeds_validation(deepspeed: types.ModuleType) -> None:
    target = get_target("deepspeed")
    target.check_config(config(2, "SUM"))
    with pytest.raises(target.config_errors, match="gradient_allreduce_op"):
        target.check_config(config(0, "avg"))
    with pytest.raises(target.config_errors, match="compute_grad_norm"):
        target.check_config(config(0, zero={"compute_grad_norm": False}))


def test_optional_group_guard_without_a_world(deepspeed: types.ModuleType) -> None:
    """A1: None is absent and touches no process group, so it works before torch.distributed starts."""
    assert not torch.distributed.is_initialized()
    target = get_target("deepspeed")
    assert target.is_parallel(None) is False
    t = torch.ones(3)
    assert target.all_reduce(t, None) is t and torch.equal(t, torch.ones(3))


def test_refuses_threads_and_a_missing_world(deepspeed: types.ModuleType) -> None:
    caught: list[BaseException] = []

    def construct() -> None:
        try:
            get_target("deepspeed")
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=construct)
    thread.start()
    thread.join()
    assert len(caught) == 1 and isinstance(caught[0], DeepSpeedAdapterError)
    assert "process world" in str(caught[0])
    with pytest.raises(DeepSpeedAdapterError, match="process world"):
        get_target("deepspeed").initialize(build(), config(1))
    # a failure of the run, never a deviation of DeepSpeed
    from dstest.report import classify

    assert classify(caught[0], third_party=True)[0] == "fail"


def test_config_errors_are_not_crashes(deepspeed: types.ModuleType) -> None:
    from deepspeed.runtime.config import DeepSpeedConfigError

    exc = DeepSpeedConfigError("a removed key")
    with pytest.raises(DeepSpeedConfigError):
        with crash_is_deviation("B7", "a config error"):
            _raise_in(DS_FILE, exc)
    assert isinstance(exc, get_target("deepspeed").config_errors)


def test_collective_counter_counts_outermost_calls(
    deepspeed: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deepspeed.comm import comm as ds_comm

    from dstest.targets._deepspeed_engine import CollectiveCounter

    class FakeBackend:
        def all_reduce(self, tensor: Any, group: Any = None) -> None:
            return None

        def all_gather_into_tensor(self, out: Any, inp: Any, group: Any = None) -> None:
            self.all_gather(out, inp)  # a collective built on another one counts once

        def all_gather(self, out: Any, inp: Any, group: Any = None) -> None:
            return None

    cdb = FakeBackend()
    preset = lambda *a, **k: None  # noqa: E731 - an instance attribute someone else installed
    cdb.barrier = preset  # type: ignore[attr-defined]
    monkeypatch.setattr(ds_comm, "cdb", cdb)
    counter = CollectiveCounter()
    with counter.counting():
        cdb.all_reduce(None)
        cdb.all_reduce(None)
        cdb.all_gather_into_tensor(None, None)
        cdb.barrier()  # type: ignore[attr-defined]
    assert counter.counts == {"all_reduce": 2, "all_gather_into_tensor": 1, "barrier": 1}
    assert "all_reduce" not in vars(cdb) and cdb.barrier is preset, "the backend is restored as it was"  # type: ignore[attr-defined]
    cdb.all_reduce(None)
    assert counter.counts["all_reduce"] == 2, "nothing is counted outside the window"


# -- with DeepSpeed, engines in the process world (soak: JIT build, seconds per engine on a loaded machine) --


def _process_run(fn: Any, world_size: int, **kwargs: Any) -> list[Any]:
    return dstest.run(fn, world_size, world="process", kwargs=kwargs, target="deepspeed", timeout=600)


@pytest.mark.soak
@pytest.mark.parametrize("world_size", [2, 3])
def test_optional_group_specs_pass(deepspeed: types.ModuleType, world_size: int) -> None:
    from dstest.conformance import optional_groups as a

    for spec in (a.test_a1_none_is_absent, a.test_a3_single_rank_group, a.test_a4_non_member):
        _process_run(spec, world_size)
    _process_run(a.test_a5_guarded_all_reduce, world_size, kind="non_member")


@pytest.mark.soak
def test_engine_specs_pass_run_after_run(deepspeed: types.ModuleType) -> None:
    """Engines in consecutive runs of one pool: the groups DeepSpeed cached in the first run were destroyed
    with it, so the adapter must have released them (else "Group ... is not registered")."""
    from dstest.conformance import grad_reduction as b

    for _ in range(2):
        _process_run(b.test_b2_sum_is_w_times_mean, 2, stage=1, path="reduce_scatter")
        _process_run(b.test_b8_sum_over_w_trains_like_mean, 2, stage=2, optimizer="AdamW")


@pytest.mark.soak
def test_a_finding_is_a_deviation_not_a_failure(deepspeed: types.ModuleType) -> None:
    """B8 at stage 3: DeepSpeed 0.19.8 rejects "sum" with ZeRO-3; the CLI reports a deviation."""
    from dstest.conformance import grad_reduction
    from dstest.errors import RankFailure
    from dstest.report import classify

    with pytest.raises(RankFailure) as err:
        _process_run(grad_reduction.test_b8_stage3_sum_over_w_trains_like_mean, 2, optimizer="SGD")
    assert "not supported with ZeRO stage 3" in str(err.value)
    status, detail, _ = classify(err.value, third_party=True)
    assert status == "deviation", detail


@pytest.mark.soak
def test_cli_against_deepspeed(deepspeed: types.ModuleType, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dstest.cli import main

    out = tmp_path / "ds.json"
    code = main(["--target", "deepspeed", "--world", "process", "-k", "test_a6_tensor_parallel_linear_pair",
                 "--world-sizes", "2", "--json", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().out  # deviations of a third-party target do not fail the run
    results = {r["params"]: r for r in json.loads(out.read_text())}
    assert results["non_member"]["status"] == "deviation", results["non_member"]
    assert "tp_size=-1" in results["non_member"]["detail"]
    assert {results[k]["status"] for k in ("absent", "single", "multi")} == {"pass"}
