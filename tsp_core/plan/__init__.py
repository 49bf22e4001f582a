"""Planning tools: fake-tensor memory simulation (and, later, the cost model)."""
