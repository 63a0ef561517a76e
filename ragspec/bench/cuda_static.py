"""What the CUDA backend's step costs, measured without a GPU.

* :func:`count_step_kernels`: the kernels one step launches, per decoder layer and in all:
  the step is run on the ``meta`` device (shapes, no arithmetic) with the Triton launches
  recorded instead of run and the torch operators logged by a dispatch mode (views and
  allocations launch nothing and are not counted).
* :func:`compile_for_hopper`: every Triton kernel one step launches, compiled for sm_90
  through Triton's NVIDIA backend with a faked target (``warmup``: PTX and cubin, no GPU),
  each PTX then read by ``ptxas -v`` for its registers and spills; the specialisations of a
  1-row and a many-row step must be the same kernels (row invariance, as compiled).
* :func:`host_pack_ms`: the host work of one step's rows (packing a request's draft tree
  into the step's flat int32 buffer, padded to its graph bucket), timed on this CPU.

``python scripts/cuda_static_check.py --json`` prints the three. The model is the default
model's shapes (SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 key-value heads of 64, MLP
1536, vocabulary 49152: :mod:`ragspec.backend.cuda.shapes`) with no weights read. This
module imports torch and triton (and transformers through the backend); it runs on a CPU
machine.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..backend.cuda.shapes import DEFAULT_SHAPES, default_shapes_model

__all__ = [
    "DEFAULT_SHAPES",
    "Launch",
    "compile_for_hopper",
    "count_step_kernels",
    "default_shapes_model",
    "host_pack_ms",
    "record_launches",
    "sample_tree",
]


def sample_tree(nodes: int):
    """A branching draft tree of ``nodes`` nodes: three chains below the root, interleaved (a
    tree, not a chain: its rows attend through a path)."""
    from ..tree import interleaved_tree

    return interleaved_tree(range(100, 100 + nodes), 3, "sample")


@dataclass
class Launch:
    """One recorded Triton launch: the kernel, its grid and its arguments."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict


@dataclass
class _Recorder:
    launches: list[Launch] = field(default_factory=list)
    torch_ops: list[str] = field(default_factory=list)


_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh"}


@contextlib.contextmanager
def record_launches(torch_ops: bool = True) -> Iterator[_Recorder]:
    """Within the block, the CUDA backend's Triton launches are recorded (not run) and,
    with ``torch_ops``, the torch operators that launch a kernel are logged by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..backend.cuda import launch

    rec = _Recorder()

    class _Grid:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def record(*args: Any, **kwargs: Any) -> None:
                rec.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))

            return record

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not (getattr(func, "is_view", False) or name in _NO_KERNEL):
                rec.torch_ops.append(name)
            return func(*args, **(kwargs or {}))

    saved = launch.launcher
    launch.launcher = lambda kernel, device: _Grid(kernel)
    try:
        with _Ops() if torch_ops else contextlib.nullcontext():
            yield rec
    finally:
        launch.launcher = saved


def _step_batch(rows: int, past: int = 600):
    """One request's rows at ``past`` cached positions: a plain step (1 row), a branching
    tree of ``rows - 1`` nodes (up to 128 rows), else a prefill chunk of ``rows`` tokens."""
    from ..backend.cuda.batch import RequestRows

    if rows <= 1 or rows > 128:
        return [RequestRows(0, past, [7] * rows)]
    tree = sample_tree(rows - 1)
    return [RequestRows(0, past, [7, *tree.tokens.tolist()], tree)]


def _recorded_step(layers: int, rows: int, dtype: torch.dtype = torch.bfloat16, device: str = "meta") -> _Recorder:
    from ..backend.cuda import CudaTarget
    from ..backend.cuda.batch import pack_rows

    target = CudaTarget(default_shapes_model(layers, dtype, device), numerics="exact", graphs=False, context=1024,
                        max_slots=2)  # fmt: skip
    batch = pack_rows(_step_batch(rows), path_width=80).to(device)
    with record_launches() as rec:
        target._step(batch)
    return rec


def count_step_kernels(rows: int = 1, layers: int = 30) -> dict[str, Any]:
    """Kernels one step of ``rows`` rows launches on the default model's shapes.

    Returns:
        ``{"per_layer": n, "per_step": n, "layers": L, "triton_per_layer": n,
        "torch_per_layer": [names], "fixed": n}`` (``fixed``: the launches outside the
        layers: embedding + first norm, output layer, argmax).
    """
    full, one_less = _recorded_step(layers, rows), _recorded_step(layers - 1, rows)
    total = len(full.launches) + len(full.torch_ops)
    per_layer = total - (len(one_less.launches) + len(one_less.torch_ops))
    torch_layer = list(full.torch_ops)
    for name in one_less.torch_ops:
        torch_layer.remove(name)
    return {
        "per_layer": per_layer,
        "per_step": total,
        "layers": layers,
        "triton_per_layer": len(full.launches) - len(one_less.launches),
        "torch_per_layer": torch_layer,
        "fixed": total - layers * per_layer,
    }


class _Hopper:
    """A Triton driver that compiles for sm_90 and launches nothing (no GPU needed)."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> str:
        return "faked-sm90"

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def _ptxas_report(ptx: str, ptxas: str) -> dict[str, int]:
    """Registers and spill bytes of a PTX module (``ptxas -v`` for sm_90a)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w", encoding="utf-8") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-v", "-arch=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip()[-2000:])
    text = res.stderr + res.stdout
    regs = max((int(m) for m in re.findall(r"Used (\d+) registers", text)), default=0)
    stores = sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", text))
    loads = sum(int(m) for m in re.findall(r"(\d+) bytes spill loads", text))
    return {"registers": regs, "spill_stores": stores, "spill_loads": loads}


def compile_for_hopper(
    rows: tuple[int, ...] = (1, 17, 256), dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
) -> dict[str, Any]:
    """Compile every Triton kernel of the step for sm_90 (Triton's NVIDIA backend, a faked
    target; no GPU), for each of ``dtypes`` and each row count of ``rows``.

    Returns:
        ``{"compiled": n, "failed": n, "spilled": n, "kernels": [{"name", "dtype",
        "registers", "spill_stores", "spill_loads", "error"}], "row_dependent": [names]}``:
        distinct compiled kernels; ``row_dependent`` lists the kernels whose compiled
        specialisation differs between row counts (there must be none).

    Where triton was imported in interpreter mode (``TRITON_INTERPRET=1``: its kernels are
    interpreted functions, which do not compile), the compile runs in a fresh interpreter.

    Raises:
        ImportError: triton (with its NVIDIA backend) is not installed.
        RuntimeError: the fresh interpreter failed.
    """
    from triton import knobs
    from triton.runtime.driver import driver

    if knobs.runtime.interpret:
        return _compile_in_a_fresh_interpreter(rows, dtypes)

    ptxas = knobs.nvidia.ptxas.path
    hopper = _Hopper()
    results: dict[tuple, dict[str, Any]] = {}
    keys_by_rows: dict[int, set] = {}
    touched: set = set()
    saved = driver._active
    driver.set_active(hopper)
    try:
        for dtype in dtypes:
            for n in rows:
                rec = _recorded_step(2, n, dtype, "meta")
                seen = keys_by_rows.setdefault(n, set())
                for launch in rec.launches:
                    touched.add(launch.kernel)
                    name = launch.kernel.fn.__name__
                    try:
                        compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
                        key = (name, str(dtype), compiled.hash)
                        seen.add(key)
                        if key not in results:
                            info = {"name": name, "dtype": str(dtype).removeprefix("torch."), "error": None}
                            info.update(_ptxas_report(compiled.asm["ptx"], ptxas))
                            results[key] = info
                    except Exception as e:  # a compile error is a result here
                        key = (name, str(dtype), f"error: {str(e)[:200]}")
                        seen.add(key)
                        results.setdefault(
                            key, {"name": name, "dtype": str(dtype), "error": f"{type(e).__name__}: {e}"}
                        )
    finally:
        driver._active = saved
        for kernel in touched:  # nothing compiled for the faked device stays in the kernels' caches
            kernel.device_caches.pop(hopper.get_current_device(), None)
    kernels = list(results.values())
    first = keys_by_rows[rows[0]]
    row_dependent = sorted({k[0] for n in rows[1:] for k in keys_by_rows[n] ^ first})
    return {
        "compiled": sum(1 for k in kernels if not k["error"]),
        "failed": sum(1 for k in kernels if k["error"]),
        "spilled": sum(1 for k in kernels if not k["error"] and (k["spill_stores"] or k["spill_loads"])),
        "kernels": kernels,
        "row_dependent": row_dependent,
    }


def _compile_in_a_fresh_interpreter(rows: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> dict[str, Any]:
    import json
    import os
    import sys

    names = [str(d).removeprefix("torch.") for d in dtypes]
    code = (
        "import json, torch\n"
        "from ragspec.bench.cuda_static import compile_for_hopper\n"
        f"res = compile_for_hopper({tuple(rows)!r}, tuple(getattr(torch, n) for n in {names!r}))\n"
        "print(json.dumps(res))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"the sm_90 compile failed in a fresh interpreter: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def host_pack_ms(rows: int, repeats: int = 200, past: int = 700) -> float:
    """Milliseconds to pack one request's ``rows``-row step (a branching tree of ``rows -
    1`` nodes, or one plain row) into its graph bucket's staging buffer, median of
    ``repeats``, on this CPU."""
    from ..backend.cuda.batch import buffer_size, pack_rows
    from ..backend.cuda.graphs import DEFAULT_BUCKETS

    reqs = _step_batch(rows, past)
    bucket = next(b for b in DEFAULT_BUCKETS if b >= rows)
    staging = torch.empty(buffer_size(bucket, 80), dtype=torch.int32)
    times = []
    for _ in range(repeats + 5):
        t0 = time.perf_counter()
        pack_rows(reqs, path_width=80, rows=bucket, scratch_slot=16, out=staging)
        times.append(time.perf_counter() - t0)
    times = sorted(times[5:])
    return 1e3 * times[len(times) // 2]
