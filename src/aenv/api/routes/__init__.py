"""Control-plane routers, one module per resource."""
