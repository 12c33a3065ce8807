"""NeMo-Run job for the hybrid-1.5B recipe with Muon, on Slurm or on this machine.

    python examples/cluster/nemo_run_hybrid_muon.py --executor slurm --account ACC --partition batch \\
        --nodes 4 --gpus 8 --container-image nvcr.io/nvidia/pytorch:25.09-py3 --ssh-host login.cluster --ssh-user me \\
        --output-dir /lustre/me/runs/hybrid-1.5b-muon
    python examples/cluster/nemo_run_hybrid_muon.py --executor local --gpus 8 --recipe hybrid-1.5b-8gpu
    python examples/cluster/nemo_run_hybrid_muon.py --executor local --gpus 2 --threads 1 --recipe tiny-cpu \\
        --set training.micro_batch_size=4                                                     # CPU, 2 ranks
    ... --dryrun   prints (and for Slurm writes) what would be submitted, without running it

Extra `--set section.key=value` arguments override recipe values. Needs `pip install megatron-muon[cluster]`
(NeMo-Run 0.11) on the machine that submits, and megatron-muon installed where the job runs (e.g. in the container).
The job saves to and loads from OUTPUT_DIR/checkpoints: submitted again, it resumes where the last one saved, and
Slurm's SIGTERM before the time limit makes it save and stop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import nemo_run as run

SAVE_BEFORE_LIMIT = "TERM@180"  # seconds before the time limit: one step and a save fit in them


def pretrain_script(recipe: str, overrides: list[str], output_dir: str, threads: int) -> run.Script:
    """`python -m megatron_muon.cli pretrain ...`; the executor's torchrun launcher starts one rank per GPU."""
    checkpoints = f"{output_dir}/checkpoints"
    args = ["pretrain", "--recipe", recipe, "--output-dir", output_dir, "--save", checkpoints, "--load", checkpoints]
    args += [f"--set={item}" for item in overrides]
    return run.Script(path="megatron_muon.cli", entrypoint="python", m=True, args=args,
                      env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": str(threads)})


def slurm_executor(account: str, partition: str | None, nodes: int, gpus_per_node: int, time: str,
                   container_image: str | None, container_mounts: list[str], job_dir: str,
                   ssh_host: str | None = None, ssh_user: str | None = None) -> run.SlurmExecutor:
    """One task per node running torchrun --nproc-per-node=GPUs (NeMo-Run's torchrun launcher does that).

    The job runs the installed package, so nothing is packaged from the submitting checkout (plain `run.Packager`).
    """
    tunnel = (run.SSHTunnel(host=ssh_host, user=ssh_user or "", job_dir=job_dir) if ssh_host
              else run.LocalTunnel(job_dir=job_dir))
    return run.SlurmExecutor(
        account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node, time=time, exclusive=True, signal=SAVE_BEFORE_LIMIT,
        container_image=container_image, container_mounts=container_mounts, tunnel=tunnel, launcher="torchrun",
        packager=run.Packager(),
    )


def local_executor(ranks: int) -> run.LocalExecutor:
    return run.LocalExecutor(ntasks_per_node=ranks, launcher="torchrun")


def build(argv: list[str] | None = None):
    """(script, executor, experiment name, dryrun) for the command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=("slurm", "local"), default="slurm")
    parser.add_argument("--recipe", default="hybrid-1.5b-multinode")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--output-dir", default=None,
                        help="run directory (log, checkpoints); for Slurm an absolute path on shared storage; "
                             "local default: runs/RECIPE-muon")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node (ranks per node; on CPU, ranks)")
    parser.add_argument("--threads", type=int, default=8, help="OMP_NUM_THREADS for each rank")
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
    if args.executor == "local" and shutil.which("torchrun") is None:  # NeMo-Run starts `torchrun` and `python` by name
        parser.error("torchrun is not on PATH: activate the environment megatron-muon is installed in "
                     f"(e.g. source {os.path.dirname(sys.executable)}/activate)")
    if args.executor == "local":
        output_dir = os.path.abspath(args.output_dir or f"runs/{args.recipe}-muon")
    elif args.output_dir and os.path.isabs(args.output_dir):
        output_dir = args.output_dir
    else:  # the job starts in NeMo-Run's per-experiment directory: a relative path would not be found again
        parser.error("--executor slurm needs --output-dir as an absolute path on the cluster's shared storage "
                     "(e.g. /lustre/$USER/runs/hybrid-1.5b-muon), so that the next submission finds the checkpoints")
    script = pretrain_script(args.recipe, args.overrides, output_dir, args.threads)
    if args.executor == "local":
        executor = local_executor(args.gpus)
    else:
        if not args.account:
            parser.error("--account is required for --executor slurm")
        executor = slurm_executor(args.account, args.partition, args.nodes, args.gpus, args.time,
                                  args.container_image, args.container_mounts, args.job_dir, args.ssh_host,
                                  args.ssh_user)
    return script, executor, f"{args.recipe}-muon", args.dryrun


def main(argv: list[str] | None = None) -> int:
    """Runs (or dry-runs) the job and waits for it; the exit status is 0 only if it succeeded."""
    script, executor, name, dryrun = build(argv)
    with run.Experiment(name, executor=executor) as experiment:
        experiment.add(script, name=name, tail_logs=True)
        if dryrun:
            experiment.dryrun(delete_exp_dir=False)
            print(f"dry run: nothing submitted; the job's scripts are under {experiment._exp_dir}")
            return 0
        experiment.run()
    # leaving the experiment waited for the job (tailing its log) and recorded how it ended
    failed = {job.id: job.state.name for job in experiment.jobs if job.state.name != "SUCCEEDED"}
    if failed:
        print(f"NeMo-Run job {name} did not succeed ({failed}); its log is under {experiment._exp_dir}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
