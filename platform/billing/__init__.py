"""Billing: the cost ledger (rows, write-ahead log, recovery), prices, usage records, money arithmetic and reports."""
