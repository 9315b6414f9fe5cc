"""Speculative decoding: the proposers (prompt lookup, a draft model, Medusa heads), the verifier and the policy that
decides when speculating pays."""
