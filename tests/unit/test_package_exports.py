"""The ``outbox`` package's public names, loaded on first use (issue 33)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import outbox
import outbox.sql


@pytest.mark.parametrize("name", outbox.__all__)
def test_every_public_name_resolves_to_its_modules_object(name: str) -> None:
    """Every name in `outbox.__all__` resolves, to the very object its module defines."""
    value = getattr(outbox, name)
    if name == "__version__":
        assert isinstance(value, str)
        return
    module = importlib.import_module(outbox._EXPORTS[name])
    assert value is getattr(module, name)


def test_the_export_map_names_exactly_the_public_names() -> None:
    """The lazy map covers `__all__` (the version aside) and nothing else; `dir()` shows all."""
    assert set(outbox._EXPORTS) == set(outbox.__all__) - {"__version__"}
    assert set(outbox.__all__) <= set(dir(outbox))


def test_an_unknown_name_is_an_attribute_error() -> None:
    """A name the package does not export raises AttributeError, as a plain module does."""
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = outbox.no_such_name


@pytest.mark.parametrize(
    "code",
    [
        "import outbox.resolve, outbox; f = outbox.resolve",
        "import outbox; from outbox.resolve import RESOLVABLE_STATES; f = outbox.resolve",
        "import outbox; f = outbox.resolve; import outbox.resolve; f = outbox.resolve",
        "from outbox import resolve as f",
        "import outbox.resolve as f",
    ],
)
def test_outbox_resolve_is_always_the_function(code: str) -> None:
    """`outbox.resolve` is the function, not its module, whichever import came first."""
    check = code + "\nimport inspect\nassert inspect.isfunction(f), f\n"
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_importing_the_package_loads_no_database_machinery() -> None:
    """`import outbox` alone loads no SQLAlchemy and no settings (pydantic-settings)."""
    code = (
        "import sys, outbox\n"
        "assert 'sqlalchemy' not in sys.modules\n"
        "assert 'pydantic_settings' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_every_statement_module_is_reachable_from_the_lazy_sql_package() -> None:
    """``outbox.sql`` lists its modules for its lazy ``__getattr__``: every module in the
    folder must be there, or ``sql.guards`` fails in a process that has not imported it by
    another way (the metrics scrape did)."""
    folder = {info.name for info in pkgutil.iter_modules(outbox.sql.__path__)}
    assert folder == set(outbox.sql.__all__)
    code = "import outbox.sql as s; [getattr(s, name) for name in s.__all__]"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
