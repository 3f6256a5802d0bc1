"""Each torchrun restart attempt gets its own key namespace in the agent's shared store (fsdptrain/distributed/world.py).

The failure it prevents: a restarted rank read the dead previous attempt's gloo address of its peer from torchrun's
agent store (shared by every attempt, no prefix) and failed or hung connecting to it
(tests/e2e/test_run_dir_safety.py::test_torchrun_restarts_a_killed_rank_and_resumes_exactly is the end-to-end case).
"""

from datetime import timedelta

import torch.distributed

from fsdptrain.distributed.world import attempt_store


def test_a_restart_attempt_does_not_see_the_previous_attempts_keys(monkeypatch):
    agent_store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_store(agent_store)
    first.set("rank_0", "address of attempt 0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_store(agent_store)
    assert not second.check(["rank_0"])
    second.set("rank_0", "address of attempt 1")
    assert first.get("rank_0") == b"address of attempt 0"
    assert second.get("rank_0") == b"address of attempt 1"


def test_without_torchrun_the_namespace_is_attempt_zero(monkeypatch):
    agent_store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    attempt_store(agent_store).set("k", "v")
    assert agent_store.get("fsdptrain/attempt_0/default_pg/k") == b"v"
