"""The root help's epilog (every ``OUTBOX_*`` setting) without importing the settings.

:func:`outbox.cli.output.environment_help` builds it from :class:`outbox.config.Settings`,
which costs pydantic-settings' import, most of ``outbox --help``'s time (issue 33). A copy of
its text is kept in :mod:`outbox.cli.epilog_text`, with the SHA-256 of ``outbox/config.py`` it
was made from: while the file is unchanged the copy is shown, otherwise the text is built
again (right, only slower). tests/unit/test_cli_startup.py checks that the copy is current;
``python -m outbox.cli.epilog`` writes it again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: The settings' module, whose content the copy was made from.
CONFIG_SOURCE = Path(__file__).resolve().parent.parent / "config.py"
#: The copy's module.
TEXT_MODULE = Path(__file__).resolve().parent / "epilog_text.py"


def config_digest() -> str:
    """The SHA-256 of ``outbox/config.py`` as it is now (empty if it cannot be read)."""
    try:
        return hashlib.sha256(CONFIG_SOURCE.read_bytes()).hexdigest()
    except OSError:  # pragma: no cover -- an install without sources
        return ""


def root_epilog() -> str:
    """The epilog of ``outbox --help``: the stored copy if still current, else built now."""
    from outbox.cli import epilog_text  # noqa: PLC0415 -- the copy, a plain string

    if config_digest() == epilog_text.CONFIG_SHA256:
        return epilog_text.TEXT
    from outbox.cli.output import environment_help  # noqa: PLC0415 -- the slow way

    return environment_help()


def render() -> str:
    """The source of :mod:`outbox.cli.epilog_text` for the settings as they are now."""
    from outbox.cli.output import environment_help  # noqa: PLC0415 -- generation only

    paragraphs = environment_help().split("\n\n")
    lines = "".join(
        f"        {json.dumps(paragraph, ensure_ascii=False)},\n" for paragraph in paragraphs
    )
    return (
        '"""A copy of the root help\'s epilog, written by ``python -m outbox.cli.epilog``; do not '
        'edit."""\n\n'
        "# ruff: noqa: E501\n\n"
        "#: The SHA-256 of outbox/config.py the copy was made from.\n"
        f'CONFIG_SHA256 = "{config_digest()}"\n\n'
        "#: :func:`outbox.cli.output.environment_help` as it was then.\n"
        'TEXT = "\\n\\n".join(\n'
        "    [\n"
        f"{lines}"
        "    ]\n"
        ")\n"
    )


if __name__ == "__main__":  # pragma: no cover -- a maintainer's command
    TEXT_MODULE.write_text(render())
