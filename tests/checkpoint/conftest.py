import pytest

from ckpt_workers import run_with_manager
from harness import run_distributed


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A 2-rank run directory made by CheckpointManager(keep_last=2): steps 3 and 4 remain, plus decoys.
    Returns (path, per-rank results of ``run_with_manager``)."""
    root = tmp_path_factory.mktemp("run")
    results = run_distributed(run_with_manager, 2, str(root / "run"))
    return root / "run", results
