"""The request path, the same for every front end: a public request validated, tokenized, its
constraint compiled, checked against the replica's room and its tenant's limits, and queued in
the engine as a sequence."""
