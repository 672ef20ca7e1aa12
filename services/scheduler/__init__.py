"""The scheduler service: job API, node API, and the scheduling loop over the ledger."""
