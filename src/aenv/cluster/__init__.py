"""Many nodes behind stateless gateways: cluster state, discovery and deployment glue."""
