"""``ray-train-xla``: demo, check, plan, doctor, consolidate, goodput, profile from the command
line. Each command's parser and function live in its module: demo.py, check.py, plan.py,
doctor.py, consolidate_cli.py, goodput.py, profile.py."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ray_train_xla.tools import check, consolidate_cli, demo, doctor, goodput, plan, profile
from ray_train_xla.tools.args import EXIT_USAGE, CommandError

EXIT_STATUS_HELP = (
    "Exit status: 0 success; 1 the command ran and failed (doctor found a FAIL, the demo failed, a "
    "step of check failed, consolidate could not read the checkpoint's storage or write OUT, goodput "
    "could not read the run's storage or write the PNG, profile could not write its request or --wait "
    "ran out); 2 the command line is wrong (an unknown or invalid option, a configuration the backend "
    "would refuse, a CHECKPOINT that does not exist or holds no model, an OUT that is a directory, a "
    "--hf config that is missing or does not fit the checkpoint, a RUN_PATH without goodput events). "
    "Every error is one line on stderr."
)


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line: what is wrong and where the usage is. The top
    parser's ``command_parsers`` maps each command to its parser."""

    command_parsers: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} "
                              f"(see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    import ray_train_xla

    parser = Parser(
        prog="ray-train-xla",
        description="Ray Train on AWS Trainium and TPU (native TorchNeuron, native TorchTPU, "
        "torch_xla; CPU for development): demo, check, plan, "
        "doctor, consolidate, goodput, profile. Without a command, prints this help.",
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {ray_train_xla.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.command_parsers = {name: add(sub) for name, add, _ in COMMANDS}
    return parser


# Each command, the function adding its parser and the function running it, in the order --help
# lists them.
COMMANDS = (("demo", demo.add_parser, demo.cmd_demo), ("check", check.add_parser, check.cmd_check),
            ("plan", plan.add_parser, plan.cmd_plan), ("doctor", doctor.add_parser, doctor.cmd_doctor),
            ("consolidate", consolidate_cli.add_parser, consolidate_cli.cmd_consolidate),
            ("goodput", goodput.add_parser, goodput.cmd_goodput),
            ("profile", profile.add_parser, profile.cmd_profile))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: sys.argv[1:]); returns the exit status.

    Every error a user can cause is one line on stderr, ``ray-train-xla COMMAND: error: ...``:
    usage and configuration errors (argparse's, XLAConfigError, CommandError) exit 2, a command
    that ran and failed exits 1. Anything else is a bug and keeps its traceback."""
    from ray_train_xla.errors import XLAConfigError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_help()
        return 0
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command's parser, which argparse would leave to the top one
            parser.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE if exc.code else 0
    prog = f"{parser.prog} {args.command}"
    try:
        code = {name: cmd for name, _, cmd in COMMANDS}[args.command](args)
        sys.stdout.flush()
    except (XLAConfigError, CommandError) as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return getattr(exc, "exit_code", EXIT_USAGE)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ray-train-xla plan --json | head`): stop quietly, as Unix
        # tools do, without a traceback when Python flushes stdout at exit.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
