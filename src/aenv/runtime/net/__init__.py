"""Host networking of sandboxes, shared by backends: per-sandbox network slots (namespaces,
veths, addresses), egress rules and the in-namespace proxy for domain rules, and the
node's own networks that no sandbox may reach."""
