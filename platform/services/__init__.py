"""The service layer: one module per resource with the operations the admin API, the console and the CLI
share (plain arguments in, domain records or small DTOs out, no HTTP types), over the `Services` every layer
above holds (`loramux.services.container`), which `loramux.services.builder` wires from Settings.

    tenants      tenants, their API keys, tenant tiers
    admin_keys   operators' admin keys
    adapters     upload, list, show, visibility, delete, warm and pin adapters
    prices       prices and the ones in force
    billing      summaries, exports and recent usage from the cost ledger
    engine_state the engine's and the replicas' live state, latency per minute

Errors are the domain's own exceptions (tenancy, registry, prices, billing, admin keys) plus the few
defined here; `loramux.server.http.errors` maps each family to an HTTP status.
"""
from __future__ import annotations
