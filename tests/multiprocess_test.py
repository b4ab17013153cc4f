"""Dispatch/combine over 2 processes x 4 CPU devices via jax.distributed (gloo); a dead peer.

Every test launches tests/mp_worker.py twice (tests/mp_launch.py) on a (node=2, local=4) mesh,
"node" being the process. One launch covers a dropless and a capacity case, values and gradients
(x, topk_weights, expert weights) against the dense reference; the workers report JSON and both
must exit 0. The dead-peer tests check that a process whose peer died abruptly is ended by the
distributed runtime's heartbeat check within 60 s instead of hanging in a collective.
"""

import pytest
from mp_launch import launch, tails

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER_TIMEOUT_S = 240
DEAD_PEER_LIMIT_S = 60
TOL_OUT, TOL_GRAD = 1e-5, 1e-4


def _run_check(backend, levels):
    procs = launch(
        f"--backend={backend}", f"--levels={levels}", "--case=check", timeout_s=WORKER_TIMEOUT_S
    )
    assert [p.returncode for p in procs] == [0, 0], tails(procs)
    results = [p.result for p in procs]
    assert None not in results, tails(procs)
    # Both hosts gathered the same global arrays and built the same reference.
    assert results[0] == results[1], tails(procs)
    assert results[0]["single_process"] is False  # the EP group really spans both processes
    return results[0], procs


def _assert_matches_dense(result, procs):
    assert result["status"] == "ok", result.get("error")
    for name, case in result["cases"].items():
        msg = f"{name}: {case}\n{tails(procs)}"
        assert case["err_out"] < TOL_OUT, msg
        for grad in ("err_grad_x", "err_grad_weights", "err_grad_experts"):
            assert case[grad] < TOL_GRAD, msg
        assert case["kept_matches_model"], msg
        assert case["dropped"] == case["dropped_model"], msg
        assert case["invalid"] == case["invalid_model"], msg
        assert case["no_expert_ids"] > 0, msg  # the routing did exercise "-1"
    assert result["cases"]["dropless"]["dropped"] == 0
    assert result["cases"]["dropless"]["invalid"] > 0
    assert result["cases"]["capacity"]["dropped"] > 0


def test_expert_domains_across_processes(backend):
    """Cross-DC EP with the process as the DC: experts all-gathered across the two processes
    (and their gradients reduce-scattered back), tokens only inside each; values and gradients
    equal the dense reference."""
    result, procs = _run_check(backend, "domains")
    assert result["status"] == "ok", result.get("error")
    case = result["cases"]["dropless"]
    for err in ("err_out", "err_grad_x", "err_grad_weights", "err_grad_experts"):
        assert case[err] < (TOL_OUT if err == "err_out" else TOL_GRAD), (case, tails(procs))
    assert case["dropped"] == 0 and case["invalid"] > 0
    assert case["ran_ffi"] == (backend == "ffi")


@pytest.mark.parametrize("levels", ["flat", "hier"])
@pytest.mark.parametrize("backend", ["xla", "ffi", "auto"])
def test_dispatch_combine_over_two_processes(backend, levels):
    """flat: one EP level over (node, local), crossing processes; hier: levels (node, local), node
    across processes (ffi: pack + XLA all-to-all), local inside one (ffi: direct write). auto
    picks ffi; the compiled program proves which backend ran."""
    result, procs = _run_check(backend, levels)
    _assert_matches_dense(result, procs)
    ran_ffi = [case["ran_ffi"] for case in result["cases"].values()]
    assert ran_ffi == [backend != "xla"] * len(ran_ffi), result


@pytest.mark.parametrize("die", ["before", "during"])
def test_dead_peer_ends_the_survivor(die):
    """Process 1 os._exit()s before / inside a step; process 0, blocked in a collective, exits
    non-zero within 60 s of the death (the heartbeat check aborts it; gloo alone would hang)."""
    procs = launch(
        "--backend=xla",
        "--levels=flat",
        "--case=dead_peer",
        f"--die={die}",
        timeout_s=WORKER_TIMEOUT_S // 2,
    )
    survivor, dead = procs
    assert dead.returncode == 1, tails(procs)
    assert f"dying {'mid-step' if die == 'during' else 'before the step'}" in dead.output
    assert survivor.returncode is not None, f"process 0 hung until killed\n{tails(procs)}"
    assert survivor.returncode != 0, tails(procs)
    assert survivor.result is None, tails(procs)  # it never finished its steps
    detection_s = survivor.exit_s - dead.exit_s
    print(f"dead peer ({die}): process 0 exited rc={survivor.returncode} {detection_s:.1f} s later")
    assert 0 <= detection_s < DEAD_PEER_LIMIT_S, tails(procs)
