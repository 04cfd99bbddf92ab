"""python -m launch.supervise [OPTIONS] -- python -m launch.train --config ... --workdir DIR

Runs the training command under the fault-tolerance supervisor (zaya_jax/fault/supervisor.py): restarts after
crashes and hangs, rewinds and skips data after NaN losses and loss spikes, restarts on the devices available,
logs every action to DIR/events.jsonl. The run directory is taken from the command's --workdir.

--nproc N runs the command as N processes of one jax.distributed job on this host (one per GPU by default,
--devices-per-process K otherwise; on the CPU each process gets K emulated devices); when one dies or hangs, all
are stopped and the group restarts from the latest checkpoint (zaya_jax/fault/group.py)."""

import argparse
import sys

from zaya_jax.fault.group import PLATFORMS, GroupSpec
from zaya_jax.fault.supervisor import Supervisor, SupervisorConfig

from launch._cli import ArgumentParser, UsageError, user_errors


@user_errors("launch.supervise")
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)  # parsed first, so --help works without a command
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-restarts", type=int, default=5,
                    help="restarts in a row without getting past the furthest step reached; then it gives up")
    ap.add_argument("--backoff", type=float, default=1.0, help="first restart delay (s), doubling")
    ap.add_argument("--hang-factor", type=float, default=10.0, help="hang = no step for this x median step time")
    ap.add_argument("--min-hang", type=float, default=60.0, help="never call a hang sooner than this (s)")
    ap.add_argument("--startup", type=float, default=900.0, help="allowance before the first step (s)")
    ap.add_argument("--spike-z", type=float, default=8.0)
    ap.add_argument("--spike-window", type=int, default=50)
    ap.add_argument("--spike-min-steps", type=int, default=20)
    ap.add_argument("--skip-window", type=int, default=1, help="steps of data skipped after a NaN/spike")
    ap.add_argument("--notify", help="shell command receiving each action as JSON on stdin")
    ap.add_argument("--devices-cmd", help="shell command printing the number of usable devices before a restart")
    ap.add_argument("--nproc", type=int, default=1, help="processes (ranks) of one jax.distributed job on this host")
    ap.add_argument("--devices-per-process", type=int, default=1, help="GPUs (or emulated CPU devices) per rank")
    ap.add_argument("--platform", choices=PLATFORMS, default="auto",
                    help="how ranks get their devices (auto: cpu when JAX_PLATFORMS=cpu, else gpu)")
    ap.add_argument("--peer-grace", type=float, default=5.0,
                    help="when one rank died: seconds the others get to exit before SIGKILL")
    args = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        raise UsageError("give the training command after --: python -m launch.supervise [OPTIONS] -- "
                         "python -m launch.train --workdir DIR ...")
    workdir = next((a.split("=", 1)[1] for a in command if a.startswith("--workdir=")), None)
    if workdir is None and "--workdir" in command:
        workdir = command[command.index("--workdir") + 1]
    if not workdir:
        raise UsageError("the training command must name its --workdir")
    group = GroupSpec(nproc=args.nproc, devices_per_process=args.devices_per_process, platform=args.platform)
    cfg = SupervisorConfig(workdir=workdir, command=command, max_restarts=args.max_restarts,
                           backoff_s=args.backoff, hang_factor=args.hang_factor, min_hang_s=args.min_hang,
                           startup_s=args.startup, spike_window=args.spike_window, spike_z=args.spike_z,
                           spike_min_steps=args.spike_min_steps, skip_window=args.skip_window,
                           notify_cmd=args.notify, devices_cmd=args.devices_cmd, group=group,
                           peer_grace_s=args.peer_grace)
    sys.exit(Supervisor(cfg).run())


if __name__ == "__main__":
    main()
