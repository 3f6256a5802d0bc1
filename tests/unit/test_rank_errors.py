"""One message when one rank of several fails (issue 32, item 8): each failing rank leaves its message in the
launcher's error folder, the launcher prints the first and exits with that rank's code, and a rank whose collective
failed only because a peer died is recognised as collateral. The 2-rank run is
tests/e2e/test_hostile_inputs.py::test_a_failure_on_one_rank_ends_every_rank_with_that_ranks_message_only (slow)."""

from __future__ import annotations

from fsdptrain.distributed.rank_errors import ERROR_DIR_ENV, PEER_LOST_EXIT, first_failure, peer_lost, report_failure
from fsdptrain.launch import _report_first_failure

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:13515. This is typically caused by a remote worker crashing.")


def test_the_launcher_reports_the_first_failing_ranks_message_and_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    report_failure("Traceback (the user's)\nerror: reward function 'f' on row 3 (0-based): returned nan", rank=1)
    report_failure("error: a later failure on rank 0", rank=0)
    assert capsys.readouterr().err == ""  # nothing printed by the ranks themselves
    assert first_failure(tmp_path) == (1, "Traceback (the user's)\nerror: reward function 'f' on row 3 (0-based): "
                                          "returned nan")
    # rank 0 stopped because rank 1 failed (collateral code), or the launcher killed it (-15): rank 1's code counts
    assert _report_first_failure(tmp_path, {0: PEER_LOST_EXIT, 1: 2}) == 2
    assert capsys.readouterr().err == ("Traceback (the user's)\nerror: reward function 'f' on row 3 (0-based): "
                                       "returned nan\n")


def test_without_a_report_the_ranks_own_code_wins_over_collateral(tmp_path, capsys):
    assert _report_first_failure(tmp_path, {0: PEER_LOST_EXIT, 1: 7}) == 7
    assert _report_first_failure(tmp_path, {0: PEER_LOST_EXIT, 1: -15}) == 1
    assert capsys.readouterr().err == ""


def test_without_the_launcher_a_rank_prints_its_message(monkeypatch, capsys):
    monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    report_failure("error: x", rank=0)
    assert capsys.readouterr().err == "error: x\n"


def test_a_collective_that_failed_because_a_peer_died_is_collateral(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not peer_lost(RuntimeError(GLOO))  # one process has no peer: an error of its own
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert peer_lost(RuntimeError(GLOO))
    try:
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert peer_lost(outer)
    assert not peer_lost(RuntimeError("shape mismatch")) and not peer_lost(KeyError("Connection closed by peer"))
