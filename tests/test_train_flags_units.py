"""`zerotrain.train.flags` in the pytest process, beside tests/test_train_flags.py (issue #48: the survivors of its
mutation run)."""
from __future__ import annotations

import pytest

from zerotrain.cli import main


@pytest.mark.parametrize("command, required", [("train", []), ("train-embedding", ["--model", "m", "--data", "d"])])
def test_the_help_says_every_option_takes_its_underscore_spelling(command, required, capsys):
    """The help of both commands ends by saying the underscore spellings exist (TrainingArguments' field names)."""
    with pytest.raises(SystemExit) as stop:
        main([command, *required, "--help"])
    assert stop.value.code == 0
    said = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog to the terminal
    assert said.endswith("Every option also takes its underscore spelling, as TrainingArguments' fields are named "
                         "(--learning_rate, --output_dir, --per_device_train_batch_size, ...)."), said[-300:]
