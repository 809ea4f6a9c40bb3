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
    saves_model = False

    def args(self, stage: int, steps: int) -> list[str]:
        raise NotImplementedError

    def prepare(self, harness: str, program: str) -> None:
        """Write what the program needs offline (data, stand-ins) into the harness or program directory."""

    def saved_model(self, program: str, stage: int):
        return None


class Cifar(Recipe):
    entry = "cifar10_deepspeed.py"

    def args(self, stage: int, steps: int) -> list[str]:
        return ["--deepspeed", "--epochs", "1", "--log-interval", "1", "--dtype", "fp32", "--stage", str(stage)]

    def prepare(self, harness: str, program: str) -> None:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            os.makedirs(os.path.join(harness, "torchvision"), exist_ok=True)
            for name, text in _TORCHVISION.items():
                with open(os.path.join(harness, "torchvision", name), "w") as handle:
                    handle.write(text)


RECIPES = {"cifar": Cifar}


def port(copy: str) -> int:
    """`zerotrain port --write` on the copy; returns the number of changed lines of its diff (kept beside it)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    diff = subprocess.run([PYTHON, "-m", "zerotrain.cli", "port", copy], capture_output=True, text=True, env=env,
                          check=True).stdout
    with open(copy + ".port.diff", "w") as handle:
        handle.write(diff)
    subprocess.run([PYTHON, "-m", "zerotrain.cli", "port", "--write", copy], capture_output=True, text=True,
                   env=env, check=True)
    return sum(1 for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def launch(engine: str, program: str, recipe: Recipe, stage: int, steps: int, harness: str, losses: str,
           timeout: int) -> dict:
    os.makedirs(losses, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([harness, REPO]), DSPROG_LOSSES=losses, OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    args = recipe.args(stage, steps)
    if engine == "deepspeed":
        command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(_free_port()), recipe.entry, *args]
    else:
        command = [PYTHON, "-m", "zerotrain.cli", "launch", "--nproc", "2", "--master-port", str(_free_port()),
                   recipe.entry, *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=program, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:  # e.g. DeepSpeed building its shm op on a loaded machine
        rc, output = 124, f"timed out after {timeout} s\n" + str(expired.stdout or "") + str(expired.stderr or "")
    seconds = time.perf_counter() - started
    with open(os.path.join(losses, "output.txt"), "w") as handle:
        handle.write(output)
    values = []
    path = os.path.join(losses, "rank0.txt")
    if os.path.exists(path):
        with open(path) as handle:
            values = [float(line) for line in handle if line.strip()]
    return {"rc": rc, "seconds": seconds, "losses": values, "tail": output.strip().splitlines()[-5:]}


def from_pretrained_loads(path) -> str:
    if path is None:
        return "n/a (the program saves no model)"
    try:
        from transformers import AutoModel
        AutoModel.from_pretrained(path)
        return "yes"
    except Exception as error:  # noqa: BLE001 - any failure is the answer
        return f"no: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


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
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]()
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
    changed = port(ported)
    recipe.prepare(harness, original)
    recipe.prepare(harness, ported)
    print(f"{args.recipe}: `zerotrain port --write` changed {changed} lines (diff: {ported}.port.diff); "
          f"no other edit")
    results = {"recipe": args.recipe, "program": os.path.abspath(args.program), "ported_lines": changed, "stages": {}}
    for stage in args.stages:
        row = {}
        for engine, program in (("deepspeed", original), ("zerotrain", ported)):
            row[engine] = launch(engine, program, recipe, stage, args.steps, harness,
                                 os.path.join(work, f"losses_{engine}_zero{stage}"), args.timeout)
            row[engine]["from_pretrained"] = from_pretrained_loads(recipe.saved_model(program, stage))
        row["compare"] = compare(row["zerotrain"]["losses"], row["deepspeed"]["losses"])
        results["stages"][stage] = row
        c = row["compare"]
        print(f"ZeRO-{stage}: rc deepspeed={row['deepspeed']['rc']} zerotrain={row['zerotrain']['rc']}; "
              f"time {row['deepspeed']['seconds']:.1f}s / {row['zerotrain']['seconds']:.1f}s; "
              f"{c.get('steps', 0)} losses compared, max |diff| {c.get('max_abs', float('nan')):.3g}, "
              f"max rel {c.get('max_rel', float('nan')):.3g}; first {c.get('first')}, last {c.get('last')}; "
              f"from_pretrained: deepspeed {row['deepspeed']['from_pretrained']}, "
              f"zerotrain {row['zerotrain']['from_pretrained']}")
        for engine in ("deepspeed", "zerotrain"):
            if row[engine]["rc"] != 0:
                print(f"  {engine} failed:\n    " + "\n    ".join(row[engine]["tail"]))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
    return 0 if all(r["deepspeed"]["rc"] == 0 and r["zerotrain"]["rc"] == 0 for r in results["stages"].values()) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
