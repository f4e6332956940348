"""Run a selection of the suite as two pytest processes side by side: the tests that use Ray
(marker ``ray``: real clusters, one after another, as ``conftest.py`` orders them) and the tests
that do not, followed in their process by the Ray tests marked ``beside`` (on a cluster of that
process's own). The Ray tests wait for their clusters and workers a good part of the time; the
others (plans, contracts in subprocesses, local helpers) use that time, and the ``beside``
modules the time left when they are done.

    python tests/run_suite.py -m "not e2e" [pytest options]

The Ray tests print as they run; the other process's output follows when both have ended. The
exit status is the first failing one of the two; pytest's "no tests collected" (5) fails only
when neither half has a test."""

from __future__ import annotations

import subprocess
import sys
import tempfile

NO_TESTS = 5


def split_marker(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the -m expression, the other arguments)."""
    expr, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "-m" and i + 1 < len(argv):
            expr, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("-m") and len(argv[i]) > 2:
            expr = argv[i][2:]
        else:
            rest.append(argv[i])
        i += 1
    return expr, rest


def halves(expr: str | None) -> tuple[str, str]:
    """The -m expressions of the two processes: the Ray tests but those marked ``beside``; the
    tests without Ray, then those."""
    base = f"({expr}) and " if expr else ""
    return base + "ray and not beside", base + "(not ray or beside)"


def main(argv: list[str]) -> int:
    expr, rest = split_marker(argv)
    with_ray, without_ray = halves(expr)
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    with tempfile.TemporaryFile(mode="w+") as log:
        local = subprocess.Popen([*pytest, "-m", without_ray, *rest], stdout=log,
                                 stderr=subprocess.STDOUT)
        try:
            ray_status = subprocess.call([*pytest, "-m", with_ray, *rest])
            local_status = local.wait()
        except BaseException:
            local.kill()
            local.wait()
            raise
        log.seek(0)
        print(f"\n== the tests without Ray (-m {without_ray!r}), run beside the Ray tests ==",
              flush=True)
        sys.stdout.write(log.read())
    print(f"\n== exit status: Ray tests {ray_status}, the others {local_status}", flush=True)
    return combined(ray_status, local_status)


def combined(ray_status: int, local_status: int) -> int:
    """The suite's exit status from its two halves'."""
    for status in (ray_status, local_status):
        if status not in (0, NO_TESTS):
            return status
    return NO_TESTS if ray_status == local_status == NO_TESTS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
