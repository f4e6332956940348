"""``ray-train-xla profile``: ask a running run, through its storage, for a profile of every
rank (the request and the wait are ``toolkit/observability/profiling.py``'s)."""

from __future__ import annotations

import argparse
import json

from ray_train_xla.tools.args import EXIT_FAILED, CommandError, positive_int, positive_seconds


def add_parser(sub) -> argparse.ArgumentParser:
    """``profile``: ask a running run for a profile of every rank."""
    profile = sub.add_parser(
        "profile",
        help="ask a running run for a profile of the next N steps on every rank",
        description="Write a profile request into the run's storage (RUN: the run's directory, "
        "RunConfig(storage_path=...)/name, a local path or a URI such as s3://bucket/runs/x). "
        "Rank 0 of the run looks for requests every 2 s, picks the first step a few seconds of "
        "steps ahead and every rank captures those steps with its stack's profiler (torch_xla's "
        "profiler; torch.profiler on native TorchNeuron, TorchTPU and CPU), into "
        "RUN/profiles/<first step>/rank-<r>/. A run that is not going takes the request when it "
        "(re)starts. With --wait, waits for the traces of every rank and prints where they are. "
        "Exits 1 when --wait runs out or the storage cannot be written.",
    )
    profile.add_argument("run", metavar="RUN", help="the run's directory (a path or a URI)")
    profile.add_argument("--steps", type=positive_int, required=True, metavar="N",
                         help="how many steps to capture")
    profile.add_argument("--wait", type=positive_seconds, default=None, metavar="SECONDS",
                         help="wait up to SECONDS for every rank's trace")
    profile.add_argument("--json", action="store_true", help="print the outcome as JSON")
    return profile


def cmd_profile(args: argparse.Namespace) -> int:
    from ray_train_xla.toolkit.observability import profiling
    from ray_train_xla.toolkit.run_storage import RunStorage

    try:
        storage = RunStorage.at(args.run)
        request_id = profiling.write_request(storage, args.steps)
    except Exception as exc:  # noqa: BLE001 (storage errors are the user's to fix)
        raise CommandError(f"could not write a profile request under {args.run}: "
                           f"{type(exc).__name__}: {exc}", EXIT_FAILED) from exc
    out = {"id": request_id, "run": storage.path, "steps": args.steps}
    if args.wait is not None:
        out.update(profiling.wait_for_profile(storage, request_id, args.wait))
    if args.json:
        print(json.dumps(out))
    elif args.wait is None:
        print(f"profile request {request_id} ({args.steps} steps) written under "
              f"{storage.full(profiling.REQUESTS)}; the traces will be under "
              f"{storage.full(profiling.PROFILES)}/<first step>/rank-<r>/")
    elif out.get("complete"):
        missed = sorted(r for r, state in out["ranks"].items() if state == "missed")
        print(f"steps {out['start']}-{out['start'] + out['count'] - 1} of "
              f"{out['world_size'] - len(missed)} of {out['world_size']} ranks: "
              f"{storage.full(out['directory'])}"
              + (f" (missed by ranks {missed}: they learned of it too late)" if missed else ""))
    if args.wait is not None and not out.get("complete"):
        raise CommandError(f"profile request {request_id}: {out.get('state')} after "
                           f"{args.wait:g} s", EXIT_FAILED)
    return 0
