"""tests/hf's shared launch: the TRL trainers against TRL + DeepSpeed in one world-2 run (trl_launch.py)."""
import pytest


@pytest.fixture(scope="session")
def trl_results(tiny_llama_dir, tmp_path_factory):
    """Every run of trl_launch.worker (rank 0's results), launched once per session."""
    from distributed import run_distributed
    from test_reward import reward_model_dir
    from trl_launch import worker

    root = tmp_path_factory.mktemp("trl_runs")
    reward_dir = reward_model_dir(tiny_llama_dir, root / "reward_model")
    return run_distributed(worker, 2, str(tiny_llama_dir), reward_dir, str(root), timeout=1500)[0]
