"""Run an unchanged Megatron-LM script with the plugin registered:

    python -m megatron_muon.launch path/to/pretrain_gpt.py [Megatron-LM arguments]
    torchrun --nproc-per-node 8 -m megatron_muon.launch pretrain_gpt.py --optimizer muon ...

Registration puts our optimizers under megatron-core's names (`--optimizer muon` / `dist_muon` then run ours) and
makes our specs importable for `--spec megatron_muon.specs <name>`; the script then runs as `__main__` via runpy,
exactly as `python pretrain_gpt.py ...` would, so no Megatron-LM fork or patch is needed. For `--optimizer muon
--use-distributed-optimizer`, the DDP layout Megatron-LM computes through megatron's layer-wise optimizer becomes the
owner layout (`megatron/owner_layout.use_owner_layout_in_megatron`). Every optimizer the
script builds through `get_megatron_optimizer` gets the plugin's GPU fast paths (`megatron/fast_paths.py`, which
lists them) unless `--no-fast-paths` comes before the script; `--muon-split-heads` there turns on the plugin's
per-head orthogonalization, for which Megatron-LM has no argument.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

USAGE = ("usage: python -m megatron_muon.launch [--cpu-mode] [--no-fast-paths] [--muon-split-heads] "
         "path/to/pretrain_gpt.py [Megatron-LM arguments]")
CPU_MODE_FLAG, NO_FAST_PATHS_FLAG, SPLIT_HEADS_FLAG = "--cpu-mode", "--no-fast-paths", "--muon-split-heads"


def _enter_cpu_mode() -> None:
    """CPU mode plus what Megatron-LM's training script needs beyond megatron-core: it asserts CUDA is available
    and pins data-loader memory on the current accelerator."""
    import torch
    from torch import _dynamo

    from megatron_muon._cpu import enable_cpu_mode

    enable_cpu_mode()
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    _dynamo.config.disable = True  # megatron's jit_fuser would compile for tens of seconds on CPU


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships its dataset index helpers compiled but without their Makefile, and Megatron-LM's
    initialization runs `make` on them, which then fails; when the compiled module imports, skip the rebuild."""
    from pathlib import Path as _Path

    from megatron.core.datasets import utils as dataset_utils

    if (_Path(dataset_utils.__file__).parent / "Makefile").is_file():
        return  # a source checkout: let Megatron-LM build as usual
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip().splitlines()[0] + "\n  --cpu-mode       run megatron-core on CPU with "
              "gloo (machines without a GPU: smoke tests and demos)\n  --no-fast-paths  keep megatron's own optimizer "
              "step passes (for comparisons)\n  --muon-split-heads  orthogonalize QKV / GDN in_proj per head "
              "(the plugin's muon_split_heads; Megatron-LM has no flag for it)")
        return 0 if args else 2
    flags = set()
    while args and args[0] in (CPU_MODE_FLAG, NO_FAST_PATHS_FLAG, SPLIT_HEADS_FLAG):
        flags.add(args.pop(0))
    cpu_mode = CPU_MODE_FLAG in flags
    if not args:
        print(f"megatron-muon launch: error: no script given; {USAGE}", file=sys.stderr)
        return 2
    script = Path(args[0])
    if not script.is_file():
        print(f"megatron-muon launch: error: script '{script}' does not exist; pass the path to a Megatron-LM "
              "script such as pretrain_gpt.py.", file=sys.stderr)
        return 2
    if cpu_mode:
        _enter_cpu_mode()

    import megatron_muon

    megatron_muon.register()
    if SPLIT_HEADS_FLAG in flags:
        from megatron_muon.megatron.muon_config import set_plugin_default

        set_plugin_default("muon_split_heads", True)
    from megatron_muon.megatron.owner_layout import use_owner_layout_in_megatron

    use_owner_layout_in_megatron()  # `--optimizer muon --use-distributed-optimizer`: DDP in the owner layout
    if NO_FAST_PATHS_FLAG not in flags:
        from megatron_muon.megatron.fast_paths import install_after_every_optimizer_build

        install_after_every_optimizer_build()
    _use_prebuilt_dataset_helpers()
    script_dir = str(script.resolve().parent)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # what `python script.py` does: its helpers import as top-level modules
    sys.argv = [str(script), *args[1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
