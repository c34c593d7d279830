"""How the suite is cut into the work units pytest-xdist hands to its workers
(tests/conftest.py): what is split, what goes first, and that the lists name real tests."""

from __future__ import annotations

from tests.conftest import (
    E2B_SERVER_MODULES,
    LONG_UNITS,
    REPO,
    SPLIT_MODULES,
    unit_rank,
    work_unit,
)


def test_a_unit_is_a_module_a_split_modules_function_or_the_e2b_servers_modules() -> None:
    assert (
        work_unit("tests/execution/test_pool.py::test_one[a-b]") == "tests/execution/test_pool.py"
    )
    (split,) = sorted(SPLIT_MODULES)[:1]
    assert work_unit(f"{split}::test_x[a::b]") == f"{split}::test_x"
    assert work_unit(f"{split}::test_x") == f"{split}::test_x"
    for module in E2B_SERVER_MODULES:
        assert work_unit(f"{module}::test_y[p]") == "e2b-server"


def test_the_long_units_go_first_in_their_order_and_name_real_tests() -> None:
    assert len(set(LONG_UNITS)) == len(LONG_UNITS)
    ranks = [unit_rank(unit) for unit in LONG_UNITS]
    assert ranks == sorted(ranks) == list(range(len(LONG_UNITS)))
    assert unit_rank("tests/test_not_long.py") == len(LONG_UNITS)
    for unit in LONG_UNITS:
        module, _, function = unit.partition("::")
        if unit == "e2b-server":
            continue
        path = REPO / module
        assert path.is_file(), unit  # a unit renamed or gone: refresh LONG_UNITS
        text = path.read_text()
        assert not function or f"def {function}(" in text or f"\n{function} = " in text, unit
        assert bool(function) == (module in SPLIT_MODULES), unit
    for module in SPLIT_MODULES:
        assert (REPO / module).is_file(), module
