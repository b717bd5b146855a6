"""The vLLM client's spawn fallback for its rank processes (tests/vllm_client.py ``_start_ranks``).

The client forks its ranks (vLLM already imported) while it has a single thread, and spawns them otherwise (a
thread pool in the client would not survive a fork); every client of the suite forks, so nothing else reaches the
spawn path. Here ``PMZ_VLLM_SPAWN_RANKS=1`` (``vllm_client.SPAWN_ENV``) forces it for a ``ranks`` job, which starts
two ranks exactly as a ``state`` job does and has each form a gloo group and report itself; the same job without the
switch is the forked contrast. A spawned rank is a fresh interpreter (vLLM not imported in it, which a forked rank
of the client has), a child of the client, and the pair's all-reduce gives 1 + 2.

Not a ``state`` job with spawned ranks: each of those imports vLLM again before building its models (one took
96 s at load 12, against ~10 s forked; it passed, bitwise); the rank functions it would run are the forked path's.
"""

from __future__ import annotations

from tests.vllm_harness import run_clients


def test_forced_spawn_starts_fresh_ranks_that_form_a_group(tmp_path, monkeypatch):
    [forked] = run_clients([("ranks", {"world": 2}, tmp_path / "forked.json")])
    monkeypatch.setenv("PMZ_VLLM_SPAWN_RANKS", "1")  # read in the client (the harness passes this environment)
    [spawned] = run_clients([("ranks", {"world": 2}, tmp_path / "spawned.json")])
    assert forked["start_method"] == "fork" and spawned["start_method"] == "spawn"
    for result, imported in ((forked, True), (spawned, False)):
        assert [r["rank"] for r in result["ranks"]] == [0, 1]
        assert all(r["sum"] == 3.0 and r["vllm_imported"] is imported for r in result["ranks"]), result
        pids = {r["pid"] for r in result["ranks"]}
        assert len(pids) == 2 and result["client_pid"] not in pids
