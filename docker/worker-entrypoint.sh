#!/bin/sh
# The worker image's entrypoint (under tini): gives the user-code sandboxes a
# writable cgroup with the memory and pids controllers, then execs the command.
#
# Container runtimes mount the container's cgroup read-only unless the
# container is privileged. With a private cgroup namespace (compose's
# `cgroup: private`; Kubernetes on cgroup v2 nodes always) that mount is only
# the container's own subtree, so remounting it read-write (CAP_SYS_ADMIN,
# AppArmor unconfined) reaches nothing of the host. On cgroup v2 the
# container's cgroup then has to hand memory and pids to child cgroups, which
# the "no internal processes" rule forbids while processes live in it: they
# move to the leaf service/sandbox/cgroup.py expects (WORKER_LEAF), as
# docker-in-docker does. The worker probes the result before running any user
# code: if a step fails here it says so and refuses user code (fail closed).
set -u

warn() { echo "cispo worker entrypoint: $*; user code will be refused" >&2; }

if [ "${CISPO_SANDBOX:-auto}" != "off" ]; then
    for mnt in $(awk '$3 == "cgroup" || $3 == "cgroup2" { print $2 }' /proc/self/mounts); do
        [ -w "$mnt" ] || mount -o remount,bind,rw "$mnt" || warn "cannot remount $mnt read-write"
    done
    root=/sys/fs/cgroup
    # cgroup v2, at the root of its own cgroup namespace (cgroup.type exists on
    # every cgroup but the host's real root, whose processes must never move).
    if [ -f "$root/cgroup.controllers" ] && [ -f "$root/cgroup.type" ] && [ "$(cat /proc/self/cgroup)" = "0::/" ]; then
        leaf="$root/cispo-worker"
        mkdir -p "$leaf" || warn "cannot create $leaf"
        for pid in $(cat "$root/cgroup.procs"); do
            echo "$pid" > "$leaf/cgroup.procs" 2>/dev/null  # a process that just ended cannot move
        done
        echo "+memory +pids" > "$root/cgroup.subtree_control" || warn "cannot delegate memory and pids in $root"
    fi
fi
exec "$@"
