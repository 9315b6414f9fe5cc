"""Tenancy: tenants, tiers, tenant and admin API keys, their key cache, and rate limits (per process and shared in
Redis)."""
