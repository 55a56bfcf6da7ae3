"""``python -m outbox``: the same as the ``outbox`` console script."""

from outbox.cli import main

main()
