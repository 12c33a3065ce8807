"""Run a check script under TRITON_INTERPRET=1 in a subprocess (the interpreter must be on before Triton loads)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(script: Path, timeout: float = 240) -> None:
    """Fails the calling test unless the script exits 0 and prints "interpreter ok"."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and "interpreter ok" in done.stdout, (done.stdout + done.stderr)[-3000:]


def patch_for_numpy_2_5() -> None:
    """Inside an interpreter subprocess: Triton 3.6's interpreter turns scalars into 1-element arrays and calls int()
    on them for range(); numpy >= 2.5 refuses that. Index the single element instead (a CPU-debugging shim only;
    compiled kernels are unaffected)."""
    import triton.runtime.interpreter as interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_with_numpy_2_5_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_numpy_2_5_index


def below_autotuning(kernel):
    """The JIT function under a kernel's autotune and heuristics wrappers (the autotuner times configs on a GPU, so
    under the interpreter a check launches one config itself)."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    return kernel
