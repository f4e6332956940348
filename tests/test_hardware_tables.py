"""The hardware tables the planner checks jobs against (``planning/hardware.py``) and the docs
that print them: docs/trainium.md "Workers per node" and docs/spmd-tpu.md "TPU generations and
slices" must equal the code, row by row. Pure: neither Ray nor torch."""

from __future__ import annotations

import math
import os

import pytest

from ray_train_xla.planning.hardware import (
    MULTI_HOST_CHIPS,
    TPU_GENERATIONS,
    TRAINIUM_GENERATIONS,
    TRAINIUM_INSTANCES,
    devices_per_chip,
    tpu_generation,
    trainium_instance,
    trainium_lnc,
)

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")


def doc_table(page: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule left out) of the first table under ``heading``."""
    with open(os.path.join(DOCS, page)) as f:
        lines = f.read().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    rows = [line for line in lines if line.startswith("|")]
    assert rows, f"no table under {heading!r} in {page}"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_trainium_doc_table_is_the_code():
    expected = []
    for inst in TRAINIUM_INSTANCES.values():
        gen = TRAINIUM_GENERATIONS[inst.generation]
        expected.append([f"`{inst.name}`", f"{inst.chips} {gen.chip}",
                         f"{gen.cores_per_chip} {gen.core}", str(inst.devices(1)),
                         str(inst.devices(2)) if 2 in gen.lnc else "-", str(gen.default_lnc)])
    assert doc_table("trainium.md", "Workers per node") == expected


def test_tpu_doc_table_is_the_code():
    expected = []
    per_host = math.prod(MULTI_HOST_CHIPS)
    for gen in TPU_GENERATIONS.values():
        names = ", ".join(f"`{n}`" for n in (gen.name, *gen.aliases))
        sizes = ", ".join(f"{gen.accelerator_type(c)} {s}" for c, s in gen.topologies.items())
        expected.append([names, str(gen.cores_per_chip), str(gen.devices_per_chip),
                         f"up to {gen.single_host_chips} "
                         f"({gen.single_host_chips * gen.devices_per_chip})",
                         f"{per_host} ({per_host * gen.devices_per_chip})", sizes])
    assert doc_table("spmd-tpu.md", "TPU generations and slices") == expected


def test_every_figure_says_where_it_comes_from():
    rows = [*TRAINIUM_GENERATIONS.values(), *TRAINIUM_INSTANCES.values(), *TPU_GENERATIONS.values()]
    assert all(r.source for r in rows)


@pytest.mark.parametrize("name, lnc, workers", [
    ("trn2.48xlarge", None, 64), ("trn2.48xlarge", "1", 128), ("trn2", "2", 64),
    ("trn2.3xlarge", None, 4), ("trn2u.48xlarge", "1", 128), ("TRN1.32XLARGE", None, 32),
    ("trn1", "", 32), ("trn1.2xlarge", None, 2), ("trn3", None, 64), ("trn3", "1", 128),
])
def test_logical_neuroncores_per_instance(name, lnc, workers):
    inst = trainium_instance(name)
    assert inst.devices(trainium_lnc(inst, lnc)) == workers


@pytest.mark.parametrize("name", ["trn9", "trn2.5xlarge", "trn3.48xlarge", "p5.48xlarge", ""])
def test_unknown_trainium_instances_are_refused_naming_the_known(name):
    with pytest.raises(ValueError, match="not a Trainium instance this package knows") as info:
        trainium_instance(name)
    assert "trn2.48xlarge" in str(info.value) and "trn1n.32xlarge" in str(info.value)


def test_lnc_values_each_generation_takes():
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='2' is not valid on Trainium"):
        trainium_lnc(trainium_instance("trn1.32xlarge"), "2")
    with pytest.raises(ValueError, match="expected 1 or 2"):
        trainium_lnc(trainium_instance("trn2"), "4")


def test_generation_spellings():
    for spelling, generation, devices in (
            ("tpu7x-32", "v7x", 2), ("v7x-8", "v7x", 2), ("TPU-V7X", "v7x", 2), ("v7-8", "v7x", 2),
            ("v5e-8", "v5litepod", 1), ("TPU-V5LITEPOD", "v5litepod", 1), ("v6e-16", "v6e", 1),
            ("v9z-16", "v9z", 1), ("", "", 1)):
        assert (tpu_generation(spelling), devices_per_chip(spelling)) == (generation, devices)
