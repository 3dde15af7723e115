"""The replica tier: how stale the signals a replica routes on are."""
