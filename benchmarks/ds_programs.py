"""Run a real DeepSpeed program under DeepSpeed and, ported by `zerotrain port --write`, under zerotrain; compare.

    python benchmarks/ds_programs.py PROGRAM_DIR --recipe cifar [--stages 2 3] [--work DIR] [--steps N]

PROGRAM_DIR is a checkout of a DeepSpeedExamples program (e.g. `git -C <mirror> archive HEAD training/cifar |
tar -x -C /tmp/dse`); nothing of it is committed here. For each ZeRO stage the script

1. copies the program twice into the work directory: as it is (run by DeepSpeed) and ported (`zerotrain port
   --write` on the copy: the only change; the diff is kept in the work directory and its size printed);
2. runs both on 2 ranks on the CPU (DeepSpeed through torchrun with ``DS_ACCELERATOR=cpu``; zerotrain through
   `zerotrain launch --nproc 2`, the launcher the port writes), with the recipe's small offline model and data;
3. records every loss the program computes at full precision (a `sitecustomize` on the ranks' PYTHONPATH wraps
   `torch.nn.functional.cross_entropy`, which the programs' losses go through, and seeds torch's generator, which
   otherwise starts from a random seed: the harness, not an edit of the program), and prints the loss comparison (max absolute / relative difference over the steps, rank 0) and,
   when the program saves a model, whether `transformers`' `from_pretrained` loads it.

Recipes say how a program is started and fed offline:
- ``cifar`` (training/cifar/cifar10_deepspeed.py): CIFAR-shaped synthetic tensors (3x32x32, 10 classes) from a
  stand-in `torchvision` package written into the harness directory when torchvision is not installed (its
  `datasets.CIFAR10` and the three `transforms` the program uses), fp32, `--stage S`, 1 epoch.

Timings are wall-clock of the whole launch (noisy on a shared machine); the losses are what is compared.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable

_SITECUSTOMIZE = '''
"""Written by benchmarks/ds_programs.py: record every cross-entropy loss a rank computes, at full precision."""
import os

if os.environ.get("DSPROG_LOSSES"):
    import torch
    import torch.nn.functional as _F

    # torch's default generator starts from a random seed: both engines' runs start from the same one, as if the
    # program seeded itself (rank 0's initial weights are broadcast by either engine)
    torch.manual_seed(int(os.environ.get("DSPROG_SEED", "0")))

    _original = _F.cross_entropy

    def cross_entropy(*args, **kwargs):
        loss = _original(*args, **kwargs)
        if loss.dim() == 0 and loss.requires_grad:  # training losses (eval runs under no_grad)
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(os.environ["DSPROG_LOSSES"], f"rank{rank}.txt"), "a") as handle:
                handle.write(repr(float(loss.detach().float())) + "\\n")
        return loss

    _F.cross_entropy = cross_entropy

    _original_logsigmoid = _F.logsigmoid

    def logsigmoid(*args, **kwargs):
        # DeepSpeed-Chat's reward model: loss = -sum(logsigmoid(chosen - rejected).mean()) / batch, one term per
        # pair; each training term is recorded (its mean, as the program takes it)
        out = _original_logsigmoid(*args, **kwargs)
        if out.requires_grad and os.environ.get("DSPROG_LOGSIGMOID"):
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(os.environ["DSPROG_LOSSES"], f"rank{rank}.txt"), "a") as handle:
                handle.write(repr(float(out.detach().float().mean())) + "\\n")
        return out

    _F.logsigmoid = logsigmoid

if os.environ.get("DSPROG_CPU_SET_DEVICE"):
    # a program that calls torch.cuda.set_device(local_rank) unconditionally (DeepSpeedExamples' pipeline example),
    # run on a CPU-only torch where that call raises: the harness makes it a no-op, for both engines
    import torch as _torch

    if not _torch.cuda.is_available():
        _torch.cuda.set_device = lambda device: None

if os.environ.get("DSPROG_CIFAR"):
    # torchvision installed from PyPI (a CUDA build) on a CPU torch: its compiled ops do not load, and importing
    # it then fails registering fake kernels for two ops it never defined; the harness declares them (unused by
    # the programs: no detection ops). The real `datasets.CIFAR10` then reads the harness's small CIFAR-10 in its
    # own on-disk format (cifar-10-batches-py pickles): its root is the harness's directory and its integrity
    # list holds the harness files' md5s, so `download=True` finds the data and downloads nothing.
    import torch as _torch

    _torchvision_ops = _torch.library.Library("torchvision", "FRAGMENT")
    for _schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        try:
            _torchvision_ops.define(_schema)
        except RuntimeError:  # the compiled ops loaded after all
            pass
    import hashlib
    import json as _json

    import torchvision.datasets as _tv_datasets

    with open(os.path.join(os.environ["DSPROG_CIFAR"], "md5.json")) as _handle:
        _md5 = _json.load(_handle)
    _CIFAR10 = _tv_datasets.CIFAR10
    _CIFAR10.train_list = [[name, _md5[name]] for name, _ in _CIFAR10.train_list]
    _CIFAR10.test_list = [[name, _md5[name]] for name, _ in _CIFAR10.test_list]
    _CIFAR10.meta = dict(_CIFAR10.meta, md5=_md5[_CIFAR10.meta["filename"]])
    _cifar_init = _CIFAR10.__init__

    def _cifar_init_here(self, root, *args, **kwargs):
        _cifar_init(self, os.environ["DSPROG_CIFAR"], *args, **kwargs)

    _CIFAR10.__init__ = _cifar_init_here

if os.environ.get("DSPROG_WIKITEXT"):
    # HelloDeepSpeed reads datasets.load_dataset("wikitext", "wikitext-2-v1", split="train") from the hub: the
    # harness answers that one call with the local stand-in's lines (one record per line ending in a newline, blank
    # lines as empty records: wikitext's "text" column)
    import datasets as _datasets

    _original_load_dataset = _datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path == "wikitext":
            with open(os.environ["DSPROG_WIKITEXT"], encoding="utf-8") as handle:
                lines = handle.read().split("\\n")
            return _datasets.Dataset.from_dict({"text": [line + "\\n" if line else "" for line in lines]})
        return _original_load_dataset(path, *args, **kwargs)

    _datasets.load_dataset = load_dataset
'''

# A stand-in for the parts of torchvision the CIFAR program uses: synthetic CIFAR-shaped data, no download.
_TORCHVISION = {
    "__init__.py": "from . import datasets, transforms  # stand-in written by benchmarks/ds_programs.py\n",
    "transforms.py": textwrap.dedent('''
        import torch


        class Compose:
            def __init__(self, transforms):
                self.transforms = transforms

            def __call__(self, x):
                for t in self.transforms:
                    x = t(x)
                return x


        class ToTensor:
            def __call__(self, x):
                return x.float() / 255.0


        class Normalize:
            def __init__(self, mean, std):
                self.mean = torch.tensor(mean).view(-1, 1, 1)
                self.std = torch.tensor(std).view(-1, 1, 1)

            def __call__(self, x):
                return (x - self.mean) / self.std
    '''),
    "datasets.py": textwrap.dedent('''
        import os

        import torch


        class CIFAR10(torch.utils.data.Dataset):
            """Synthetic CIFAR-10: uint8 3x32x32 images and labels 0-9 from a fixed seed."""

            def __init__(self, root, train=True, download=False, transform=None):
                count = int(os.environ.get("DSPROG_SAMPLES", "64")) if train else 32
                generator = torch.Generator().manual_seed(1 if train else 2)
                self.images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
                self.labels = torch.randint(0, 10, (count,), generator=generator)
                self.transform = transform
                self.classes = [str(i) for i in range(10)]

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, index):
                image = self.images[index]
                return (self.transform(image) if self.transform else image), int(self.labels[index])
    '''),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Recipe:
    """How one program is started and fed: its entry script, its arguments per stage, the harness files."""

    entry = ""
    # how DeepSpeed starts the original: "torchrun" (the program reads LOCAL_RANK) or "deepspeed" (DeepSpeed's
    # own launcher, as the program's scripts do: it passes --local_rank, which some programs require)
    deepspeed_launcher = "torchrun"
    # the rank whose losses are compared (a pipeline program computes them on its last stage)
    loss_rank = 0
    # a shell script of the program whose launcher line starts the run (each engine runs its own copy's line:
    # DeepSpeed's `deepspeed ...` as written, zerotrain the line `zerotrain port` wrote), or None
    shell = None
    # directories given with --pythonpath (installed packages the machine lacks)
    extra: list = []
    # drop non-finite recorded losses (counted): torch's pipeline schedule calls the loss function once more, in its
    # backward metadata inference before the first micro-batch, on placeholder tensors (its value is not a loss)
    drop_nonfinite = False

    def args(self, stage: int, steps: int, out: str) -> list[str]:
        """The program's command line for one launch; `out` is that launch's own directory (outputs, caches)."""
        raise NotImplementedError

    def prepare(self, harness: str, program: str, steps: int) -> None:
        """Write what the program needs offline (data, stand-ins) into the harness or program directory."""

    def pythonpath(self, program: str) -> list[str]:
        """Directories the program imports from besides its own (what its install step would provide)."""
        return []

    def env(self) -> dict:
        return {}

    def saved_model(self, out: str):
        """The directory the program saved its model to in a launch, or None when it saves none."""
        return None


class Cifar(Recipe):
    entry = "cifar10_deepspeed.py"

    def args(self, stage: int, steps: int, out: str) -> list[str]:
        return ["--deepspeed", "--epochs", "1", "--log-interval", "1", "--dtype", "fp32", "--stage", str(stage)]

    def prepare(self, harness: str, program: str, steps: int) -> None:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            os.makedirs(os.path.join(harness, "torchvision"), exist_ok=True)
            for name, text in _TORCHVISION.items():
                with open(os.path.join(harness, "torchvision", name), "w") as handle:
                    handle.write(text)


_WORDS = ("the a model train step loss data rank shard gather reduce scatter weight grad optimizer state adam "
          "token batch layer head norm python value list dict file path read write save load").split()


class ChatStep(Recipe):
    """DeepSpeed-Chat (applications/DeepSpeed-Chat: its `dschat` package and `training/`): a tiny local Llama
    written by `zerotrain.models.tiny_llama` (hidden 64, 2 layers, vocab 512, byte-level BPE tokenizer) and the
    program's own `local/jsonfile` data (`data/train.json`, `data/eval.json` under the checkout: prompt / chosen /
    rejected records from a fixed seed), bf16, 2 sequences of 64 tokens per rank, 1 epoch of `steps` steps."""

    deepspeed_launcher = "deepspeed"  # main.py takes the rank from --local_rank only
    data_split = "1,0,0"

    def prepare(self, harness: str, program: str, steps: int) -> None:
        import random

        # no "llama" in the path: dschat picks the sentencepiece LlamaTokenizer for such paths, AutoTokenizer else
        model = os.path.join(harness, "tiny_model")
        if not os.path.isdir(model):
            sys.path.insert(0, REPO)
            from zerotrain.models.tiny_llama import build_tiny_llama

            build_tiny_llama(model)
            # as a hub GPT-2/OPT tokenizer directory (DeepSpeed-Chat's default model is facebook/opt-350m): the
            # byte-level BPE's vocab.json + merges.txt beside tokenizer.json and the GPT2Tokenizer class, so the
            # program's `tokenizer.save_vocabulary(output_dir)` has a vocabulary file to copy (transformers 5's
            # tokenizers backend raises AttributeError `vocab_file` for a tokenizer.json-only directory)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(model).backend_tokenizer.model.save(model)
            config_path = os.path.join(model, "tokenizer_config.json")
            with open(config_path) as handle:
                tokenizer_config = json.load(handle)
            tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"
            with open(config_path, "w") as handle:
                json.dump(tokenizer_config, handle, indent=2)
        rng = random.Random(0)

        def sentence(n):
            return " ".join(rng.choice(_WORDS) for _ in range(n))

        def records(count):
            return [{"prompt": f"Human: {sentence(rng.randint(4, 12))}? Assistant:",
                     "chosen": sentence(rng.randint(6, 24)) + ".", "rejected": sentence(rng.randint(3, 24))}
                    for _ in range(count)]

        os.makedirs(os.path.join(program, "data"), exist_ok=True)
        for name, count in (("train", steps * 2 * 2), ("eval", 8)):
            with open(os.path.join(program, "data", f"{name}.json"), "w") as handle:
                json.dump(records(count), handle)
        self.model = model

    def pythonpath(self, program: str) -> list[str]:
        return [program]  # `dschat` (the checkout's `pip install -e .`)

    def args(self, stage: int, steps: int, out: str) -> list[str]:
        return ["--data_path", "local/jsonfile", "--data_split", self.data_split, "--data_output_path",
                os.path.join(out, "data_files"), "--model_name_or_path", self.model,
                "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--max_seq_len", "64",
                "--num_train_epochs", "1", "--zero_stage", str(stage), "--dtype", "bf16", "--seed", "1234",
                "--output_dir", os.path.join(out, "model"), *self.extra_args()]

    def extra_args(self) -> list[str]:
        return []

    def saved_model(self, out: str):
        return os.path.join(out, "model")


class ChatSFT(ChatStep):
    entry = "training/step1_supervised_finetuning/main.py"

    def extra_args(self) -> list[str]:
        return ["--learning_rate", "1e-3"]


class ChatReward(ChatStep):
    """Step 2: the reward model (a Llama body + value head, pairwise loss through `logsigmoid`; every pair's term is
    recorded). Its saved `pytorch_model.bin` holds `rwtransformer.*` + `v_head.weight` (what step 3 reads)."""

    entry = "training/step2_reward_model_finetuning/main.py"
    data_split = "0,1,0"

    def extra_args(self) -> list[str]:
        return ["--learning_rate", "1e-3", "--num_padding_at_beginning", "0"]

    def env(self) -> dict:
        return {"DSPROG_LOGSIGMOID": "1"}


class HelloDeepSpeed(Recipe):
    """training/HelloDeepSpeed/train_bert_ds.py: a RoBERTa-style MLM (the program's own model: 6 layers, h 256,
    vocab 50265, dropout 0.1) on a local wikitext stand-in (lines of English-like text from a fixed seed, blank lines
    between paragraphs as wikitext has) with a byte-level BPE tokenizer trained on it offline (RoBERTa's special
    tokens <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4), sequences of at most 64 tokens, batch 4 per rank, bf16. Its
    DeepSpeed config is fixed in the code: ZeRO-1 with `offload_optimizer: cpu` and Adam (lr 1e-4): the `stage`
    asked for is not used (the program has no option for it), so one stage is run."""

    entry = "train_bert_ds.py"
    deepspeed_launcher = "deepspeed"  # run_ds.sh's launcher; `fire` takes its --local_rank

    def prepare(self, harness: str, program: str, steps: int) -> None:
        import random

        data = os.path.join(harness, "wikitext_train.txt")
        tokenizer = os.path.join(harness, "mlm_tokenizer")
        if not os.path.exists(data):
            rng = random.Random(0)
            lines = []
            for _ in range(400):
                words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 40))]
                lines.append(" " + " ".join(words).capitalize() + " . ")
                if rng.random() < 0.2:
                    lines.append("")
            with open(data, "w", encoding="utf-8") as handle:
                handle.write("\n".join(lines))
        if not os.path.isdir(tokenizer):
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
            from transformers import PreTrainedTokenizerFast

            core = Tokenizer(models.BPE(unk_token="<unk>"))
            core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            core.decoder = decoders.ByteLevel()
            special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
            core.train([data], trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
            PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                    unk_token="<unk>", mask_token="<mask>").save_pretrained(tokenizer)
        self.tokenizer = tokenizer
        self.data = data

    def env(self) -> dict:
        return {"DSPROG_WIKITEXT": self.data}

    def args(self, stage: int, steps: int, out: str) -> list[str]:
        # train() runs steps 1 .. num_iterations - 1
        return ["--checkpoint_dir", os.path.join(out, "experiments"), "--tokenizer", self.tokenizer,
                "--max_seq_length", "64", "--batch_size", "4", "--num_iterations", str(steps + 1),
                "--checkpoint_every", "1000000", "--log_every", "1", "--dtype", "bf16"]


class Pipeline(Recipe):
    """training/pipeline_parallelism (train.py, ds_config.json, run.sh): torchvision's AlexNet cut into a 2-stage
    `PipelineModule` (the "parameters" cut), `engine.train_batch()` over `training_data`, the real torchvision
    (`--pythonpath` names it when it is not installed: e.g. a `pip install --no-deps --target DIR torchvision`) reading
    a small CIFAR-10 the harness writes in torchvision's own format (`DSPROG_SAMPLES` training images, fixed seed).
    Each engine runs its copy's run.sh launcher line: DeepSpeed's `deepspeed train.py --deepspeed_config=ds_config.json
    -p 2 --steps=200` as written and the `zerotrain launch` line `port` wrote for it, with the count both need on
    this CPU machine (`--num_gpus 2` / `--nproc 2`: the line has none, and port's check line says to set it) and,
    after the line's own arguments, `--steps N --backend gloo` (the program's options: fewer steps, the CPU
    backend in place of its nccl default). The program's config as it is (train_batch_size 256 = 32 micro-batches
    of 8 per step, Adam lr 1e-3, no gradient_clipping key)."""

    entry = "train.py"
    deepspeed_launcher = "deepspeed"
    loss_rank = 1
    shell = "run.sh"
    drop_nonfinite = True

    def prepare(self, harness: str, program: str, steps: int) -> None:
        import hashlib
        import pickle

        import numpy as np

        root = os.path.join(harness, "cifar10")
        folder = os.path.join(root, "cifar-10-batches-py")
        os.makedirs(folder, exist_ok=True)
        per_file = -(-int(os.environ.get("DSPROG_SAMPLES", "640")) // 5)
        rng = np.random.default_rng(0)
        md5 = {}
        for name, count in [(f"data_batch_{i}", per_file) for i in range(1, 6)] + [("test_batch", 16)]:
            entry = {"batch_label": name, "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
                     "labels": [int(v) for v in rng.integers(0, 10, count)],
                     "filenames": [f"{name}_{i}.png" for i in range(count)]}
            with open(os.path.join(folder, name), "wb") as handle:
                pickle.dump(entry, handle)
        meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                                "truck"], "num_cases_per_batch": per_file, "num_vis": 3072}
        with open(os.path.join(folder, "batches.meta"), "wb") as handle:
            pickle.dump(meta, handle)
        for name in os.listdir(folder):
            with open(os.path.join(folder, name), "rb") as handle:
                md5[name] = hashlib.md5(handle.read()).hexdigest()
        with open(os.path.join(root, "md5.json"), "w") as handle:
            json.dump(md5, handle)
        self.root = root

    def env(self) -> dict:
        return {"DSPROG_CIFAR": self.root, "DSPROG_CPU_SET_DEVICE": "1"}

    def args(self, stage: int, steps: int, out: str) -> list[str]:
        return ["--steps", str(steps), "--backend", "gloo"]


RECIPES = {"cifar": Cifar, "pipeline": Pipeline, "chat-sft": ChatSFT, "chat-reward": ChatReward,
           "hello-deepspeed": HelloDeepSpeed}


def port(copy: str) -> int:
    """`zerotrain port --write` on the copy; returns the number of changed lines of its diff (kept beside it)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    shown = subprocess.run([PYTHON, "-m", "zerotrain.cli", "port", copy], capture_output=True, text=True, env=env)
    # exit 1 with only `check:` lines: a launcher line whose process count port chose (the harness launches
    # the ranks itself); anything `not ported` fails the harness
    listed = [line for line in shown.stderr.splitlines() if re.match(r"\S+:\d+: (not ported|check): ", line)]
    if shown.returncode not in (0, 1) or any(": check: " not in line for line in listed):
        raise RuntimeError(f"zerotrain port {copy} failed:\n{shown.stderr}")
    diff = shown.stdout
    with open(copy + ".port.diff", "w") as handle:
        handle.write(diff)
    subprocess.run([PYTHON, "-m", "zerotrain.cli", "port", "--write", copy], capture_output=True, text=True,
                   env=env)
    return sum(1 for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def _shell_line(engine: str, script: str) -> list[str]:
    """The command of the program's own launcher line in `script` (the copy's: as written for DeepSpeed, as `zerotrain
    port` wrote it for zerotrain), with 2 processes on this node and a free port."""
    import shlex

    first = "deepspeed" if engine == "deepspeed" else "zerotrain"
    with open(script) as handle:
        line = next(line for line in handle.read().replace("\\\n", " ").splitlines()
                    if line.strip().startswith(first + " "))
    words = shlex.split(line)
    if engine == "deepspeed":
        if "--num_gpus" in words or any(word.startswith("--num_gpus=") for word in words):
            raise RuntimeError(f"{script}: the harness sets --num_gpus itself: {line}")
        return [PYTHON, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
                *words[1:]]
    if words[:2] != ["zerotrain", "launch"] or "--nproc" not in words:
        raise RuntimeError(f"{script}: not a `zerotrain launch --nproc N` line: {line}")
    at = words.index("--nproc")
    words[at + 1] = "2"  # what port's check line asks for: the processes per node the job needs
    return [PYTHON, "-m", "zerotrain.cli", "launch", "--master-port", str(_free_port()), *words[2:]]


def launch(engine: str, program: str, recipe: Recipe, stage: int, steps: int, harness: str, losses: str,
           timeout: int) -> dict:
    shutil.rmtree(losses, ignore_errors=True)  # a rerun in the same work directory starts clean
    os.makedirs(losses)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([harness, *recipe.pythonpath(program), *recipe.extra, REPO]),
               DSPROG_LOSSES=losses, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **recipe.env())
    args = recipe.args(stage, steps, losses)
    if recipe.shell:
        command = _shell_line(engine, os.path.join(program, recipe.shell)) + args
    elif engine == "deepspeed" and recipe.deepspeed_launcher == "deepspeed":
        command = [PYTHON, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
                   recipe.entry, *args]
    elif engine == "deepspeed":
        command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(_free_port()), recipe.entry, *args]
    else:
        command = [PYTHON, "-m", "zerotrain.cli", "launch", "--nproc", "2", "--master-port", str(_free_port()),
                   recipe.entry, *args]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=program, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        rc = process.returncode
    except subprocess.TimeoutExpired:  # e.g. DeepSpeed compiling an op on a loaded machine
        # the launcher and every process under it: the ranks run in sessions of their own and would outlive it
        import psutil  # a dependency of deepspeed

        launcher = psutil.Process(process.pid)
        for child in [*launcher.children(recursive=True), launcher]:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        output, _ = process.communicate()
        rc, output = 124, f"timed out after {timeout} s\n" + (output or "")
    seconds = time.perf_counter() - started
    with open(os.path.join(losses, "output.txt"), "w") as handle:
        handle.write(output)
    values = []
    path = os.path.join(losses, f"rank{recipe.loss_rank}.txt")
    if os.path.exists(path):
        with open(path) as handle:
            values = [float(line) for line in handle if line.strip()]
    dropped = 0
    if recipe.drop_nonfinite:
        import math

        dropped = sum(1 for value in values if not math.isfinite(value))
        values = [value for value in values if math.isfinite(value)]
    return {"rc": rc, "seconds": seconds, "losses": values, "nonfinite_dropped": dropped,
            "tail": output.strip().splitlines()[-5:]}


def _saved_weights(path: str) -> dict:
    """The tensors a program saved (`pytorch_model.bin` or safetensors) in `path`, by name."""
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(binary):
        import torch

        return torch.load(binary, map_location="cpu", weights_only=True)
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def from_pretrained_loads(path) -> str:
    """Whether transformers' `from_pretrained` loads the saved directory, with its own loading report. A reward
    model (DeepSpeed-Chat step 2: `rwtransformer.*` + `v_head.weight`) loads its body as `AutoModel` from the
    renamed tensors (step 3's loader does the same renaming by module), its head is checked for presence."""
    if path is None:
        return "n/a (the program saves no model)"
    try:
        from transformers import AutoModel, AutoModelForCausalLM

        saved = _saved_weights(path)
        if any(name.startswith("rwtransformer.") for name in saved):
            if "v_head.weight" not in saved:
                return "no: v_head.weight missing"
            import tempfile

            from safetensors.torch import save_file

            body = {name[len("rwtransformer."):]: value.contiguous() for name, value in saved.items()
                    if name.startswith("rwtransformer.")}
            with tempfile.TemporaryDirectory() as renamed:  # the body's tensors under the base model's names
                save_file(body, os.path.join(renamed, "model.safetensors"), metadata={"format": "pt"})
                shutil.copy(os.path.join(path, "config.json"), renamed)
                model, info = AutoModel.from_pretrained(renamed, output_loading_info=True)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        problems = {key: value for key, value in info.items() if value}
        if problems:
            return f"no: {problems}"
        return f"yes ({type(model).__name__}, {len(saved)} tensors, no missing/unexpected keys)"
    except Exception as error:  # noqa: BLE001 - any failure is the answer
        return f"no: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def saved_difference(ours, theirs):
    """Max |difference| between the two engines' saved tensors (same names), or why not comparable."""
    if ours is None or theirs is None:
        return None
    try:
        a, b = _saved_weights(ours), _saved_weights(theirs)
    except Exception as error:  # noqa: BLE001
        return f"n/a: {type(error).__name__}: {error}"
    if set(a) != set(b):
        return f"different names: {sorted(set(a) ^ set(b))[:4]}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def compare(ours: list, theirs: list) -> dict:
    n = min(len(ours), len(theirs))
    if n == 0:
        return {"steps": 0}
    diffs = [abs(a - b) for a, b in zip(ours[:n], theirs[:n])]
    rel = [d / max(abs(b), 1e-12) for d, b in zip(diffs, theirs[:n])]
    return {"steps": n, "lengths": (len(theirs), len(ours)), "max_abs": max(diffs), "max_rel": max(rel),
            "first": (theirs[0], ours[0]), "last": (theirs[n - 1], ours[n - 1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", help="a checkout of the program's directory (e.g. /tmp/dse/training/cifar)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps, where the recipe can bound them")
    parser.add_argument("--work", default=None, help="work directory (default: a new one under /tmp)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--set", nargs="*", default=[], metavar="FILE:KEY=JSON",
                        help="set a key of the program's JSON config in both copies (e.g. ds_config.json:"
                             "gradient_clipping=0): a stated harness change, for comparisons the program's config "
                             "cannot make exact")
    parser.add_argument("--pythonpath", nargs="*", default=[],
                        help="more directories for the ranks' PYTHONPATH (e.g. a `pip install --target` of torchvision)")
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]()
    recipe.extra = [os.path.abspath(path) for path in args.pythonpath]
    work = args.work or f"/tmp/ds_programs_{args.recipe}_{os.getpid()}"
    os.makedirs(work, exist_ok=True)
    harness = os.path.join(work, "harness")
    os.makedirs(harness, exist_ok=True)
    with open(os.path.join(harness, "sitecustomize.py"), "w") as handle:
        handle.write(_SITECUSTOMIZE)
    original = os.path.join(work, "deepspeed")
    ported = os.path.join(work, "zerotrain")
    for copy in (original, ported):
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(args.program, copy)
    for setting in args.set:
        name, _, assignment = setting.partition(":")
        key, _, value = assignment.partition("=")
        for copy in (original, ported):
            with open(os.path.join(copy, name)) as handle:
                config = json.load(handle)
            config[key] = json.loads(value)
            with open(os.path.join(copy, name), "w") as handle:
                json.dump(config, handle, indent=2)
        print(f"harness: {name}: {key} = {value} in both copies")
    changed = port(ported)
    recipe.prepare(harness, original, args.steps)
    recipe.prepare(harness, ported, args.steps)
    print(f"{args.recipe}: `zerotrain port --write` changed {changed} lines (diff: {ported}.port.diff); "
          f"no other edit")
    results = {"recipe": args.recipe, "program": os.path.abspath(args.program), "ported_lines": changed, "stages": {}}
    for stage in args.stages:
        row = {}
        for engine, program in (("deepspeed", original), ("zerotrain", ported)):
            row[engine] = launch(engine, program, recipe, stage, args.steps, harness,
                                 os.path.join(work, f"losses_{engine}_zero{stage}"), args.timeout)
            row[engine]["from_pretrained"] = from_pretrained_loads(
                recipe.saved_model(os.path.join(work, f"losses_{engine}_zero{stage}")))
        row["compare"] = compare(row["zerotrain"]["losses"], row["deepspeed"]["losses"])
        row["saved_max_abs_diff"] = saved_difference(
            recipe.saved_model(os.path.join(work, f"losses_zerotrain_zero{stage}")),
            recipe.saved_model(os.path.join(work, f"losses_deepspeed_zero{stage}")))
        results["stages"][stage] = row
        c = row["compare"]
        for engine in ("deepspeed", "zerotrain"):
            if row[engine]["nonfinite_dropped"]:
                print(f"  {engine}: {row[engine]['nonfinite_dropped']} non-finite loss_fn value(s) dropped (torch's "
                      f"pipeline metadata inference calls the loss function on placeholder tensors)")
        print(f"ZeRO-{stage}: rc deepspeed={row['deepspeed']['rc']} zerotrain={row['zerotrain']['rc']}; "
              f"time {row['deepspeed']['seconds']:.1f}s / {row['zerotrain']['seconds']:.1f}s; "
              f"{c.get('steps', 0)} losses compared, max |diff| {c.get('max_abs', float('nan')):.3g}, "
              f"max rel {c.get('max_rel', float('nan')):.3g}; first {c.get('first')}, last {c.get('last')}; "
              f"from_pretrained: deepspeed {row['deepspeed']['from_pretrained']}, "
              f"zerotrain {row['zerotrain']['from_pretrained']}; saved weights max |diff| "
              f"{row['saved_max_abs_diff']}")
        for engine in ("deepspeed", "zerotrain"):
            if row[engine]["rc"] != 0:
                print(f"  {engine} failed:\n    " + "\n    ".join(row[engine]["tail"]))
    if {2, 3} <= set(results["stages"]):  # the yardstick for lossy modes: DeepSpeed's own ZeRO-2 vs ZeRO-3 losses
        spread = compare(results["stages"][3]["deepspeed"]["losses"], results["stages"][2]["deepspeed"]["losses"])
        results["deepspeed_stage_spread"] = spread
        print(f"DeepSpeed's own ZeRO-2 vs ZeRO-3 spread: {spread.get('steps', 0)} losses, max |diff| "
              f"{spread.get('max_abs', float('nan')):.3g}, max rel {spread.get('max_rel', float('nan')):.3g}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
    return 0 if all(r["deepspeed"]["rc"] == 0 and r["zerotrain"]["rc"] == 0 for r in results["stages"].values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
