"""The reconciler: sweep, lookups, replays, escalation and webhooks."""
