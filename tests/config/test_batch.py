"""The batch-size triple: train_batch_size = micro x accumulation x dp."""
import pytest

from zerotrain.config import ConfigError, load_config, resolve_batch_triple


@pytest.mark.parametrize("given, dp, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
    ({"train_batch_size": 8}, 1, (8, 8, 1)),
])
def test_any_two_derive_the_third(given, dp, expected):
    cfg = load_config(given).resolve_batch(dp)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    assert got == expected
    assert all(type(v) is int for v in got)
    assert load_config(given, dp_world_size=dp).train_batch_size == expected[0]


def test_resolve_returns_a_copy():
    cfg = load_config({"train_batch_size": 16})
    resolved = cfg.resolve_batch(2)
    assert cfg.train_micro_batch_size_per_gpu is None and cfg.gradient_accumulation_steps is None
    assert resolved.train_micro_batch_size_per_gpu == 8
    assert not cfg.batch_resolved and resolved.batch_resolved


def test_raw_resolves_again_for_another_dp_size():
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, dp_world_size=2)
    assert cfg.gradient_accumulation_steps == 4
    again = load_config(cfg.raw, dp_world_size=4)
    assert again.gradient_accumulation_steps == 2


def test_inconsistent_triple_names_all_values_and_dp():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                     dp_world_size=2)
    message = str(info.value)
    for text in ("train_batch_size=32", "train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2",
                 "dp_world_size=2"):
        assert text in message


def test_not_dividing_exactly_names_values_and_dp():
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, dp_world_size=3)
    message = str(info.value)
    assert "gradient_accumulation_steps" in message and "train_batch_size=32" in message
    assert "dp_world_size=3" in message
    with pytest.raises(ConfigError, match="dp_world_size=3"):
        load_config({"train_batch_size": 32}, dp_world_size=3)


def test_impossible_for_every_dp_size_fails_at_load():
    with pytest.raises(ConfigError, match="train_batch_size=30") as info:
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})
    assert info.value.key == "train_batch_size"


@pytest.mark.parametrize("given", [
    {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
    {"train_batch_size": 30, "gradient_accumulation_steps": 4},
    {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4},
])
def test_early_check_names_all_three_values_and_dp(given):
    """The check that runs before the data-parallel size is known names every value (unset ones as such)."""
    def shown(key):
        return f"{key}={given[key]}" if key in given else f"{key}=(not set)"

    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    with pytest.raises(ConfigError) as info:
        load_config(given)
    message = str(info.value)
    assert all(shown(key) in message for key in keys), message
    assert "dp_world_size not known yet" in message and info.value.key == "train_batch_size"
    with pytest.raises(ConfigError) as info:  # dp known: it is named too
        load_config(given, dp_world_size=3)
    message = str(info.value)
    assert all(shown(key) in message for key in keys) and "dp_world_size=3" in message, message


def test_initialize_names_the_world_size_in_an_impossible_triple(monkeypatch):
    """zerotrain.initialize fails before any process group, naming the values and the job's world size."""
    import torch.distributed as dist

    import zerotrain
    from models_for_tests import OddMLP

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as info:
        zerotrain.initialize(model=OddMLP(), config={"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                                                     "gradient_accumulation_steps": 2})
    message = str(info.value)
    for text in ("train_batch_size=30", "train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2",
                 "world size 4"):
        assert text in message, message
    assert not dist.is_initialized()


def test_only_accumulation_asks_for_a_batch_key():
    cfg = load_config({"gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match="add train_batch_size or train_micro_batch_size_per_gpu"):
        cfg.resolve_batch(2)


def test_none_given_names_the_keys():
    with pytest.raises(ConfigError) as info:
        load_config({}, dp_world_size=1)
    assert "train_batch_size" in str(info.value) and "train_micro_batch_size_per_gpu" in str(info.value)


def test_auto_batch_keys_are_derived_silently(recwarn):
    cfg = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": "auto"}, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (4, 1)
    assert not [w for w in recwarn if "train_" in str(w.message) or "gradient_acc" in str(w.message)]


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu",
                                 "gradient_accumulation_steps"])
@pytest.mark.parametrize("value", [0, -4])
def test_zero_or_negative_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key) as info:
        load_config({key: value})
    assert info.value.key == key


def test_float_whole_numbers_accepted_fractions_rejected():
    assert load_config({"train_batch_size": 64.0}).train_batch_size == 64
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        load_config({"train_micro_batch_size_per_gpu": 2.5})


def test_bad_dp_size():
    with pytest.raises(ConfigError, match="dp_world_size"):
        resolve_batch_triple(8, None, None, 0)
    with pytest.raises(ConfigError, match="dp_world_size"):
        resolve_batch_triple(8, None, None, 2.0)


@pytest.mark.parametrize("given", [(8, 0, None), (None, None, -2), (8, 2, True), (8, 2.5, None)])
def test_the_early_check_refuses_a_value_that_is_no_positive_integer_on_its_own(given):
    """`check_batch_partial` is public (the schema's early check): it refuses a bad value naming its key even where
    the division would pass (micro 0 counts as unset in micro x accumulation)."""
    from zerotrain.config.batch import GAS, MICRO, TBS, check_batch_partial

    bad = [key for key, value in zip((TBS, MICRO, GAS), given) if value is not None and value not in (8, 2)][0]
    with pytest.raises(ConfigError, match=f"^{bad}: ") as info:
        check_batch_partial(*given)
    assert info.value.key == bad
    check_batch_partial(8, 2, None)  # and a good triple passes
