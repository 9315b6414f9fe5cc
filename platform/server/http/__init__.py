"""HTTP plumbing every API shares (tenant, admin, console): the error shape, request bodies, server-sent
events, downloads, and the ingress middleware (keys, body caps, failed-key limits, forwarded addresses, logs)."""
