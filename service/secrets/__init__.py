"""Project secrets: stored encrypted (box) and bound to hosts, created, checked and deleted (store)."""
