"""tests/run_suite.py: how `make test` splits a selection into the Ray tests and the others,
and the exit status it gives from the two."""

import run_suite


def test_a_selection_is_split_into_the_ray_tests_and_the_others():
    expr, rest = run_suite.split_marker(["-q", "-m", "not e2e", "tests"])
    assert (expr, rest) == ("not e2e", ["-q", "tests"])
    assert run_suite.halves(expr) == ("(not e2e) and ray and not beside",
                                      "(not e2e) and (not ray or beside)")
    assert run_suite.split_marker(["-mfoo", "tests"]) == ("foo", ["tests"])
    assert run_suite.halves(None) == ("ray and not beside", "(not ray or beside)")


def test_the_exit_status_is_the_first_failure_and_an_empty_half_is_no_failure():
    assert run_suite.combined(0, 0) == 0
    assert run_suite.combined(1, 0) == 1
    assert run_suite.combined(0, 2) == 2
    assert run_suite.combined(1, 2) == 1
    assert run_suite.combined(5, 0) == 0 and run_suite.combined(0, 5) == 0
    assert run_suite.combined(5, 1) == 1
    assert run_suite.combined(5, 5) == 5  # nothing selected at all
