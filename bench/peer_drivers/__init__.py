"""The drivers of ``bench/peers.py``: the same job on each peer system, and on ours.

One module per system. Each holds the peer's side that runs in its own worker processes
(started as real subprocesses with ``PYTHONPATH`` on ``bench/``, so ``peer_drivers.<module>``
imports there too) and the agents' side, a :class:`peer_drivers.base.PeerDriver`, that
``peers.py`` measures. :mod:`peer_drivers.base` holds what they share: the job's tables, the
HTTP call, the agents, worker processes and one measured case.
"""
