"""NeMo-Run job for the hybrid-1.5B recipe with Muon, on Slurm or on the local GPUs.

    python examples/cluster/nemo_run_hybrid_muon.py --executor local --gpus 8 --recipe hybrid-1.5b-8gpu
    python examples/cluster/nemo_run_hybrid_muon.py --executor slurm --account ACC --partition batch \\
        --nodes 4 --gpus 8 --container-image nvcr.io/nvidia/pytorch:25.09-py3 --ssh-host login.cluster --ssh-user me
    ... --dryrun   prints what would be submitted

Extra `--set section.key=value` arguments override recipe values. Needs `pip install nemo-run` (0.11.x) on the machine
that submits, and megatron-muon installed where the job runs (e.g. in the container).
"""

from __future__ import annotations

import argparse

import nemo_run as run


def pretrain_script(recipe: str, overrides: list[str], output_dir: str) -> run.Script:
    """`python -m megatron_muon.cli pretrain ...`; the executor's torchrun launcher starts one rank per GPU."""
    args = ["pretrain", "--recipe", recipe, "--output-dir", output_dir, "--save", f"{output_dir}/checkpoints"]
    args += [f"--set={item}" for item in overrides]
    return run.Script(path="megatron_muon.cli", entrypoint="python", m=True, args=args,
                      env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "8"})


def slurm_executor(account: str, partition: str | None, nodes: int, gpus_per_node: int, time: str,
                   container_image: str | None, container_mounts: list[str], job_dir: str,
                   ssh_host: str | None = None, ssh_user: str | None = None) -> run.SlurmExecutor:
    """torchrun per node: NeMo-Run turns ntasks_per_node=GPUs into one task per node running torchrun --nproc=GPUs."""
    tunnel = (run.SSHTunnel(host=ssh_host, user=ssh_user or "", job_dir=job_dir) if ssh_host
              else run.LocalTunnel(job_dir=job_dir))
    return run.SlurmExecutor(
        account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node, time=time, exclusive=True, container_image=container_image,
        container_mounts=container_mounts, tunnel=tunnel, launcher="torchrun",
    )


def local_executor(gpus: int) -> run.LocalExecutor:
    return run.LocalExecutor(ntasks_per_node=gpus, launcher="torchrun")


def build(argv: list[str] | None = None):
    """(script, executor, experiment name) for the command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=("slurm", "local"), default="slurm")
    parser.add_argument("--recipe", default="hybrid-1.5b-multinode")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--output-dir", default="runs/hybrid-1.5b-muon")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--account", default="")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default="04:00:00")
    parser.add_argument("--container-image", default=None)
    parser.add_argument("--container-mount", dest="container_mounts", action="append", default=[])
    parser.add_argument("--job-dir", default="nemo_run_jobs")
    parser.add_argument("--ssh-host", default=None)
    parser.add_argument("--ssh-user", default=None)
    parser.add_argument("--dryrun", action="store_true")
    args = parser.parse_args(argv)
    script = pretrain_script(args.recipe, args.overrides, args.output_dir)
    if args.executor == "local":
        executor = local_executor(args.gpus)
    else:
        if not args.account:
            parser.error("--account is required for --executor slurm")
        executor = slurm_executor(args.account, args.partition, args.nodes, args.gpus, args.time,
                                  args.container_image, args.container_mounts, args.job_dir, args.ssh_host,
                                  args.ssh_user)
    return script, executor, f"{args.recipe}-muon", args.dryrun


def main(argv: list[str] | None = None) -> None:
    script, executor, name, dryrun = build(argv)
    run.run(script, executor=executor, name=name, dryrun=dryrun)


if __name__ == "__main__":
    main()
