"""Adapters that put the outbox under an agent framework's own tool mechanism.

Each adapter is an optional extra and its own module, imported by the user, never by
``outbox`` itself: ``outbox.integrations.pydantic_ai``, ``outbox.integrations.openai_agents``,
``outbox.integrations.langgraph``. They share two rules (:mod:`outbox.integrations.keys`,
:mod:`outbox.reports`): the intent key comes from the run's durable identity, never from the
model provider's tool-call id (which changes when a run is replayed); and a call that has not
finished is answered "pending, do not call again with a new key", never as an error to retry.
"""
