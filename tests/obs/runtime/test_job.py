"""Job identity: the run id (the launcher's, the ranks' agreed one, or this process's proposal), rank and versions."""

from __future__ import annotations

import pytest

from obs.runtime import job


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No launcher's id, and no run id agreed by an earlier test's job (it stays for the process)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(job, "_agreed", [])


@pytest.mark.parametrize("value, expected", [("none", None), ("None", None), ("", None), ("  ", None),
                                             ("job-42", "job-42")])
def test_the_launcher_run_id_ignores_torchruns_placeholder(monkeypatch, value, expected):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
    assert job.launcher_run_id() == expected


def test_before_torch_distributed_the_run_id_is_this_processs_proposal_and_not_the_jobs():
    who = job.identity()
    assert (who.run_id, who.run_id_known) == (job.PROPOSAL, False)
    assert job.agree_run_id() is None and job.distributed_rank() is None and not job.distributed_ready()
    assert set(who.versions) == {"obs", "python", "torch"}


def test_the_launchers_run_id_is_the_jobs_from_the_start(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    assert (job.identity().run_id, job.identity().run_id_known) == ("job-42", True)
    assert job.agree_run_id() == "job-42"  # no store is asked


def test_ranks_agree_on_the_first_proposed_run_id_through_the_store(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(job, "PROPOSAL", "first")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert job.distributed_rank() == (0, 1)
        assert job.agree_run_id() == "first"
        assert (job.identity().run_id, job.identity().run_id_known) == ("first", True)  # kept for the process
        monkeypatch.setattr(job, "_agreed", [])
        monkeypatch.setattr(job, "PROPOSAL", "second")  # a later rank proposes its own and reads the winner back
        assert job.agree_run_id() == "first"
    finally:
        dist.destroy_process_group()
