"""A saga: release two projects together, or undo both (docs/sagas.md).

Each step is an outbox operation; each undo (a rollback of the release the step made) is
one too, recorded only if a later step is refused. The steps run one after the other, each
released only once the one before it is confirmed.

Before running it, start the reference service and the outbox with the same tools file:

    outbox dev deploy-service &
    OUTBOX_CONFIG=examples/tools.toml outbox up &
    OUTBOX_CONFIG=examples/tools.toml python examples/saga_release.py --key release-1.2.3

It prints the saga's state (``completed``) and its steps. With ``--refuse-last`` a third step
asks the service to roll back a release that does not exist, which it refuses (422): the two
releases are then rolled back, the second first, and the saga ends ``compensated``. Run it
again with the same ``--key`` (as a restarted agent would): the saga and its steps are
found, not made again, and the service holds what it held.
"""

from __future__ import annotations

import argparse
import sys
import time

from sqlalchemy.orm import Session

import outbox
from outbox.db import get_engine
from outbox.sagas import SagaState

RELEASE, ROLLBACK = "deploy.create_release", "deploy.rollback_release"
#: A saga in one of these states moves no more by itself.
SETTLED = {SagaState.COMPLETED, SagaState.COMPENSATED, SagaState.CANCELLED, SagaState.NEEDS_HUMAN}


#: Who asks: recorded as requested_by, and the agent whose saga key it is.
AGENT = "examples/saga_release.py"


def main() -> int:
    """Open the saga (or find it), wait until it settles, print it; 0 if it ended as asked."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--key", default="release-1.2.3", help="the saga's key (the intent)")
    parser.add_argument("--targets", default="project-a,project-b", help="projects, in order")
    parser.add_argument("--version", default="1.2.3", help="the version to release")
    parser.add_argument(
        "--refuse-last", action="store_true", help="a last step the service refuses (422)"
    )
    parser.add_argument("--wait-s", type=float, default=60.0, help="how long to wait")
    args = parser.parse_args()
    engine = get_engine()
    targets = [t for t in args.targets.split(",") if t]

    with Session(engine) as session, session.begin():  # the saga and its steps, or nothing
        # The saga key is this agent's (agent= defaults to requested_by): read it back as it.
        saga = outbox.saga(session, args.key, requested_by=AGENT)
        for target in targets:
            saga.step(
                f"release-{target}",
                tool=RELEASE,
                target=target,
                payload={"version": args.version},
                # "{remote_ref}": the release this step made, filled in when it is undone.
                compensate=outbox.Compensate(ROLLBACK, target, {"release": "{remote_ref}"}),
            )
        if args.refuse_last:
            saga.step(
                "refused",
                tool=ROLLBACK,
                target=targets[-1],
                payload={"release": "rel-that-does-not-exist"},
            )

    deadline = time.monotonic() + args.wait_s
    while True:
        with Session(engine) as session:
            view = outbox.get_saga(session, args.key, agent=AGENT)
        assert view is not None  # noqa: S101 -- committed above
        if view.state in SETTLED or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    print(f"saga {view.key}: {view.state.value}" + (f" ({view.reason})" if view.reason else ""))  # noqa: T201
    for step in view.steps:
        state = step.state.value if step.state is not None else "pruned"
        undo = f", undone: {step.compensation_state.value}" if step.compensation_state else ""
        print(f"  {step.name}: {state} {step.remote_ref or ''}{undo}")  # noqa: T201
    wanted = SagaState.COMPENSATED if args.refuse_last else SagaState.COMPLETED
    if view.state is not wanted:
        print(f"expected {wanted.value}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
