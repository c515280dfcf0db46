#!/bin/sh
# The image's entrypoint (under tini): `aenv "$@"`, after two preparations for a node:
# the cgroup controllers handed down to sandboxes, and no OOM kill of the whole container.
#
# cgroup v2 and a private cgroup namespace (Docker's and containerd's default there): the
# container's cgroup is the namespace's root and holds our own processes, and the kernel
# refuses to enable controllers for child cgroups of a cgroup that has processes in it
# ("no internal processes"). runsc puts every sandbox into a child cgroup with memory, CPU
# and pids limits (and the node freezes it there to pause), so before the server starts we
# move this container's processes into a leaf of their own and enable, for the children,
# every controller the container was given. Container runtimes nested in containers do the
# same. Skipped for any other command (gateway, CLI), on cgroup v1, when the container shares
# the host's cgroup namespace (not at the root: nothing of ours to move), or when the
# hierarchy is read-only (not privileged).
set -eu

CGROUP_ROOT="${AENV_CGROUP_ROOT:-/sys/fs/cgroup}"   # overridable for tests only
SELF_CGROUP="${AENV_SELF_CGROUP:-/proc/self/cgroup}"

delegate_cgroups() {
    [ -f "$CGROUP_ROOT/cgroup.controllers" ] || return 0
    [ "$(cat "$SELF_CGROUP")" = "0::/" ] || return 0
    [ -w "$CGROUP_ROOT/cgroup.subtree_control" ] || return 0
    leaf="$CGROUP_ROOT/aenv-init"
    mkdir -p "$leaf"
    # One pid per write, as the kernel wants; a process that exited meanwhile is no error.
    while read -r pid; do
        echo "$pid" >> "$leaf/cgroup.procs" 2>/dev/null || true
    done < "$CGROUP_ROOT/cgroup.procs"
    # "cpuset cpu io memory pids" -> "+cpuset +cpu +io +memory +pids"
    controllers=$(sed -e 's/[^ ][^ ]*/+&/g' "$CGROUP_ROOT/cgroup.controllers")
    [ -n "$controllers" ] || return 0
    # All at once; if the kernel refuses one, each on its own, so one controller we may not
    # hand down (say cpuset) costs only its own limits, not the node's start.
    echo "$controllers" > "$CGROUP_ROOT/cgroup.subtree_control" 2>/dev/null && return 0
    for c in $controllers; do
        echo "$c" > "$CGROUP_ROOT/cgroup.subtree_control" 2>/dev/null \
            || echo "aenv-entrypoint: cannot enable the ${c#+} controller for sandboxes" >&2
    done
}

# The kubelet (cgroup v2) may set memory.oom.group on the container's cgroup: the kernel
# then kills every process of the container, every sandbox of the node, when it OOM-kills
# one. Each sandbox has a memory limit of its own, and a process that outgrows the host is
# one process to lose, not the node: turn the group kill off for the node's container.
ungroup_oom() {
    [ -f "$CGROUP_ROOT/cgroup.controllers" ] || return 0
    path=$(sed -n 's/^0:://p' "$SELF_CGROUP")
    case "$path" in
        /aenv-init) path=/ ;;  # moved there by delegate_cgroups: the container is the root
    esac
    group="$CGROUP_ROOT${path%/}/memory.oom.group"
    [ -w "$group" ] || return 0
    echo 0 > "$group" 2>/dev/null \
        || echo "aenv-entrypoint: cannot turn off memory.oom.group for the node" >&2
}

if [ "${1:-}" = "server" ]; then
    delegate_cgroups
    ungroup_oom
fi
exec aenv "$@"
