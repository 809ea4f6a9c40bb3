"""`zerotrain port` and DeepSpeed's import paths mirrored under zerotrain (issue 28).

- Every path of `zerotrain.port.paths` imports with the names it lists; docs/porting.md's table is the
  generated one.
- The fixtures (import lines of our own, tests/port/fixtures/) port: every mapped path is rewritten and the
  ported file runs, binding each local name to zerotrain's object; the unmappable lines are left as they are
  and listed with the guide's advice; the launcher lines of a shell script become `zerotrain launch`.
- The mirrored helpers mean what DeepSpeed's do (accelerator on the CPU, ops.adam, moe.utils, module_utils).
"""
from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

import pytest
import torch

from zerotrain.port.paths import MODULES, NOT_PROVIDED, TRANSFORMERS, mirrored_paths, porting_table
from zerotrain.port.rewrite import rewrite_python, rewrite_shell

FIXTURES = Path(__file__).parent / "fixtures"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "porting.md"


def test_every_listed_path_imports_with_its_names():
    for entry in MODULES:
        module = importlib.import_module(entry.target)
        for name in entry.names:
            assert hasattr(module, name), f"{entry.target}.{name} ({entry.source})"
        for name, (where, target) in entry.moved.items():
            assert hasattr(importlib.import_module(where), target), f"{where}.{target} ({entry.source}.{name})"
    for names in TRANSFORMERS.values():
        for where, target in names.values():
            assert hasattr(importlib.import_module(where), target)
    assert {"zerotrain.ops.adam", "zerotrain.accelerator", "zerotrain.runtime.zero.partition_parameters",
            "zerotrain.moe.utils", "zerotrain.compression.helper", "zerotrain.utils.module_utils"} <= set(mirrored_paths())


def test_the_guide_has_the_generated_table():
    text = GUIDE.read_text()
    match = re.search(r"<!-- deepspeed-paths -->\n(.*?)<!-- /deepspeed-paths -->", text, re.S)
    assert match, f"{GUIDE}: no <!-- deepspeed-paths --> table"
    assert match.group(1) == porting_table(), "docs/porting.md's table is stale: paste `zerotrain port --table`"


def test_the_fixture_covers_every_mapped_path():
    text = (FIXTURES / "ds_program.py").read_text()
    for entry in MODULES:
        assert re.search(rf"(from|import) {re.escape(entry.source)}( |$)", text, re.M), entry.source
        for name in (*entry.names, *entry.moved):
            if entry.source not in ("deepspeed.runtime.activation_checkpointing.checkpointing",):
                assert re.search(rf"\b{name}\b", text), f"{entry.source}.{name} is not in the fixture"
    for module in TRANSFORMERS:
        assert f"from {module} import" in text


def test_a_program_ports_and_binds_zerotrain_objects(tmp_path):
    import zerotrain
    import zerotrain.accelerator
    import zerotrain.checkpointing
    import zerotrain.dist
    import zerotrain.engine
    import zerotrain.ops.adam
    import zerotrain.pretrained
    import zerotrain.runtime.zero.partition_parameters as pp
    import zerotrain.utils

    source = (FIXTURES / "ds_program.py").read_text()
    ported, unported = rewrite_python(source)
    assert unported == []
    code = "\n".join(line for line in ported.splitlines() if not line.startswith("#"))
    assert not re.search(r"^\s*(import|from) deepspeed", code, re.M), ported
    assert "from transformers.integrations import PeftAdapterMixin" in ported  # transformers' own names stay
    # a comment inside a rewritten statement is kept after it; what is not an import is as it was
    assert "from zerotrain.ops.adam import DeepSpeedCPUAdam, FusedAdam  # offload\n" in ported
    assert ported.splitlines()[:2] == source.splitlines()[:2]
    assert ported[ported.index("\n\ndef main():"):].replace("import zerotrain as deepspeed; import zerotrain.accelerator",
                                                            "import deepspeed.accelerator") == \
        source[source.index("\n\ndef main():"):]
    namespace: dict = {}
    exec(compile(ported, str(tmp_path / "ds_program.py"), "exec"), namespace)
    expected = {
        "deepspeed": zerotrain, "dist": zerotrain.dist, "ds_comm": zerotrain.dist,
        "accel_from_root": zerotrain.accelerator.get_accelerator, "get_accelerator": zerotrain.accelerator.get_accelerator,
        "RootEngine": zerotrain.engine.ZeroTrainEngine, "DeepSpeedEngine": zerotrain.engine.ZeroTrainEngine,
        "initialize": zerotrain.initialize, "zero": zerotrain.zero, "checkpointing": zerotrain.checkpointing,
        "get_rank": zerotrain.dist.get_rank, "comm_init": zerotrain.dist.init_distributed,
        "FusedAdam": zerotrain.ops.adam.FusedAdam, "DeepSpeedCPUAdam": zerotrain.ops.adam.DeepSpeedCPUAdam,
        "adam": zerotrain.ops.adam, "ZeroParamStatus": pp.ZeroParamStatus, "PPGathered": zerotrain.zero.GatheredParameters,
        "RuntimeInit": zerotrain.zero.Init, "partition_parameters": pp, "ds_checkpointing": zerotrain.checkpointing,
        "checkpoint": zerotrain.checkpointing.checkpoint, "RepeatingLoader": zerotrain.utils.RepeatingLoader,
        "RuntimeRepeatingLoader": zerotrain.utils.RepeatingLoader, "mu_getattr": zerotrain.utils.recursive_getattr,
        "recursive_setattr": zerotrain.utils.recursive_setattr, "log_dist": zerotrain.utils.log_dist,
        "HfDeepSpeedConfig": zerotrain.pretrained.HfDeepSpeedConfig,
        "IntegrationsConfig": zerotrain.pretrained.HfDeepSpeedConfig,
        "OldHfDeepSpeedConfig": zerotrain.pretrained.HfDeepSpeedConfig,
        "is_deepspeed_zero3_enabled": zerotrain.pretrained.is_deepspeed_zero3_enabled,
    }
    for name, obj in expected.items():
        assert namespace[name] is obj, name
    assert namespace["main"]() is zerotrain.accelerator.get_accelerator()  # `import deepspeed.X` in a one-line body


def test_unmappable_lines_stay_and_are_listed_with_advice():
    source = (FIXTURES / "ds_unported.py").read_text()
    ported, unported = rewrite_python(source)
    assert ported == source.replace("\nimport deepspeed\n", "\nimport zerotrain as deepspeed\n")
    listed = {item.line: (item.what, item.advice) for item in unported}
    assert sorted(listed) == [3, 4, 5, 6, 7, 8]
    assert listed[3] == ("from deepspeed import DeepSpeedConfig", NOT_PROVIDED["deepspeed:DeepSpeedConfig"])
    assert listed[4][1] == NOT_PROVIDED["deepspeed.ops.sparse_attention"]
    assert listed[5][0] == "from deepspeed.runtime.pipe.schedule import ..." and \
        listed[5][1] == NOT_PROVIDED["deepspeed.runtime.pipe.schedule"]
    assert "import zerotrain.dist as" in listed[6][1]
    assert listed[7][1] == NOT_PROVIDED["deepspeed.utils:safe_get_full_fp32_param"]
    assert "docs/porting.md" in listed[8][1]


def test_launcher_lines_become_zerotrain_launch():
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 1  # DeepSpeed's: every local device
    ported, unported = rewrite_shell((FIXTURES / "launch.sh").read_text())
    assert ported.splitlines()[3:] == [
        "zerotrain launch --nproc 2 main.py --zero_stage 3 \\",
        "   --deepspeed --output_dir $OUTPUT &> $OUTPUT/training.log",
        "NCCL_DEBUG=INFO zerotrain launch --nproc 2 --master-port 29600 --no-local-rank \\",
        "   train.py --deepspeed_config ds.json",
        "zerotrain launch --nnodes 2 --master-addr node0 --node-rank 1 --nproc 8 train.py",
        "zerotrain launch --nproc 2 train.py",
        "zerotrain launch --hostfile hosts main.py",  # zerotrain launch takes DeepSpeed's hostfile options as they are
        "pip install deepspeed",
        f"zerotrain launch --nproc {count} train.py --deepspeed_config ds.json",
        f"zerotrain launch --nproc {count} train.py",
        "zerotrain launch -H hosts --num_nodes 2 train.py --deepspeed ds.json",  # DeepSpeed's --num_nodes kept
        "zerotrain launch --hostfile hosts --force_multi train.py",  # DeepSpeed's --force_multi kept
        "deepspeed --hostfile hosts --save_pid train.py",
    ]
    assert [(item.line, item.what) for item in unported] == [(12, "deepspeed launcher line without --num_gpus"),
                                                             (13, "deepspeed launcher line without --num_gpus"),
                                                             (16, "deepspeed launcher option(s) --save_pid")]


def test_the_command_shows_a_diff_and_writes(tmp_path, capsys):
    from zerotrain.cli import main

    work = tmp_path / "program"
    shutil.copytree(FIXTURES, work)
    (work / "NOTES.md").write_text("import deepspeed\ndeepspeed --num_gpus 2 main.py\n")  # neither *.py nor *.sh
    before = {p.name: p.read_text() for p in work.iterdir()}
    assert main(["port", str(work)]) == 1  # something is not ported: listed, exit status 1
    out, err = capsys.readouterr()
    assert "NOTES.md" not in out + err  # a directory's other files are left alone
    assert "\n-import deepspeed.comm as dist\n" in out and "\n+import zerotrain.dist as dist\n" in out
    assert "\n+zerotrain launch --nproc 2 main.py --zero_stage 3 \\\n" in out
    assert "ds_unported.py:4: not ported: from deepspeed.ops.sparse_attention import ..." in err
    assert {p.name: p.read_text() for p in work.iterdir()} == before  # a diff only
    assert main(["port", "--write", str(work)]) == 1
    assert (work / "ds_program.py").read_text() == rewrite_python(before["ds_program.py"])[0]
    assert (work / "launch.sh").read_text() == rewrite_shell(before["launch.sh"])[0]
    assert (work / "NOTES.md").read_text() == before["NOTES.md"]
    assert "NOTES.md" not in capsys.readouterr().out
    assert main(["port", "--table"]) == 0 and capsys.readouterr().out == porting_table()
    with pytest.raises(SystemExit):
        main(["port", "--help"])
    usage = capsys.readouterr().out
    assert "[--write] [--table] [PATH ...]" in usage and re.search(r"\n  PATH +files or directories", usage), usage


# --- the mirrored helpers ---------------------------------------------------------------------------------
def test_accelerator_on_the_cpu_means_what_deepspeeds_does(monkeypatch):
    from zerotrain.accelerator import Accelerator

    acc = Accelerator("cpu")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert acc.current_device() == 0  # DeepSpeed's CPU accelerator: the launcher's LOCAL_RANK, else 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert acc.current_device() == 3
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.device(0) is None and acc.is_available() and acc.device_count() == 1
    assert acc.communication_backend_name() == "gloo"
    acc.set_device(0)
    acc.synchronize()
    acc.manual_seed(3)
    first = torch.rand(4)
    acc.manual_seed_all(3)
    assert torch.equal(torch.rand(4), first) and acc.initial_seed() == 3
    state = acc.get_rng_state()
    drawn = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(2), drawn)
    assert (acc.memory_allocated(), acc.max_memory_allocated()) == (0, 0)
    acc.empty_cache()
    assert acc.FloatTensor(2, 3).shape == (2, 3) and acc.LongTensor([1, 2]).dtype == torch.int64
    assert torch.device(acc.device_name(0)).type == "cpu" and acc.on_accelerator(torch.zeros(1))
    assert acc.is_synchronized_device() is True and acc.default_generator(0) is torch.default_generator
    import numpy as np
    assert acc.FloatTensor(np.int64(2), 3).shape == (2, 3)  # sizes computed with numpy are sizes, not data
    assert acc.FloatTensor(5).shape == (5,) and acc.LongTensor([1, 2]).tolist() == [1, 2]  # a size; data


def test_the_accelerator_is_chosen_by_ds_accelerator_once_per_process_and_the_cpus_answers(monkeypatch):
    """`get_accelerator()` as DeepSpeed's: DS_ACCELERATOR forces the kind (an empty one: torch's choice, the CPU
    here), one object per process until `set_accelerator` replaces it; an unknown kind is refused by name. The
    CPU's capability and memory answers (the host's physical memory, as psutil reads it)."""
    import psutil

    from zerotrain.accelerator import Accelerator, real_accelerator
    from zerotrain.accelerator.real_accelerator import get_accelerator, set_accelerator

    monkeypatch.setattr(real_accelerator, "_accelerator", None)
    monkeypatch.setenv("LOCAL_RANK", "1")  # never read as the kind
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    forced = get_accelerator()
    assert repr(forced) == "zerotrain.accelerator.Accelerator('cuda')" and forced.communication_backend_name() == "nccl"
    # what a CUDA accelerator answers without touching a device (any host)
    assert (forced.device_name(), forced.device_name(0), forced.device_name(1)) == ("cuda", "cuda:0", "cuda:1")
    assert forced.is_fp16_supported() and not forced.is_synchronized_device()
    assert not forced.on_accelerator(torch.zeros(1))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert get_accelerator() is forced  # chosen once
    mine = Accelerator("cpu")
    set_accelerator(mine)
    assert get_accelerator() is mine
    for kind in ("", None):
        monkeypatch.setattr(real_accelerator, "_accelerator", None)
        if kind is None:
            monkeypatch.delenv("DS_ACCELERATOR")
        else:
            monkeypatch.setenv("DS_ACCELERATOR", kind)
        assert repr(get_accelerator()) == ("zerotrain.accelerator.Accelerator('cuda')" if torch.cuda.is_available()
                                           else "zerotrain.accelerator.Accelerator('cpu')")
    with pytest.raises(ValueError, match=r"^zerotrain.accelerator: device type 'xpu' is not supported \(cuda or cpu\)$"):
        Accelerator("xpu")

    cpu = Accelerator("cpu")
    assert (cpu.is_bf16_supported(), cpu.is_fp16_supported(), cpu.device_name(None)) == (True, False, "cpu")
    assert cpu.total_memory() == psutil.virtual_memory().total
    assert (cpu.memory_reserved(), cpu.max_memory_reserved()) == (0, 0)
    cpu.reset_peak_memory_stats()
    data = torch.arange(3)
    assert cpu.pin_memory(data) is data
    for name, dtype in (("HalfTensor", torch.float16), ("BFloat16Tensor", torch.bfloat16),
                        ("DoubleTensor", torch.float64), ("IntTensor", torch.int32), ("ByteTensor", torch.uint8),
                        ("BoolTensor", torch.bool)):
        made = getattr(cpu, name)([1, 0])
        assert made.dtype == dtype and made.tolist() == [1, 0] and made.device.type == "cpu", name
        assert getattr(cpu, name)(2, 3).shape == (2, 3) and getattr(cpu, name)(2, 3).dtype == dtype, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accelerator_on_cuda():
    from zerotrain.accelerator import Accelerator

    acc = Accelerator("cuda")
    acc.set_device(0)
    assert acc.device_name(0) == "cuda:0" and acc.current_device_name() == "cuda:0" and acc.device_name() == "cuda"
    before = acc.memory_allocated()
    x = torch.empty(1 << 20, device=acc.current_device_name())
    assert acc.memory_allocated() >= before + x.numel() * 4 and acc.max_memory_allocated() >= acc.memory_allocated()
    acc.manual_seed_all(5)
    first = torch.rand(3, device="cuda")
    acc.manual_seed(5)
    assert torch.equal(torch.rand(3, device="cuda"), first)
    acc.synchronize()
    assert acc.communication_backend_name() == "nccl" and acc.device_count() == torch.cuda.device_count()
    state = acc.get_rng_state(0)  # a device's generator by its index, saved and put back
    drawn = torch.rand(2, device="cuda")
    acc.set_rng_state(state, 0)
    assert torch.equal(torch.rand(2, device="cuda"), drawn)
    assert acc.total_memory() == torch.cuda.get_device_properties(0).total_memory
    assert acc.total_memory(0) == torch.cuda.get_device_properties(0).total_memory
    with acc.device(0):  # torch.cuda.device: a context manager selecting the device
        assert torch.cuda.current_device() == 0
    assert acc.is_available() and not acc.is_synchronized_device()
    acc.manual_seed(1)
    acc.seed()  # a fresh seed for the current device's generator, not the CPU's
    assert acc.initial_seed() != 1
    state = acc.get_rng_state()  # the current device's generator when no index is given
    drawn = torch.rand(2, device="cuda")
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(2, device="cuda"), drawn)
    # every memory counter asked by its own name; the peak reset; the cache emptied
    del x
    acc.synchronize()
    assert acc.max_memory_allocated() >= acc.memory_allocated() + (1 << 22)
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == acc.memory_allocated()
    reserved = acc.memory_reserved()
    assert acc.max_memory_reserved() >= reserved >= 1 << 22
    acc.empty_cache()
    assert acc.memory_reserved() <= reserved - (1 << 22)


def test_ops_adam_are_torchs_adam_with_deepspeeds_defaults():
    from zerotrain.ops.adam import DeepSpeedCPUAdam, FusedAdam

    params = [torch.nn.Parameter(torch.randn(3))]
    fused = FusedAdam([{"params": params, "weight_decay": 0.1}], lr=0.5, betas=(0.9, 0.95))
    assert type(fused) is torch.optim.AdamW  # the offload paths pick kernels by the exact class
    assert fused.param_groups[0]["weight_decay"] == 0.1 and fused.defaults["betas"] == (0.9, 0.95)
    cpu = DeepSpeedCPUAdam(params)
    assert type(cpu) is torch.optim.AdamW and cpu.defaults["weight_decay"] == 0.0 and cpu.defaults["lr"] == 1e-3
    assert type(FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    with pytest.raises(NotImplementedError, match="bias_correction"):
        FusedAdam(params, bias_correction=False)
    # a parameter group given as a dict steps as torch's AdamW with the same values (and nothing else: AMSGrad off)
    # and a weight decay given to DeepSpeedCPUAdam is the weight decay
    for build in (lambda p: FusedAdam([{"params": (q for q in p), "weight_decay": 0.1}], lr=0.1),
                  lambda p: DeepSpeedCPUAdam(p, lr=0.1, weight_decay=0.1)):
        ours = torch.nn.Parameter(torch.randn(4))
        theirs = torch.nn.Parameter(ours.detach().clone())
        optimizers = build([ours]), torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.1)
        for scale in (4.0, 1.0, 0.25):  # shrinking gradients: AMSGrad's running max would step differently
            for param, optimizer in zip((ours, theirs), optimizers):
                param.grad = scale * torch.arange(1.0, 5.0)
                optimizer.step()
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_moe_groups_and_module_utils():
    from zerotrain.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from zerotrain.sharding import TensorSlice
    from zerotrain.utils.module_utils import recursive_getattr, recursive_setattr

    dense, other = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    expert = torch.nn.Parameter(torch.zeros(2, 4))
    expert.ep_slice = TensorSlice((4, 4), 0, ((0, 2),))
    group = {"params": [dense, expert, other], "name": "parameters", "lr": 0.1}
    split = split_params_into_different_moe_groups_for_optimizer(group)
    assert [g["params"] for g in split] == [[dense, other], [expert]]
    assert split[1]["moe"] is True and split[1]["lr"] == 0.1 and "moe" not in split[0]
    plain = {"params": [dense], "name": "parameters"}
    assert split_params_into_different_moe_groups_for_optimizer((plain,)) == [plain]

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    replacement = torch.nn.Identity()
    recursive_setattr(model, "0.0", replacement)
    assert model[0][0] is replacement


# --- issue 44: what `port` passed over silently -----------------------------------------------------------------
def test_attribute_chains_are_resolved_rewritten_or_listed():
    """`deepspeed.X.Y` used through attributes (on `deepspeed`, an alias, a module alias or a `from` import):
    a name zerotrain has at the same path stays, one it has elsewhere under the same root is rewritten
    (`deepspeed.comm` -> `deepspeed.dist`), anything else is listed on its line with the table's advice."""
    import zerotrain

    source = (FIXTURES / "ds_attributes.py").read_text()
    ported, unported = rewrite_python(source)
    lines = source.splitlines()

    def line_of(text: str) -> int:
        return next(i for i, line in enumerate(lines, 1) if text in line)

    assert "    rank = deepspeed.dist.get_rank()\n" in ported
    assert "    accelerator = ds.accelerator.get_accelerator()\n" in ported
    assert "    deepspeed.runtime.utils.set_random_seed(args.seed)\n" in ported  # mirrored: as it was
    assert "from zerotrain import runtime\n" in ported
    listed = [(item.line, item.what, item.advice) for item in unported]
    assert listed == [
        (line_of("moe.layer"), "deepspeed.moe.layer.MoE", NOT_PROVIDED["deepspeed.moe.layer"]),
        (line_of("op_builder"), "deepspeed.ops.op_builder.CPUAdamBuilder", NOT_PROVIDED["deepspeed.ops.op_builder"]),
        (line_of("clip_grad_norm_"), "runtime.utils.clip_grad_norm_", NOT_PROVIDED["deepspeed.runtime.utils:*"]),
        (line_of("ProcessTopology"), "ds.pipe.ProcessTopology", NOT_PROVIDED["deepspeed.pipe:*"]),
    ]
    namespace: dict = {}
    exec(compile(ported, "ds_attributes.py", "exec"), namespace)  # the rewritten names resolve
    assert namespace["deepspeed"].dist.get_rank is zerotrain.dist.get_rank
    assert namespace["ds"].accelerator.get_accelerator is zerotrain.accelerator.get_accelerator
    assert namespace["ds_utils"].set_random_seed is zerotrain.runtime.utils.set_random_seed
    assert namespace["runtime"].dataloader.RepeatingLoader is zerotrain.utils.RepeatingLoader


def test_imports_in_indented_blocks_and_one_line_bodies_are_rewritten_and_compile():
    import zerotrain

    source = (FIXTURES / "ds_blocks.py").read_text()
    ported, unported = rewrite_python(source)
    assert unported == []
    assert not re.search(r"(^|[:;]\s*)(import|from) deepspeed", ported, re.M), ported
    namespace: dict = {}
    exec(compile(ported, "ds_blocks.py", "exec"), namespace)
    trainer = namespace["Trainer"]()
    assert trainer.parts == (zerotrain.dist, zerotrain.accelerator.get_accelerator, zerotrain.utils.logger,
                             zerotrain.ops.adam.FusedAdam, zerotrain.checkpointing)
    import asyncio

    class Lock:  # an async context manager that does nothing
        async def __aenter__(self):
            return None

        async def __aexit__(self, *exc):
            return False

    assert asyncio.run(trainer.later(Lock())) is zerotrain.accelerator.get_accelerator()


def test_a_rewrite_that_would_not_compile_is_not_made(monkeypatch):
    """The compile() guard: were a rewrite to break the file, the file stays as it was and the line is listed."""
    from zerotrain.port import rewrite

    source = "import os\nimport deepspeed\n"
    monkeypatch.setattr(rewrite, "_rewrite_imports", lambda text: (text.replace("import deepspeed", "import ("), []))
    ported, unported = rewrite.rewrite_python(source)
    assert ported == source
    assert [(item.line, item.what.split(" (")[0]) for item in unported] == [(2, "the rewritten file does not compile")]


def test_a_deepspeed_import_the_scan_missed_is_listed(monkeypatch):
    """Any DeepSpeed import still in the rewritten file is listed (never a silent exit 0)."""
    from zerotrain.port import rewrite

    monkeypatch.setattr(rewrite, "_rewrite_imports", lambda text: (text, []))
    _, unported = rewrite.rewrite_python("import os\nif os.sep:\n    from deepspeed.utils import logger\n")
    assert [(item.line, item.what) for item in unported] == [(3, "from deepspeed.utils import logger")]


def test_launcher_lines_without_a_process_count_say_what_they_chose():
    source = "deepspeed train.py --deepspeed_config ds.json\nNCCL_DEBUG=INFO deepspeed --bind_cores_to_rank train.py\n"
    ported, unported = rewrite_shell(source)
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert ported == (f"zerotrain launch --nproc {count} train.py --deepspeed_config ds.json\n"
                      f"NCCL_DEBUG=INFO zerotrain launch --nproc {count} train.py\n")
    assert [(item.line, item.kind) for item in unported] == [(1, "check"), (2, "check")]
    assert all(f"wrote --nproc {count}" in item.advice and "set --nproc N" in item.advice for item in unported)


def test_launcher_lines_in_the_shapes_real_scripts_write_them():
    """DeepSpeedExamples' pipeline example behind CUDA_VISIBLE_DEVICES (DeepSpeed's launcher then starts one process
    per listed device: no guess), `nohup` / `time` before the launcher, Megatron-DeepSpeed's `run_cmd="deepspeed
    ..."` run by eval, a non-hostfile --num_nodes: rewritten; `python -m deepspeed.launcher.runner`: listed (it was
    left as it was, silently)."""
    ported, unported = rewrite_shell((FIXTURES / "launch_scripts.sh").read_text())
    assert ported.splitlines()[3:] == [
        "CUDA_VISIBLE_DEVICES=0,1 zerotrain launch --nproc 2 train.py --deepspeed_config=ds_config.json -p 2 --steps=200",
        "nohup zerotrain launch --nproc 2 main.py --zero_stage 2 &> $OUTPUT/training.log &",
        'run_cmd="zerotrain launch --nproc 4 ${DIR}/pretrain_gpt.py $@ ${options}"',
        "echo ${run_cmd}",
        "eval ${run_cmd}",
        "time zerotrain launch --nproc 2 pretrain_gpt.py ${options}",
        "python -m deepspeed.launcher.runner --num_gpus 2 train.py",
        "zerotrain launch --nnodes 2 --master-addr node0 --node-rank 0 --nproc 8 pretrain_gpt.py",
        "pip install deepspeed",
        'echo "deepspeed is installed"',
    ]
    assert [(item.line, item.kind, item.what) for item in unported] == [
        (10, "not ported", "python -m deepspeed.launcher.runner")]
    assert "zerotrain launch" in unported[0].advice


def test_megatron_and_chat_uses_are_rewritten_to_what_zerotrain_has_or_listed():
    """A name taken from a module that moved is checked too: `deepspeed.runtime.engine.DeepSpeedEngine` becomes
    `deepspeed.engine.ZeroTrainEngine` (it became `deepspeed.engine.DeepSpeedEngine`, an AttributeError at run
    time), `deepspeed.comm.get_world_group` and `...checkpointing.CheckpointFunction` are listed (they were
    rewritten to names zerotrain lacks, silently); `from deepspeed.runtime.activation_checkpointing import
    checkpointing` is `zerotrain.checkpointing` (it was listed); a path under a package without a counterpart
    gets that path's advice."""
    import zerotrain

    source = (FIXTURES / "ds_megatron.py").read_text()
    ported, unported = rewrite_python(source)
    lines = ported.splitlines()
    assert lines[3:7] == ["import zerotrain as deepspeed", "from zerotrain import checkpointing as ds_checkpointing",
                          "from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology",
                          "from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus"]
    assert "    is_engine = isinstance(engine, deepspeed.engine.ZeroTrainEngine)" in lines
    assert "    rank = deepspeed.dist.get_rank()" in lines
    assert "    group = deepspeed.comm.get_world_group()" in lines  # left as it was: listed below
    listed = [(item.line, item.what, item.advice) for item in unported]
    assert [(line, what) for line, what, _ in listed] == [
        (6, "from deepspeed.runtime.pipe.topology import ..."), (14, "deepspeed.comm.get_world_group"),
        (16, "deepspeed.runtime.activation_checkpointing.checkpointing.CheckpointFunction"),
        (17, "deepspeed.sequence.layer.DistributedAttention")]
    assert listed[3][2] == NOT_PROVIDED["deepspeed.sequence.layer"]
    assert zerotrain.engine.ZeroTrainEngine is not None and not hasattr(zerotrain.engine, "DeepSpeedEngine")
    assert not hasattr(zerotrain.dist, "get_world_group") and not hasattr(zerotrain.checkpointing, "CheckpointFunction")


def test_a_count_less_launcher_line_takes_the_cuda_devices_of_ports_machine(monkeypatch):
    """On a machine with CUDA devices (here: torch.cuda's answers replaced, no collective involved) the launcher
    line without a count gets that many processes, said in the check line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    ported, unported = rewrite_shell("deepspeed train.py --deepspeed_config ds.json\n")
    assert ported == "zerotrain launch --nproc 4 train.py --deepspeed_config ds.json\n"
    assert [item.kind for item in unported] == ["check"]
    assert "wrote --nproc 4 (the 4 CUDA device(s) of the machine that ran zerotrain port)" in unported[0].advice
