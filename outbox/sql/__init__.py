"""Every SQL statement of the outbox core, grouped by the component that runs it."""
