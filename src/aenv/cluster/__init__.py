"""Many nodes behind stateless gateways: cluster state in Redis (node registrations and
heartbeats, rosters, sandbox→node bindings), the node's agent that keeps its registration
fresh, the gateway (one port, E2B-compatible, routing by sandbox id and placing creates with
a pluggable scheduler) and failover of hibernated sandboxes through the shared repository.
See docs/cluster.md."""
