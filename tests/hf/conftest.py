"""tests/hf's shared launch: the TRL trainers against TRL + DeepSpeed in one world-2 run (trl_launch.py)."""
import pytest


@pytest.fixture(scope="session")
def trl_results(request, tiny_llama_dir, tmp_path_factory):
    """Every run of trl_launch.worker (rank 0's results), launched once per session. The variant runs (bf16, LoRA,
    a reward model, DPO's ref-model options) only when a selected test reads them: those tests are `slow` (the
    default suite keeps each trainer's fp32 comparison at ZeRO-2 and ZeRO-3 as their fast case)."""
    from distributed import run_distributed
    from test_reward import reward_model_dir
    from trl_launch import worker

    root = tmp_path_factory.mktemp("trl_runs")
    reward_dir = reward_model_dir(tiny_llama_dir, root / "reward_model")
    variants = any(item.get_closest_marker("slow") is not None and "trl_results" in getattr(item, "fixturenames", ())
                   for item in request.session.items)
    return run_distributed(worker, 2, str(tiny_llama_dir), reward_dir, str(root), variants, timeout=1500)[0]
