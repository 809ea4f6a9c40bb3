"""Reading configs: files, comments, JSON errors, sources."""
import json
import pathlib

import pytest

from zerotrain.config import ConfigError, ZeroTrainConfig, load_config, strip_json_comments

COMMENTED = """\
// a DeepSpeed config with comments
{
  "train_batch_size": 16, // the global batch
  /* block
     comment */
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "//mnt/nvme/*x*/"},
    "_offload_param": {"device": "cpu"},
  },
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95,],}},
  "note": "a \\"quoted // not a comment\\" string",
}
"""


def write(tmp_path: pathlib.Path, text: str, name: str = "ds_config.json") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_comments_and_trailing_commas(tmp_path):
    text = COMMENTED.replace('  "note"', '  "_note"')
    cfg = load_config(write(tmp_path, text))
    assert cfg.train_batch_size == 16
    assert cfg.zero_optimization.offload_optimizer.nvme_path == "//mnt/nvme/*x*/"
    assert cfg.optimizer.params["betas"] == (0.9, 0.95)


def test_strings_with_comment_markers_survive():
    stripped = strip_json_comments(COMMENTED)
    data = json.loads(stripped)
    assert data["note"] == 'a "quoted // not a comment" string'
    assert data["zero_optimization"]["offload_optimizer"]["nvme_path"] == "//mnt/nvme/*x*/"
    assert stripped.count("\n") == COMMENTED.count("\n")


def test_str_and_pathlike_sources(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 4}')
    assert load_config(str(path)).train_batch_size == 4
    assert load_config(path, dp_world_size=2).train_micro_batch_size_per_gpu == 2
    assert load_config('{"train_micro_batch_size_per_gpu": 3}').train_micro_batch_size_per_gpu == 3


def test_config_object_passes_through():
    cfg = load_config({"train_batch_size": 8})
    assert load_config(cfg) is cfg
    assert load_config(cfg, dp_world_size=2).train_micro_batch_size_per_gpu == 4


def test_missing_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json") as info:
        load_config(missing)
    assert "not found" in str(info.value) and info.value.file == str(missing)


def test_invalid_json_names_file_and_line(tmp_path):
    path = write(tmp_path, '{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true\n}\n', "broken.json")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "broken.json" in str(info.value) and "line 5" in str(info.value)


def test_unterminated_block_comment(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 8,\n/* oops\n}')
    with pytest.raises(ConfigError, match=r"ds_config\.json.*line 2"):
        load_config(path)


def test_value_errors_name_file_and_key(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 8, "zero_optimization": {"stgae": 2}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "zero_optimization.stgae" in message and "did you mean 'stage'" in message
    assert info.value.key == "zero_optimization.stgae" and info.value.file == str(path)


def test_batch_errors_name_the_file(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 8}')
    with pytest.raises(ConfigError, match="ds_config.json.*dp_world_size=3"):
        load_config(path, dp_world_size=3)


def test_duplicate_keys_are_rejected(tmp_path):
    path = write(tmp_path, '{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(path)


def test_top_level_must_be_an_object(tmp_path):
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(write(tmp_path, "[1, 2]"))
    with pytest.raises(ConfigError, match="dict or a path"):
        load_config(42)


def test_input_dict_is_not_modified():
    given = {"train_batch_size": 8, "_x": 1, "zero_optimization": {"stage": 2, "cpu_offload": True}}
    snapshot = json.dumps(given, sort_keys=True)
    with pytest.warns(UserWarning):
        cfg = load_config(given)
    assert json.dumps(given, sort_keys=True) == snapshot
    assert isinstance(cfg, ZeroTrainConfig)
    assert cfg.raw == {"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}


def test_no_bare_exceptions_on_odd_inputs():
    odd = [{"zero_optimization": None}, {"optimizer": "adam"}, {"optimizer": {"type": 3}},
           {"scheduler": {"type": "WarmupLR", "params": "x"}}, {1: 2}, {"fp16": []},
           {"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme_path": 5}}},
           {"optimizer": {"type": "adam", "params": {"betas": "0.9,0.99"}}}]
    for config in odd:
        with pytest.raises(ConfigError):
            load_config(dict(config, train_batch_size=8) if 1 not in config else config)


HF_ZERO3 = """{
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": true},
        "offload_param": {"device": "cpu", "pin_memory": true},
        "overlap_comm": true, "contiguous_gradients": true, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"""


def test_hf_trainer_zero3_config_loads_with_warnings(tmp_path):
    with pytest.warns(UserWarning) as record:
        cfg = load_config(write(tmp_path, HF_ZERO3))
    messages = [str(w.message) for w in record]
    assert any("zero_optimization.sub_group_size" in m for m in messages)
    assert any("optimizer.params.lr" in m for m in messages)
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.offload_param.device == "cpu" and zero.stage3_max_live_parameters == 10**9
    assert cfg.train_batch_size is None and cfg.precision == "fp32"
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        cfg.resolve_batch(2)


WARNED = """\
{
  "train_batch_size": 8,
  "zero_optimization": {
    "stage": 1,
    "zero_quantized_weights": true
  },
  "gradient_clipping": "auto",
  "no_such_top_level_key": 3
}
"""


def test_warnings_point_at_the_config_file_and_key(tmp_path):
    """A config warning names the user's file and the line of the key (Python prints that line under it), or, for
    a dict, the user's own call: never a line of zerotrain's source, which reads as the cause."""
    import warnings

    import torch

    import zerotrain
    from zerotrain.config import ConfigWarning

    path = write(tmp_path, WARNED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(str(path), dp_world_size=1)
    where = {(w.filename, w.lineno, str(w.message).split(" ")[0]) for w in caught if w.category is ConfigWarning}
    assert where == {(str(path), 5, "zero_optimization.zero_quantized_weights"),  # needs stage 3: no effect
                     (str(path), 7, "gradient_clipping"),  # "auto" is not filled in
                     (str(path), 8, "unknown")}, where
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="autotp_size"):  # refused before any process group starts
            zerotrain.initialize(model=torch.nn.Linear(2, 2), config={**json.loads(WARNED),
                                                                     "tensor_parallel": {"autotp_size": 2}})
    lines = {w.lineno for w in caught if w.category is ConfigWarning}
    assert {w.filename for w in caught if w.category is ConfigWarning} == {__file__} and len(lines) == 1, \
        [(w.filename, w.lineno) for w in caught]


def test_a_config_file_is_named_once_and_a_lone_closer_is_invalid_json(tmp_path):
    """The file prefixes an error once, whether the parser (which names it already) or the schema raised; a text
    that starts with a closing bracket is invalid JSON, not a crash of the comment stripper."""
    from zerotrain.config.loader import parse_json_text

    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    assert str(caught.value).startswith(f"{bad}: invalid JSON at line 1") and str(caught.value).count(str(bad)) == 1
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"train_batch_size": "eight"}')
    with pytest.raises(ConfigError) as caught:
        load_config(wrong)
    assert str(caught.value).startswith(f"{wrong}: ") and str(caught.value).count(str(wrong)) == 1
    for text in ("]", "}", "  ]"):
        with pytest.raises(ConfigError, match="^<config>: invalid JSON at line 1"):
            parse_json_text(text)
