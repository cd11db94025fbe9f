"""The user-code sandbox: its launcher (stdlib only, run by path as root), probe, uid leases and cgroups."""
