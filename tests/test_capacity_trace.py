"""`tokenbatch audit --trace FILE --profile NAME`: the engine-to-capacity mapping (docs/design.md
section 9, tokenbatch_env/capacity_bridge.py), run end to end in-process."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import shared_path
from tokenbatch_env.capacity import (BatchingContract, BatchingWorkload, SchedulerProfile,
                                     VIOLATIONS, audit_batching)
from tokenbatch_env.cli import main
from tokenbatch_env.traces.io import load_trace, save_trace
from tokenbatch_env.traces.trace import Trace


@pytest.fixture(scope="module")
def seed_trace(tmp_path_factory):
    from tokenbatch_env.traces.suites import load_suite

    path = tmp_path_factory.mktemp("audit") / "seed200.npz"
    save_trace(load_suite("seed-200").trace("test", 0), path)
    return path


@pytest.fixture(scope="module")
def azure_head(tmp_path_factory):
    """The first 600 requests of the real Azure code trace (fast, still real traffic)."""
    src = shared_path("traces", "azure_llm_2023", "AzureLLMInferenceTrace_code.csv")
    trace, _ = load_trace(src)
    path = tmp_path_factory.mktemp("audit") / "azure_code_head.npz"
    save_trace(trace.subset(slice(0, 600)), path)
    return path


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, argv):
    rc, out, err = _run(capsys, argv + ["--json"])
    return rc, json.loads(out)


def _check_shape_and_mapping(data):
    assert set(data) == {"audit", "fluid_vs_sim", "mapping"}
    audit, rows, m = data["audit"], data["fluid_vs_sim"], data["mapping"]
    assert audit["decision"] in ("CAPACITY_WITHIN_DECLARED_BOUND", "REJECT_CAPACITY")
    # the engine has no admission control: that violation is always there, by design
    assert audit["violations"][0] == "admission-control-disabled"
    assert all(v in VIOLATIONS for v in audit["violations"])
    assert len(audit["evidence_id"]) == 64
    for row in rows:
        assert set(row) == {"quantity", "fluid", "simulated", "note"}
    names = [r["quantity"] for r in rows]
    for q in ("utilization_permille", "queue_delay_ms", "worst_ttft_ms", "ttft_p99_ms",
              "tpot_ms", "peak_kv_bytes"):
        assert q in names
    by = {r["quantity"]: r for r in rows}
    assert by["utilization_permille"]["fluid"] == audit["total_utilization_permille"]
    assert by["peak_kv_bytes"]["fluid"] == audit["peak_kv_bytes"]
    assert by["peak_kv_bytes"]["simulated"] > 0
    # the derived records pass the audit's own validation, and re-auditing them reproduces it
    contract = BatchingContract.from_dict(m["contract"])
    workload = BatchingWorkload.from_dict(m["workload"])
    sched = SchedulerProfile.from_dict(m["workload"]["scheduler"])
    assert sched.max_prefill_chunk_tokens <= sched.prefill_tokens_per_iteration
    assert sched.max_prefill_chunk_tokens <= m["profile"]["max_num_batched_tokens"]
    assert sched.max_active_sequences == m["profile"]["max_num_seqs"]
    assert sched.kv_bytes_per_token == m["profile"]["kv_bytes_per_token"]
    assert workload.admission_control_enabled is False
    assert sched.token_capacity_per_second == int(
        np.floor(m["lambda_sat_rps"] * (m["mean_prompt_tokens"] + m["mean_output_tokens"])))
    assert audit_batching(contract, workload).to_dict() == audit
    assert len(set(m["scope"])) == 8
    return contract, workload


def test_generated_trace_end_to_end(capsys, seed_trace, tmp_path):
    argv = ["audit", "--trace", str(seed_trace), "--profile", "stress-512"]
    rc, out, err = _run(capsys, argv)
    assert rc in (0, 1) and err == ""
    assert "quantity" in out and "| fluid" in out and "simulated" in out
    assert "decision=" in out and "evidence_id" in out
    assert "by design" in out
    rc_j, data = _json(capsys, argv)
    assert rc_j == rc
    contract, workload = _check_shape_and_mapping(data)
    # one request class per trace class_id (the seed suite carries SLOs and three classes)
    assert len(workload.request_classes) == 3
    assert data["mapping"]["contract_source"].startswith("derived")
    # deterministic: the same evidence id, and the text mode shows it too
    assert data["audit"]["evidence_id"] in out

    # the derived records round-trip through the CONTRACT WORKLOAD mode with the same evidence
    cpath, wpath = tmp_path / "contract.json", tmp_path / "workload.json"
    cpath.write_text(json.dumps(data["mapping"]["contract"]))
    wpath.write_text(json.dumps(data["mapping"]["workload"]))
    rc2, d2 = _json(capsys, ["audit", str(cpath), str(wpath)])
    assert rc2 == rc and d2["evidence_id"] == data["audit"]["evidence_id"]

    # --contract FILE: the workload is built in the contract's scope
    other = dict(data["mapping"]["contract"])
    other.pop("content_id")
    other["scope"] = [f"user-scope-{i}" for i in range(8)]
    other["max_kv_bytes"] = 10**15
    opath = tmp_path / "other.json"
    opath.write_text(json.dumps(other))
    rc3, d3 = _json(capsys, argv + ["--contract", str(opath), "--priority-iterations", "3"])
    assert rc3 in (0, 1)
    assert d3["mapping"]["contract_source"] == "file"
    assert d3["mapping"]["scope"] == other["scope"]
    assert "kv-capacity" not in d3["audit"]["violations"]
    assert d3["mapping"]["workload"]["scheduler"]["max_consecutive_priority_iterations"] == 3
    _check_shape_and_mapping(d3)


def test_trace_without_slos_is_one_class(capsys, tmp_path):
    rng = np.random.default_rng(7)
    n = 60
    trace = Trace.build(arrival_ns=np.sort(rng.integers(0, 20 * 10**9, n)),
                        prompt_tokens=rng.integers(16, 600, n),
                        output_tokens=rng.integers(1, 80, n), name="tiny")
    path = tmp_path / "tiny.csv"
    save_trace(trace, path)
    rc, data = _json(capsys, ["audit", "--trace", str(path), "--profile", "llama2-7b-a100"])
    assert rc in (0, 1)
    _, workload = _check_shape_and_mapping(data)
    assert [c.class_id for c in workload.request_classes] == ["all"]
    assert data["mapping"]["trace"]["slos"].startswith("assigned-default-seed0")


def test_real_trace(capsys, azure_head):
    argv = ["audit", "--trace", str(azure_head), "--profile", "llama2-7b-a100"]
    rc, data = _json(capsys, argv)
    assert rc in (0, 1)
    _check_shape_and_mapping(data)
    m = data["mapping"]
    # prompts >= max_model_len (4096) are rejected at arrival and left out of the demand
    assert m["trace"]["served_requests"] + m["trace"]["rejected_at_arrival"] == 600
    assert m["simulation"]["end_states"].get("rejected", 0) == m["trace"]["rejected_at_arrival"]
    assert m["profile"]["max_num_batched_tokens"] == 2048


@pytest.mark.parametrize("argv, needle", [
    (["--profile", "no-such-profile"], "unknown profile"),
    (["--profile", "stress-512", "--trace-missing"], None),
    (["--profile", "stress-512", "--priority-iterations", "0"], "priority-iterations"),
])
def test_bad_input_exits_2(capsys, seed_trace, argv, needle):
    if "--trace-missing" in argv:
        argv = ["audit", "--trace", "/nonexistent/trace.csv", "--profile", "stress-512"]
        needle = "/nonexistent/trace.csv"
    else:
        argv = ["audit", "--trace", str(seed_trace)] + argv
    rc, out, err = _run(capsys, argv)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_trace_without_profile_exits_2(capsys, seed_trace):
    rc, out, err = _run(capsys, ["audit", "--trace", str(seed_trace)])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--profile" in err


def test_all_rejected_exits_2(capsys, tmp_path):
    trace = Trace.build(arrival_ns=np.arange(12) * 10**8, prompt_tokens=np.full(12, 5000),
                        output_tokens=np.full(12, 4), name="huge")
    path = tmp_path / "huge.csv"
    save_trace(trace, path)
    rc, out, err = _run(capsys, ["audit", "--trace", str(path), "--profile", "llama2-7b-a100"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "max_model_len" in err
