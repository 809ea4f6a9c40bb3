"""zerotrain's CPU Adam(W) kernel: torch's fused CPU AdamW arithmetic in one pass that also
unscales/clips the gradient and writes the training-dtype copy of the updated weights.

Why: on the CPU the Adam step is bound by memory bandwidth (7 fp32 streams per element:
read param, grad, exp_avg, exp_avg_sq, write three). torch's fused kernel is already at that
limit, so what is left to win is the passes around it: the separate unscale/clip multiply of
the gradient (read + write the whole gradient) and the copy of the masters back into the
model's buffers (read the masters again). This kernel folds both in: the multiplier is
applied as the gradient is loaded (the reduced gradient is left as it was), and the new
weights are stored to the fp32/bf16/fp16 output in the same loop.

Exactness: element for element the same float operations as torch's fused CPU Adam/AdamW
(including where it contracts into FMAs), so a step is bit-identical to
`torch.optim.AdamW(fused=True)` on the gradient multiplied by `multiplier` (tested). The last
`numel % 16` elements of a tensor, which torch runs through its scalar tail, are handed to
torch's own kernel.

The C source (`cpu_adam.c` beside this module) is compiled once per machine with the system C compiler
(`$CC`, else `cc`/`gcc`; about 0.2 s) into `~/.cache/zerotrain` (or `$ZEROTRAIN_CACHE_DIR`) and
loaded with ctypes, which releases the GIL during the call; a buffer is split into one chunk
per `torch.get_num_threads()` thread. Without a compiler (or with `ZEROTRAIN_CPU_ADAM=torch`)
`kernel()` is None and callers use torch's fused kernel, after one warning.
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

_SOURCE = (Path(__file__).parent / "cpu_adam.c").read_text()  # compiled on first use, see _build()

_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11"]
_COPY_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
COPY_BACK_DTYPES = tuple(_COPY_KINDS)  # the dtypes `copy_to` may have
_ALIGN = 16  # torch's vector loop covers whole 16-element cache lines; the rest is its scalar tail
_MIN_CHUNK = 1 << 16  # elements per thread below which splitting costs more than it saves


class _Args(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in ("multiplier", "decay_factor", "weight_decay", "lerp_weight",
                                                  "beta2", "sq_coeff", "bc2_sqrt", "eps", "neg_step_size")] + \
               [("decay_mode", ctypes.c_int32), ("copy_kind", ctypes.c_int32)]


_lock = threading.Lock()
_loaded: dict[str, object] = {}


def cache_dir() -> Path:
    """Where the compiled kernel is kept: `$ZEROTRAIN_CACHE_DIR`, else ~/.cache/zerotrain."""
    return Path(os.environ.get("ZEROTRAIN_CACHE_DIR") or Path.home() / ".cache" / "zerotrain")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_key() -> str:
    """What -march=native depends on: a library built on one CPU is not loaded on another."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(compiler: str) -> Path:
    """Compile the kernel (once per source, compiler and CPU) and return the library's path."""
    key = hashlib.sha256("\n".join([_SOURCE, compiler, " ".join(_FLAGS), _cpu_key()]).encode()).hexdigest()[:16]
    directory = cache_dir()
    library = directory / f"cpu_adam_{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source = Path(work) / "cpu_adam.c"
        source.write_text(_SOURCE)
        built = Path(work) / library.name
        errors = []
        for arch in (["-march=native"], []):  # a compiler that does not know -march=native still builds
            done = subprocess.run([compiler, *_FLAGS, *arch, str(source), "-o", str(built), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(built, library)  # atomic: ranks building at once each publish a whole file
                return library
            errors.append(done.stderr.strip()[-400:])
        raise RuntimeError(f"{compiler} failed to build the CPU Adam kernel: {errors[-1]}")


def kernel() -> Optional[ctypes.CDLL]:
    """The compiled kernel, built on first use; None (after one warning) where it cannot be built."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib, reason = None, None
        if os.environ.get("ZEROTRAIN_CPU_ADAM", "").lower() == "torch":
            reason = "ZEROTRAIN_CPU_ADAM=torch"
        elif (compiler := _compiler()) is None:
            reason = "no C compiler found (set $CC)"
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler)))
                lib.zt_adam_step.restype = None
                lib.zt_adam_step.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.POINTER(_Args)]
                lib.zt_adam_step_to.restype = None
                lib.zt_adam_step_to.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.POINTER(_Args)]
                lib.zt_round_bf16.restype = None  # offload/stochastic_round.py
                lib.zt_round_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
            except (OSError, RuntimeError) as error:
                lib, reason = None, str(error)
        if lib is None and reason != "ZEROTRAIN_CPU_ADAM=torch":
            warnings.warn(f"zerotrain CPU Adam kernel unavailable ({reason}); using torch's fused AdamW kernel",
                          RuntimeWarning, stacklevel=2)
        _loaded["lib"] = lib
        return lib


_pool: dict[str, object] = {}


def _executor(workers: int) -> ThreadPoolExecutor:
    """A thread pool of at least `workers` threads for this process (a forked child makes its own)."""
    pid = os.getpid()
    if _pool.get("pid") != pid or _pool["workers"] < workers:
        if _pool.get("pid") == pid:
            _pool["executor"].shutdown(wait=False)
        _pool.update(pid=pid, workers=workers,
                     executor=ThreadPoolExecutor(workers, thread_name_prefix="zerotrain-cpu-adam"))
    return _pool["executor"]


def _check(name: str, tensor: torch.Tensor, numel: int, dtypes=(torch.float32,)) -> None:
    if tensor.device.type != "cpu" or tensor.dtype not in dtypes or not tensor.is_contiguous() \
            or tensor.numel() != numel:
        raise ValueError(f"CPU Adam: {name} must be a contiguous CPU tensor of {numel} elements with dtype in "
                         f"{[str(d) for d in dtypes]}; got {tensor.dtype} on {tensor.device}, {tensor.numel()} "
                         f"elements, contiguous={tensor.is_contiguous()}")


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              decoupled: bool, multiplier: float = 1.0, copy_to: Optional[torch.Tensor] = None,
              out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
              threads: Optional[int] = None) -> None:
    """One Adam(W) step of flat fp32 `param` with gradient `grad * multiplier` (`grad` is not changed).

    In place, or with `out=(param_out, exp_avg_out, exp_avg_sq_out)` into those (distinct) buffers,
    leaving `param`, `exp_avg` and `exp_avg_sq` as they were: a step that may be dropped costs no
    copy (SuperOffload's speculation). `step` is the state's step count, already incremented for
    this step (as torch's fused step does); `copy_to`, if given, receives the updated weights in its
    dtype (fp32, bf16 or fp16). Bit-identical to torch's fused Adam (`decoupled=False`) / AdamW
    (`decoupled=True`).
    """
    lib = kernel()
    if lib is None:
        raise RuntimeError("CPU Adam kernel unavailable: check kernel() before calling adam_step")
    numel = param.numel()
    named = [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out is not None:
        named += list(zip(("param_out", "exp_avg_out", "exp_avg_sq_out"), out))
        pointers = [t.data_ptr() for _, t in named]
        if len(set(pointers)) != len(pointers):
            raise ValueError("CPU Adam: the out= buffers must be distinct from each other and from the inputs")
    for name, tensor in named:
        _check(name, tensor, numel)
    if copy_to is not None:
        _check("copy_to", copy_to, numel, tuple(_COPY_KINDS))
    count = float(step)
    bias_correction1 = 1 - beta1 ** count
    args = _Args(multiplier=multiplier, decay_factor=1 - lr * weight_decay, weight_decay=weight_decay,
                 lerp_weight=1 - beta1, beta2=beta2, sq_coeff=1 - beta2,
                 bc2_sqrt=math.sqrt(1 - beta2 ** count), eps=eps, neg_step_size=-(lr / bias_correction1),
                 decay_mode=0 if weight_decay == 0 else (1 if decoupled else 2),
                 copy_kind=_COPY_KINDS[copy_to.dtype] if copy_to is not None else 0)
    body = numel - numel % _ALIGN
    if body:
        threads = max(1, min(threads or torch.get_num_threads(), body // _MIN_CHUNK))
        per = -(-body // threads)
        per += -per % _ALIGN
        spans = [(start, min(per, body - start)) for start in range(0, body, per)]
        if out is None:
            function, tensors = lib.zt_adam_step, (param, grad, exp_avg, exp_avg_sq, copy_to)
        else:
            function, tensors = lib.zt_adam_step_to, (param, grad, exp_avg, exp_avg_sq, *out, copy_to)

        def run(start: int, size: int) -> None:
            pointers = [t.data_ptr() + start * t.element_size() if t is not None else None for t in tensors]
            function(*pointers, size, ctypes.byref(args))

        futures = [_executor(len(spans) - 1).submit(run, *span) for span in spans[1:]] if len(spans) > 1 else []
        run(*spans[0])
        for future in futures:
            future.result()
    if body < numel:  # torch's scalar tail, by torch's own kernel on the last few elements
        tail = slice(body, numel)
        tail_grad = grad[tail] * multiplier if multiplier != 1.0 else grad[tail]
        targets = (param, exp_avg, exp_avg_sq)
        if out is not None:
            for source, target in zip(targets, out):
                target[tail].copy_(source[tail])
            targets = out
        fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
        fused([targets[0][tail]], [tail_grad], [targets[1][tail]], [targets[2][tail]], [], [step], lr=lr,
              beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        if copy_to is not None:
            copy_to[tail].copy_(targets[0][tail])


class CpuAdamStepper:
    """Steps single fp32 host masters of a torch Adam/AdamW with `adam_step`, in the optimizer's own state.

    The state is what torch's fused step keeps (`step` as a 0-dim fp32 tensor, `exp_avg`,
    `exp_avg_sq`), created the same way, so checkpoints, schedulers and a later torch step see
    no difference. Only groups that chose torch's fused kernel (`fused: True`, which zerotrain
    sets where the user left it open) without amsgrad/maximize/capturable/differentiable and
    with plain-number hyperparameters are taken: the others keep torch's step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def supports(self, master: torch.Tensor, group_index: int) -> bool:
        """Whether `master` (of group `group_index`) can be stepped by the kernel."""
        return self.supports_group(group_index) and master.dtype == torch.float32 \
            and master.device.type == "cpu" and master.is_contiguous()

    def supports_group(self, group_index: int) -> bool:
        """Whether group `group_index`'s update is one the kernel runs (fp32 CPU tensors of it, see `supports`)."""
        if type(self.optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or kernel() is None:
            return False
        group = self.optimizer.param_groups[group_index]
        if not group.get("fused") or any(group.get(k) for k in ("amsgrad", "maximize", "capturable",
                                                                "differentiable")):
            return False
        numbers = [group["lr"], *group["betas"], group["eps"], group["weight_decay"]]
        return all(isinstance(x, (int, float)) for x in numbers)

    def _state(self, master: torch.Tensor) -> dict:
        state = self.optimizer.state[master]
        if not state:  # what torch's fused step creates
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        return state

    def hyper(self, group_index: int) -> dict:
        """`adam_step`'s hyperparameters of group `group_index` (as they are now: schedules apply)."""
        group = self.optimizer.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    decoupled=bool(group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW)))

    def step(self, master: torch.Tensor, grad: torch.Tensor, group_index: int, multiplier: float = 1.0,
             copy_to: Optional[torch.Tensor] = None) -> None:
        """One step of `master` with `grad * multiplier`; the new weights also go to `copy_to` if given."""
        state = self._state(master)
        state["step"].add_(1)
        adam_step(master, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], multiplier=multiplier,
                  copy_to=copy_to, **self.hyper(group_index))

    def step_to(self, master: torch.Tensor, grad: torch.Tensor, group_index: int,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], multiplier: float = 1.0,
                copy_to: Optional[torch.Tensor] = None) -> None:
        """The step `step()` would take, written into `out` = (master, exp_avg, exp_avg_sq) buffers: `master`
        and its state keep their values (a fresh state is created, as zeros at step 0). `swap_in` keeps it."""
        state = self._state(master)
        adam_step(master, grad, state["exp_avg"], state["exp_avg_sq"], state["step"] + 1, multiplier=multiplier,
                  copy_to=copy_to, out=out, **self.hyper(group_index))

    def swap_in(self, master: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Make the step `step_to` wrote into `out` the current one by swapping buffers (no copy): `master`
        (the same tensor object, so optimizer groups and state keys still hold) now has `out[0]`'s storage.
        Returns the previous buffers, free for the next `step_to`."""
        state = self.optimizer.state[master]
        previous = (master.detach(), state["exp_avg"], state["exp_avg_sq"])
        master.data = out[0]
        state["exp_avg"], state["exp_avg_sq"] = out[1], out[2]
        state["step"].add_(1)
        return previous
